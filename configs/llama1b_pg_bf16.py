"""Single-GPU 1B check: the "1b" Llama (16 layers, d 2048) on pg_en (GPT-2 tokens), recipe bf16.

    python -m fp4jax.train --config configs/llama1b_pg_bf16.py \
        --workdir runs/llama1b_pg_bf16 --config.data.path=/work/shared/data/pg_en

One H200 (or one MI355X). Token arithmetic: global batch 16 x 2048 = 32,768 tokens/step; 3,000 steps =
98.3M tokens, about 3 epochs of pg_en's 33.3M training tokens. Throughput on one H200:
`python benchmarks/bench_train.py --config configs/llama1b_pg_bf16.py` (docs/performance.md).
"""

from configs import base, llama125m_pg_bf16


def get_config():
    c = llama125m_pg_bf16.get_config()
    c.model = base.model_config("1b")
    c.seq_len, c.global_batch = 2048, 16
    c.steps = 3000
    c.optimizer.update(peak_lr=6e-4, warmup_steps=200, lr_decay_steps=3000)
    c.eval_every_sequences, c.eval_sequences, c.eval_batch_size = 3200, 128, 16
    c.checkpoint_every_steps = 500
    return c
