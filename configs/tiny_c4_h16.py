"""Tiny Llama on the bundled C4 sample, recipe mxfp4_full_h16, on CPU in a few minutes (the README's command).

    python -m fp4jax.train --config configs/tiny_c4_h16.py --workdir runs/tiny_c4_h16

300 updates x 8 sequences x 64 tokens = 153,600 tokens (the sample's train split has ~534k GPT-2 tokens);
about 1.5 minutes on 2 busy CPU cores, the training loss falling from 10.8 to about 7.2. Evaluates the
first 32 validation sequences every 800 training sequences (100 updates). Short sequences because the
GPT-2 vocabulary (50,304 logits per token) dominates the cost of so small a model.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.recipe = "mxfp4_full_h16"
    c.model = base.model_config("tiny")
    c.data = base.default_data_config()  # the bundled C4 sample, GPT-2 tokenizer
    c.seq_len = 64
    c.global_batch = 8
    c.steps = 300
    c.optimizer.peak_lr = 3e-3
    c.optimizer.warmup_steps = 30
    c.optimizer.lr_decay_steps = 300
    c.eval_every_sequences = 800
    c.eval_sequences = 32
    c.eval_batch_size = 8
    c.eval_at_end = True
    c.target_eval_loss = 7.5  # reached by ~step 200 on CPU: shows the tokens-to-target bookkeeping
    c.stop_at_target = False
    c.checkpoint_every_steps = 100
    return c
