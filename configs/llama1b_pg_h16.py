"""Single-GPU 1B check, recipe mxfp4_full_h16 (setup and token arithmetic: llama1b_pg_bf16.py).

    python -m fp4jax.train --config configs/llama1b_pg_h16.py \
        --workdir runs/llama1b_pg_h16 --config.data.path=data/pg_en
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("1b_pg", "mxfp4_full_h16")
