"""Single-GPU ladder rung: 125M Llama on pg_en, recipe mxfp4_fprop_dgrad (setup: llama125m_pg_bf16.py).

    python -m fp4jax.train --config configs/llama125m_pg_fprop_dgrad.py \
        --workdir runs/llama125m_pg_fprop_dgrad --config.data.path=/work/shared/data/pg_en

32 x 1024 = 32,768 tokens/step, 2,000 steps = 65.5M tokens; eval every 200 steps.
"""

from configs import llama125m_pg_bf16


def get_config():
    c = llama125m_pg_bf16.get_config()
    c.recipe = "mxfp4_fprop_dgrad"
    return c
