"""Single-GPU small-scale ladder: a 125M Llama on the pg_en books corpus (GPT-2 tokens), recipe bf16.

    python -m fp4jax.train --config configs/llama125m_pg_bf16.py \
        --workdir runs/llama125m_pg_bf16 --config.data.path=/work/shared/data/pg_en

One H200 (or one MI355X). The other rungs (llama125m_pg_<rung>.py) change only the recipe. Token
arithmetic: global batch 32 x 1024 = 32,768 tokens/step; 2,000 steps = 65.5M tokens, about 2 epochs of
pg_en's 33.3M training tokens. Evaluation: the first 256 sequences (262k tokens) of the unshuffled
validation books every 6,400 sequences = 200 steps. target_eval_loss 4.0 is provisional (not yet
calibrated on a BF16 run); runs go the full budget so every rung has a whole curve, and tokens-to-target
is reported at the first evaluation at or below it.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.recipe = "bf16"
    c.model = base.model_config("125m")
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.data = base.default_data_config()
    c.data.update(
        path="data/pg_en", train_glob="pg_en-train.*.json.gz", eval_glob="pg_en-validation.*.json.gz"
    )
    c.seq_len, c.global_batch = 1024, 32
    c.steps = 2000
    c.optimizer.update(peak_lr=1.5e-3, warmup_steps=100, lr_decay_steps=2000)
    c.eval_every_sequences, c.eval_sequences, c.eval_batch_size = 6400, 256, 32
    c.target_eval_loss, c.stop_at_target, c.eval_at_end = 4.0, False, True
    c.checkpoint_every_steps = 500
    return c
