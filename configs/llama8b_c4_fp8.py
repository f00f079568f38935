"""Llama 3.1-8B on C4, MLPerf llama3.1_8b setup, recipe fp8_mlperf: the study's baseline, the FP8 of the
MLPerf reference: Transformer Engine's "hybrid" format (E4M3 forward, E5M2 gradients) with delayed scaling
(amax history 4, newest amax). Every rung's FP8 stages use the same scaling (config key fp8_scaling).

    python -m fp4jax.train --config configs/llama8b_c4_fp8.py \
        --workdir runs/llama8b_c4_fp8 --config.data.path=/data/c4/en
    launch/single_node.sh configs/llama8b_c4_fp8.py          # 8 GPUs of one node
    sbatch launch/slurm.sbatch configs/llama8b_c4_fp8.py     # several nodes

Token arithmetic: global batch 32 x 8192 = 262,144 tokens/step. Evaluation (the first 1024 validation
sequences, 8.39M tokens) every 12,288 sequences = 384 steps = 100.7M tokens; stop at eval loss <= 3.3.
The BF16 reference needs ~179.4k sequences ~ 1.47B tokens ~ 5.6k steps (15 evaluations); the budget is
12,000 steps = 3.15B tokens.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("8b_c4", "fp8_mlperf")
