"""Tiny Llama on the bundled C4 sample, recipe mxfp4_full_h16, on CPU in one to two minutes (the README's
command).

    python -m fp4jax.train --config configs/tiny_c4_h16.py --workdir runs/tiny_c4_h16

300 updates x 8 sequences x 64 tokens = 153,600 tokens (the sample's train split has ~534k GPT-2 tokens);
one to two minutes on 2 CPU cores (51 s and 105 s of training, two machines, 2026-12), the training loss
falling from 10.8 to about 7.2.
Evaluates the first 32 validation sequences every 800 training sequences (100 updates). Short sequences
because the GPT-2 vocabulary (50,304 logits per token) dominates the cost of so small a model.
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("tiny_c4", "mxfp4_full_h16")
