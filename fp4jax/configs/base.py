"""Shared base: every key the trainer reads; the defaults are the MLPerf Training llama3.1_8b setup.

Other configs start from `get_config()` and change a few keys. Any key can be set on the command line:
`--config.global_batch=64 --config.mesh.fsdp=8`; an unknown key is an error.

Keys:
- seed, recipe (a name in fp4jax.ops.PRESETS), steps (update budget), max_tokens (token budget; 0 = none).
- fp8_scaling: the scaling of every FP8 operand of the recipe (fp4jax.ops.recipes.with_fp8_scaling):
  "delayed" (the MLPerf reference's: Transformer Engine delayed scaling, amax history 4, newest amax;
  the default), "current" (per-tensor, this step's amax) or "preset" (as the preset defines it). So the
  FP8 stages of every MXFP4 rung are scaled exactly like the FP8 baseline.
- sr_rng: the generator of stochastic rounding's random bits (fp4jax.ops.recipes.with_sr_rng): "preset"
  (each preset's own, jax's threefry: the default, bit for bit as before) or one of "threefry" and
  "threefry13" for every stochastically rounded operand (docs/numerics.md, "Random bits").
- fp8_divide: how every per-tensor FP8 scale is divided (fp4jax.ops.recipes.with_fp8_divide): "preset"
  (the presets' "ieee": IEEE's quotient on every back end, the default) or "xla" (the back end's own
  divide, up to 2 ulp off on GPUs: the 125M study's committed runs; docs/numerics.md, "Dividing on GPUs").
- model.size ("8b", "1b", "350m", "125m", "tiny") plus optional LlamaConfig overrides (None = the size's
  value; model.vocab_size None = the tokenizer's vocabulary rounded up to a multiple of 128).
  model.scaled_output_init (None = True): attention-out and MLP-down weights drawn with std
  init_std / sqrt(2 n_layers), as Megatron/NeMo (the reference) do; False = init_std everywhere.
- global_batch (sequences per update), seq_len, grad_accum (micro-batches per update).
- optimizer: AdamW; peak_lr / warmup_steps None = the MLPerf table for global_batch (16 -> 4e-4/16,
  32 -> 8e-4/128, 64 -> 8e-4/96, 128 -> 2e-3/256); schedule "cosine" (linear warmup, cosine to
  end_lr_ratio x peak at lr_decay_steps: the reference) or "constant" (linear warmup, then peak_lr: the
  proxy studies); weight_decay_mask "matrices" (no decay on norm scales, Megatron's default) or "all".
- Evaluation (MLPerf protocol): eval_sequences from the start of the unshuffled validation stream, every
  eval_every_sequences training sequences; stop when the mean loss <= target_eval_loss (stop_at_target).
  eval_selection "first" (that protocol) or "spread" (eval_sequences windows evenly strided over the whole
  validation stream, the same for every run); final_eval_sequences N > 0: after the last update, one more
  evaluation of at most N windows selected the same way (fewer when the validation set has fewer: the
  largest multiple of eval_batch_size it holds), recorded as summary["final_eval"]; 0 = none.
- Checkpoints: every checkpoint_every_steps (0 = only final/preemption), keep_checkpoints (the newest N;
  keep_checkpoint_steps: saved at these steps too and kept for good), init_checkpoint
  (start from another run's checkpoint when the workdir has none). init_from + init_from_step: branch from
  step N of another run's workdir with this config's recipe (fp4jax.training.branch: params, optimizer
  state, step and data position taken, amax histories only where they fit); steps counts from 0, so a
  branch of L updates sets steps = N + L. init_params: start from the params alone of a checkpoint
  (`python -m fp4jax.convert from-hf`'s, or a run's workdir / step directory; fp4jax.training.weights):
  optimizer state fresh, step 0, data from the start.
- mesh.data / mesh.fsdp / mesh.tensor (-1 = the remaining devices); data: fp4jax.data's config, with
  data.separator "none" here: the reference's pre-tokenized C4 has nothing between documents.
- debug_nan_at_step: poison update N's loss and gradients (tests the NaN guard); 0 = off.
- divergence: a run diverges at a non-finite loss or gradient norm, or, when spike_nats > 0, when the
  mean of the last `window` training losses exceeds the lowest such mean seen so far by more than
  spike_nats nats (0 = the spike rule is off). A diverged run writes its summary and exits 3.
- diagnostics.every: run the per-GEMM quantization probe every N updates on the step's first
  micro-batch (0 = off).
- profile: capture a device trace of num_steps updates starting at update start_step (num_steps 0 = off).
"""

