"""The study's ladders: one set-up per scale, and a rung = that set-up with one recipe.

    from fp4jax.configs import rungs
    c = rungs.rung("8b_c4", "mxfp4_full_h16")           # what configs/llama8b_c4_h16.py returns
    cs = rungs.ladder("125m_proxy_pg", PROXY_RECIPES)   # {recipe: config}, for a sweep driver

A rung differs from its set-up's baseline only in `recipe` (the FP8 stages of every rung use the
set-up's `fp8_scaling`, the baseline's), so the ladder compares recipes and nothing else. Set-ups:
- "8b_c4": Llama 3.1-8B on C4, the MLPerf llama3.1_8b setup (fp4jax.configs.base).
- "125m_pg", "1b_pg": single-GPU checks on the pg_en books corpus (GPT-2 tokens), MLPerf-style cosine.
- "125m_proxy_pg", "350m_proxy_pg", "125m_proxy_c4", "350m_proxy_c4": the proxy study (below).
- "tiny_c4": the tiny model on the bundled C4 sample, on CPU in minutes.
RUNGS maps each rung's file suffix (configs/llama8b_c4_<suffix>.py) to its preset.

Proxies, shaped like the 8B run at small scale: a constant LR after warmup (at 8B the cosine over 1.2M steps
barely decays within the run), at most one epoch of data, an evaluation every 2 % of the run, the reference's
document separation ("none") and FP8 scaling ("delayed"); each evaluation reads 256 validation sequences
spread over the whole validation split, the final one up to 1,024. 1,000 updates of 32 x 1024 tokens = 32.8M
tokens, just under one epoch of pg_en's 33.3M training tokens. The corpus is a json.gz directory given by
data.path (never a machine path in a config). Sweep a rung's learning rate with `--config.recipe=mxfp4_full
--config.optimizer.peak_lr=3e-3`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_collections

from fp4jax.configs import base
from fp4jax.ops.recipes import get_recipe

__all__ = [
    "PROXY_RECIPES",
    "RUNGS",
    "SETUPS",
    "ladder",
    "rung",
]

RUNGS: dict[str, str] = {
    "bf16": "bf16",
    "fp8": "fp8_mlperf",
    "fprop": "mxfp4_fprop",
    "fprop_dgrad": "mxfp4_fprop_dgrad",
    "full": "mxfp4_full",
    "full_sr": "mxfp4_full_sr",
    "full_sr_prescale": "mxfp4_full_sr_prescale",
    "full_rht": "mxfp4_full_rht",
    "h16": "mxfp4_full_h16",
    "h32": "mxfp4_full_h32",
    "h16_wgrad_only": "mxfp4_full_h16_wgrad_only",
}

# The LR-sensitivity sweep's recipes: fp8, fprop, fprop+dgrad, full, full+SR, full+RHT, full+H16.
PROXY_RECIPES = (
    "fp8_mlperf",
    "mxfp4_fprop",
    "mxfp4_fprop_dgrad",
    "mxfp4_full",
    "mxfp4_full_sr",
    "mxfp4_full_rht",
    "mxfp4_full_h16",
)
PROXY_STEPS = 1000
# Single-GPU set-ups save the projections' outputs and cuDNN attention's forward outputs instead of
# recomputing every block: on one H200 the 1B step ran 14 % faster in bf16 and 10 % in FP8 with "minimal"
# than with "full", and "minimal_attention" another 2.4 % in bf16 (seq 2048, side by side; 8.1 % at seq
# 8192, across two calls) for 2.2 GB more memory (docs/performance.md, docs/changelog.md). The 8B set-up
# keeps the model's default ("full") for its sequences of 8192.
SMALL_MODEL_REMAT = "minimal_attention"
# They also compile every block inline (scan_layers=False) instead of one block in a loop: the loop's
# step spends about 20 ms of 0.47 s in memcpy kernels, presumably the copies of each block's saved
# outputs into the stacked residual buffers and back out, which inline are plain buffers. On one H200
# (1B, seq 2048, side by side) bf16 ran 3.6 % faster and mxfp4_full_h16 2.6 %, for about a minute more
# compile per run and, for the per-tensor fp8 recipes only, 7 GB more peak memory (docs/performance.md).
# The init is the same either way (llama.init_variables); a checkpoint restores only into the layout it
# was written with. The 8B set-up keeps the loop (32 blocks, sharded; not measured unrolled).
SMALL_MODEL_SCAN_LAYERS = False
PROXY_EVALS = 50  # evaluations per run: one every 2 %
PROXY_EVAL_SEQUENCES = 256
PROXY_FINAL_EVAL_SEQUENCES = 1024


def small_model(size: str) -> ml_collections.ConfigDict:
    """base.model_config(size) with the single-GPU set-ups' remat policy and unrolled blocks."""
    model = base.model_config(size)
    model.remat = SMALL_MODEL_REMAT
    model.scan_layers = SMALL_MODEL_SCAN_LAYERS
    return model


