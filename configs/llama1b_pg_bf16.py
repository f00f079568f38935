"""Single-GPU 1B check: the "1b" Llama (16 layers, d 2048) on pg_en (GPT-2 tokens), recipe bf16.

    python -m fp4jax.train --config configs/llama1b_pg_bf16.py \
        --workdir runs/llama1b_pg_bf16 --config.data.path=data/pg_en

One H200 (or one MI355X). Token arithmetic: global batch 16 x 2048 = 32,768 tokens/step; 3,000 steps =
98.3M tokens, about 3 epochs of pg_en's 33.3M training tokens. Throughput on one H200:
`python benchmarks/bench_train.py --config configs/llama1b_pg_bf16.py` (docs/performance.md).
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("1b_pg", "bf16")
