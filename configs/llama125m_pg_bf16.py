"""Single-GPU small-scale ladder: a 125M Llama on the pg_en books corpus (GPT-2 tokens), recipe bf16.

    python -m fp4jax.train --config configs/llama125m_pg_bf16.py \
        --workdir runs/llama125m_pg_bf16 --config.data.path=data/pg_en

One H200 (or one MI355X). The other rungs (llama125m_pg_<rung>.py) change only the recipe. Token
arithmetic: global batch 32 x 1024 = 32,768 tokens/step; 2,000 steps = 65.5M tokens, about 2 epochs of
pg_en's 33.3M training tokens. Evaluation: the first 256 sequences (262k tokens) of the unshuffled
validation books every 6,400 sequences = 200 steps. target_eval_loss 4.0 is provisional (not yet
calibrated on a BF16 run); runs go the full budget so every rung has a whole curve, and tokens-to-target
is reported at the first evaluation at or below it.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("125m_pg", "bf16")