def c4_8b() -> ml_collections.ConfigDict:
    """MLPerf llama3.1_8b: batch 32 x 8192, eval every 384 steps, target 3.3 (see base)."""
    return base.get_config()


def pg_125m() -> ml_collections.ConfigDict:
    """125M on pg_en: 32 x 1024 tokens/step, 2,000 steps (65.5M tokens), eval every 200 steps."""
    c = base.get_config()
    c.model = small_model("125m")
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


def pg_1b() -> ml_collections.ConfigDict:
    """The "1b" Llama on pg_en: 16 x 2048 tokens/step, 3,000 steps (98.3M tokens), eval every 200 steps."""
    c = pg_125m()
    c.model = small_model("1b")
    c.seq_len, c.global_batch = 2048, 16
    c.steps = 3000
    c.optimizer.update(peak_lr=6e-4, warmup_steps=200, lr_decay_steps=3000)
    c.eval_every_sequences, c.eval_sequences, c.eval_batch_size = 3200, 128, 16
    c.checkpoint_every_steps = 500
    return c


def tiny_c4() -> ml_collections.ConfigDict:
    """The tiny model on the bundled C4 sample: 8 x 64 tokens/step, 300 steps, on CPU."""
    c = base.get_config()
    c.model = base.model_config("tiny")
    c.data = base.default_data_config()  # the bundled C4 sample, GPT-2 tokenizer
    c.seq_len, c.global_batch = 64, 8
    c.steps = 300
    c.optimizer.update(peak_lr=3e-3, warmup_steps=30, lr_decay_steps=300)
    c.eval_every_sequences, c.eval_sequences, c.eval_batch_size = 800, 32, 8
    c.eval_at_end = True
    c.target_eval_loss = 7.5  # reached by ~step 200 on CPU: shows the tokens-to-target bookkeeping
    c.stop_at_target = False
    c.checkpoint_every_steps = 100
    c.fp8_scaling = "preset"  # the CPU demo and tests run each preset as it is defined
    return c


def proxy(size: str, corpus: str) -> ml_collections.ConfigDict:
    """A proxy-study set-up: `size` ("125m", "350m") on `corpus` ("pg_en" or "c4", GPT-2 tokens)."""
    if corpus not in ("pg_en", "c4"):
        raise ValueError(f"unknown proxy corpus {corpus!r}: use 'pg_en' or 'c4'")
    c = pg_125m()
    c.model = small_model(size)
    if corpus == "c4":  # allenai/c4 en files under data.path; the default globs of fp4jax.data
        c.data = base.default_data_config()
        c.data.path = "data/c4_en"
    c.data.separator = "none"  # as the reference's pre-tokenized C4
    c.seq_len, c.global_batch = 1024, 32
    c.steps, c.max_tokens = PROXY_STEPS, 0
    c.optimizer.update(schedule="constant", peak_lr=1.5e-3, warmup_steps=PROXY_STEPS // 10)
    c.optimizer.lr_decay_steps = PROXY_STEPS  # unused by the constant schedule
    c.eval_every_sequences = PROXY_STEPS * c.global_batch // PROXY_EVALS
    # Every evaluation reads PROXY_EVAL_SEQUENCES windows spread over the whole validation split (not a
    # prefix of it, which is one or two books of pg_en), the same windows for every run; the final one
    # reads up to PROXY_FINAL_EVAL_SEQUENCES (pg_en's split holds 752 at seq 1024: all of them). Batches
    # of 16 divide both 256 and 752.
    c.eval_selection = "spread"
    c.eval_sequences, c.eval_batch_size = PROXY_EVAL_SEQUENCES, 16
    c.final_eval_sequences = PROXY_FINAL_EVAL_SEQUENCES
    c.target_eval_loss, c.stop_at_target, c.eval_at_end = 4.0, False, True
    c.checkpoint_every_steps = 250
    return c


SETUPS: dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "8b_c4": c4_8b,
    "125m_pg": pg_125m,
    "1b_pg": pg_1b,
    "125m_proxy_pg": lambda: proxy("125m", "pg_en"),
    "350m_proxy_pg": lambda: proxy("350m", "pg_en"),
    "125m_proxy_c4": lambda: proxy("125m", "c4"),
    "350m_proxy_c4": lambda: proxy("350m", "c4"),
    "tiny_c4": tiny_c4,
}


def rung(setup: str, recipe: str) -> ml_collections.ConfigDict:
    """The set-up's config with `recipe` (a preset name); an unknown set-up or preset is a ValueError."""
    if setup not in SETUPS:
        raise ValueError(f"unknown ladder set-up {setup!r}: use one of {', '.join(SETUPS)}")
    get_recipe(recipe)  # an unknown preset fails here, listing the valid ones
    c = SETUPS[setup]()
    c.recipe = recipe
    return c


def ladder(
    setup: str, recipes: Sequence[str] = tuple(RUNGS.values())
) -> dict[str, ml_collections.ConfigDict]:
    """{recipe: the set-up's config with that recipe}, in the order given."""
    return {recipe: rung(setup, recipe) for recipe in recipes}
