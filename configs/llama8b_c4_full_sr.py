"""Llama 3.1-8B on C4, MLPerf llama3.1_8b setup, recipe mxfp4_full_sr: MXFP4 everywhere, stochastic
rounding in Dgrad and Wgrad (paper: no convergence).

    python -m fp4jax.train --config configs/llama8b_c4_full_sr.py \
        --workdir runs/llama8b_c4_full_sr --config.data.path=/data/c4/en
    launch/single_node.sh configs/llama8b_c4_full_sr.py          # 8 GPUs of one node
    sbatch launch/slurm.sbatch configs/llama8b_c4_full_sr.py     # several nodes

Token arithmetic: global batch 32 x 8192 = 262,144 tokens/step. Evaluation (the first 1024 validation
sequences, 8.39M tokens) every 12,288 sequences = 384 steps = 100.7M tokens; stop at eval loss <= 3.3.
The BF16 reference needs ~179.4k sequences ~ 1.47B tokens ~ 5.6k steps (15 evaluations); the budget is
12,000 steps = 3.15B tokens.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("8b_c4", "mxfp4_full_sr")
