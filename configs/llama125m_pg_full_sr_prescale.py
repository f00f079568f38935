"""Single-GPU ladder rung: 125M Llama on pg_en, recipe mxfp4_full_sr_prescale (setup: llama125m_pg_bf16.py).

    python -m fp4jax.train --config configs/llama125m_pg_full_sr_prescale.py \
        --workdir runs/llama125m_pg_full_sr_prescale --config.data.path=data/pg_en

32 x 1024 = 32,768 tokens/step, 2,000 steps = 65.5M tokens; eval every 200 steps.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("125m_pg", "mxfp4_full_sr_prescale")
