"""Proxy study, 125M Llama on allenai/c4 en, GPT-2 tokens: every rung, any LR.

    python -m fp4jax.train --config configs/proxy125m_c4.py \
        --workdir runs/proxy125m_c4_full_lr3e-3 --config.data.path=data/c4_en \
        --config.recipe=mxfp4_full --config.optimizer.peak_lr=3e-3

Shaped like the 8B run (fp4jax/configs/rungs.py): constant LR after 100 warmup updates, 1,000 updates of 32 x
1024 tokens = 32.8M tokens (at most one epoch), an evaluation of 256 validation sequences spread over the
validation split every 640 training sequences (2 % of the run; up to 1,024 after the last update), no
separator between documents and the reference's delayed FP8 scaling. The sweep's recipes:
fp4jax.configs.rungs.PROXY_RECIPES; the default recipe is the FP8 baseline.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("125m_proxy_c4", "fp8_mlperf")
