"""Proxy study, 350M Llama on the pg_en books, GPT-2 tokens: every rung, any LR.

    python -m fp4jax.train --config configs/proxy350m_pg.py \
        --workdir runs/proxy350m_pg_full_lr3e-3 --config.data.path=data/pg_en \
        --config.recipe=mxfp4_full --config.optimizer.peak_lr=3e-3

Shaped like the 8B run (fp4jax/configs/rungs.py): constant LR after 100 warmup updates, 1,000 updates of 32 x
1024 tokens = 32.8M tokens (under one epoch of pg_en's 33.3M training tokens), an evaluation of 256 validation
sequences spread over the validation split every 640 training sequences (2 % of the run; up to 1,024 after the
last update), no separator between documents and the reference's delayed FP8 scaling. The sweep's recipes:
fp4jax.configs.rungs.PROXY_RECIPES; the default recipe is the FP8 baseline.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("350m_proxy_pg", "fp8_mlperf")
