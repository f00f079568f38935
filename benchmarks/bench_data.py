"""Input-pipeline throughput on this machine versus what an 8-GPU MI355X node consumes.

    python benchmarks/bench_data.py                                   # the bundled C4 sample, GPT-2
    python benchmarks/bench_data.py --path=/path/to/pg_en --train_glob='pg_en-train.*.json.gz'

Measures (1) cold tokenization into an empty cache (tokens/s), (2) the warm start (seconds until the first
batch when the cache exists) and (3) the iterator's delivery rate from the cache (tokens/s of `inputs`).
MLPerf llama3.1_8b on 8x MI355X takes about 180k sequences of 8192 tokens in about 100 minutes, i.e.
~245,760 tokens/s: (1) bounds a first run that tokenizes inside the trainer, (3) bounds every step after.
Results go to docs/data.md by hand, with the command.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from fp4jax.data import default_data_config, load_tokenizer, make_train_iterator, train_sources
from fp4jax.data.cache import available_cpus, load_token_stream

MI355X_TOKENS_PER_S = 180_000 * 8192 / (100 * 60)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="bundled")
    p.add_argument("--train_glob", default="c4-train.*.json.gz")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--threads", type=int, default=0, help="tokenizer threads (0 = all CPUs)")
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    return p.parse_args()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    cfg = default_data_config()
    cfg.path, cfg.train_glob, cfg.tokenizer, cfg.num_threads = (
        args.path,
        args.train_glob,
        args.tokenizer,
        args.threads,
    )
    tok = load_tokenizer(cfg.tokenizer)
    with tempfile.TemporaryDirectory() as cache_dir:
        cfg.cache_dir = cache_dir
        sources = train_sources(cfg)
        cold = lambda: load_token_stream(
            sources, tok, cache_dir=cache_dir, num_threads=args.threads, progress=False
        )
        stream, cold_s = timed(cold)
        warm = lambda: make_train_iterator(
            cfg, tok, seq_len=args.seq_len, global_batch=args.batch, seed=0, progress=False
        )
        it, warm_s = timed(warm)
        next(it)  # touch the memmaps once, like the trainer's first step
        _, iter_s = timed(lambda: [next(it) for _ in range(args.steps)])
    delivered = args.steps * args.batch * args.seq_len / iter_s
    cold_rate = len(stream) / cold_s
    threads = args.threads or available_cpus()
    rows = [
        (
            "cold tokenization",
            f"{cold_rate:,.0f} tokens/s ({len(stream):,} tokens in {cold_s:.2f} s)",
            cold_rate,
        ),
        ("warm start (cache exists)", f"{warm_s:.3f} s", None),
        (
            f"iterator from cache, batch {args.batch} x {args.seq_len}",
            f"{delivered:,.0f} tokens/s",
            delivered,
        ),
    ]
    print(f"data: {args.path} ({len(sources)} files), tokenizer {tok.name}, {threads} threads")
    print(f"| measure | value | vs 8x MI355X ({MI355X_TOKENS_PER_S:,.0f} tokens/s) |\n|---|---|---|")
    for name, value, rate in rows:
        print(f"| {name} | {value} | {'' if rate is None else f'{rate / MI355X_TOKENS_PER_S:,.1f}x'} |")


if __name__ == "__main__":
    main()