import ml_collections
from ml_collections import config_dict

from fp4jax.data import MLPERF_TRAIN_GLOB, default_data_config

__all__ = ["MLPERF_EVAL_EVERY_SEQUENCES", "MLPERF_EVAL_SEQUENCES", "get_config", "model_config"]

# BF16 reference at global batch 32 (docs/reference.md, MLPerf): ~179.4k sequences = ~5.6k steps to reach 3.3.
MLPERF_EVAL_EVERY_SEQUENCES = 12_288
MLPERF_EVAL_SEQUENCES = 1024


def model_config(size: str) -> ml_collections.ConfigDict:
    """model.size and typed placeholders for every LlamaConfig field that can be overridden."""
    p = config_dict.placeholder
    return ml_collections.ConfigDict(
        {
            "size": size,
            "vocab_size": p(int),
            "d_model": p(int),
            "n_layers": p(int),
            "n_heads": p(int),
            "n_kv_heads": p(int),
            "head_dim": p(int),
            "d_ff": p(int),
            "rope_theta": p(float),
            "rope_scaling": p(bool),
            "norm_eps": p(float),
            "init_std": p(float),
            "scaled_output_init": p(bool),
            "max_seq_len": p(int),
            "dtype": p(str),
            "param_dtype": p(str),
            "scan_layers": p(bool),
            "remat": p(str),
            "attention": p(str),
            "bf16_first_blocks": p(int),
            "bf16_last_blocks": p(int),
        }
    )


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.recipe = "bf16"
    c.fp8_scaling = "delayed"
    c.sr_rng = "preset"
    c.fp8_divide = "preset"
    c.model = model_config("8b")

    c.global_batch = 32
    c.seq_len = 8192
    c.grad_accum = 1
    c.steps = 12_000  # budget: ~2x the ~5.6k steps the BF16 reference needs to reach 3.3
    c.max_tokens = 0

    c.optimizer = ml_collections.ConfigDict(
        {
            "peak_lr": config_dict.placeholder(float),
            "warmup_steps": config_dict.placeholder(int),
            "schedule": "cosine",
            "lr_decay_steps": 1_200_000,
            "end_lr_ratio": 0.1,
            "b1": 0.9,
            "b2": 0.95,
            "eps": 1e-5,
            "weight_decay": 0.1,
            "weight_decay_mask": "matrices",
            "clip_grad_norm": 1.0,
        }
    )

    c.eval_every_sequences = MLPERF_EVAL_EVERY_SEQUENCES
    c.eval_sequences = MLPERF_EVAL_SEQUENCES
    c.eval_batch_size = 8  # sequences per eval step; 8 x 8192 fp32 logits are 4.2 GB per sequence
    c.eval_selection = "first"  # the MLPerf protocol's prefix of the validation stream
    c.final_eval_sequences = 0
    c.target_eval_loss = 3.3
    c.stop_at_target = True
    c.eval_at_end = False

    c.checkpoint_every_steps = 384
    c.keep_checkpoints = 3
    c.keep_checkpoint_steps = ()  # also saved at these steps and never deleted (a trunk's branch points)
    c.async_checkpointing = True
    c.init_checkpoint = ""
    c.init_from = ""  # branch: another run's workdir (training/branch.py) ...
    c.init_from_step = 0  # ... and the step of its checkpoint to start from
    c.init_params = ""  # params only (training/weights.py): optimizer fresh, step 0

    # FSDP over every device: fp32 master weights + Adam moments of 8B (128 GB) do not fit replicated.
    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.data = default_data_config()
    c.data.tokenizer = "llama3"
    c.data.train_glob = MLPERF_TRAIN_GLOB  # allenai/c4 en files 00768-00895; set data.path to their directory
    c.data.separator = "none"  # as the reference's preprocessing (no --append-eod, no BOS): docs/data.md

    c.progress_bar = True
    c.tensorboard = True
    c.dispatch_ahead = True  # dispatch update s + 1 before fetching update s's metrics (training/trainer.py)
    c.debug_nan_at_step = 0
    c.divergence = ml_collections.ConfigDict({"spike_nats": 0.0, "window": 20})
    c.diagnostics = ml_collections.ConfigDict({"every": 0})
    c.profile = ml_collections.ConfigDict({"start_step": 0, "num_steps": 0})
    c.xla_gpu_triton_gemm = False  # XLA's Triton GEMM fusions; off keeps the FP8 GEMMs on cuBLASLt (setup.py)
    c.xla_gpu_deterministic_ops = False  # bit-repeatable GPU updates: no atomics, XLA attention (setup.py)
    return c
