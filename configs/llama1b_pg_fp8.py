"""Single-GPU 1B check, recipe fp8 (setup and token arithmetic: llama1b_pg_bf16.py).

    python -m fp4jax.train --config configs/llama1b_pg_fp8.py \
        --workdir runs/llama1b_pg_fp8 --config.data.path=/work/shared/data/pg_en
"""

from configs import llama1b_pg_bf16


def get_config():
    c = llama1b_pg_bf16.get_config()
    c.recipe = "fp8"
    return c
