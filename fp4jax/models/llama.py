"""The Llama 3.1 family in Flax linen; every linear layer's GEMMs go through `fp4jax.ops`.

Why linen and not nnx: an 8B model must compile in reasonable time and fit, which needs the layers under
`nn.scan` (one block traced and compiled, not 32), `nn.remat` with a checkpoint policy, and logical
partitioning metadata that survives both (`metadata_params={nn.PARTITION_NAME: "layers"}`). In linen these
three compose and are proven at this scale (MaxText trains Llama 3.1-8B/70B this way); nnx's equivalents
(`nnx.scan` over split graph state, `nnx.remat`, sharding metadata through the lifted transforms) work but are
younger and have had more compile-time and metadata surprises. The quantized matmul has both adapters, so the
choice only concerns the model.

Shape legend (einsum strings use the same letters):
  B batch, T query positions, S key positions (= T: causal self-attention), D d_model,
  N query heads, K key/value heads (GQA: N % K == 0), H head_dim, R rotary pairs (H // 2),
  F SwiGLU hidden size (d_ff), V vocabulary, L layers.

Invariants:
  - Causal: logits_BTV[:, t] depends only on tokens_BT[:, : t + 1].
  - One chokepoint: the q, k, v, o, gate, up and down projections are `nn.DenseGeneral` with
    `dot_general_cls=partial(QuantDotGeneral, recipe=...)`; nothing else is quantized (embedding, LM head,
    norms, QK^T and PV stay in `dtype` with fp32 accumulation / softmax).
  - Blocks `i < bf16_first_blocks` and `i >= n_layers - bf16_last_blocks` use recipe "bf16".
  - Params are `param_dtype` (fp32); activations `dtype` (bf16); RMSNorm, RoPE, SwiGLU's gate and the
    softmax run in fp32; logits are fp32.
  - Every param carries logical axis names (`nn.with_logical_partitioning`); activations are constrained
    with logical names at block boundaries. Names map to mesh axes in `fp4jax.models.sharding`.
  - scan_layers only changes the param layout: `unstack_layer_params` / `stack_layer_params` convert
    between the scanned (`blocks_{start}_{stop}`, leading axis "layers") and per-block (`block_{i}`) trees,
    and the logits agree; `init_variables` gives an unrolled model its scanned twin's initial values.

RoPE uses the half-split ("rotate_half") pairing (x[..., :R], x[..., R:]), not Meta's interleaved pairs:
the two differ by a fixed permutation of each head's q/k output features, irrelevant when training from
scratch (loading Meta weights needs the usual HF permutation of wq/wk).
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from fp4jax.ops import QuantDotGeneral, get_recipe
from fp4jax.ops.kernels import probes

__all__ = [
    "ACT_BTD",
    "ACT_BTF",
    "ACT_BTKH",
    "ACT_BTNH",
    "ACT_BTV",
    "ATTENTION_FORWARD_PRIMITIVE",
    "ATTENTION_OPTIONS",
    "PROJ_NAMES",
    "REMAT_OPTIONS",
    "SIZES",
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "Mlp",
    "RMSNorm",
    "apply_rope",
    "attention_implementation",
    "deterministic_attention",
    "pallas_attention_fits",
    "block_segments",
    "causal_attention",
    "flops_per_token",
    "init_variables",
    "llama31_scale_frequencies",
    "llama_config",
    "lm_head_logits",
    "matmul_param_count",
    "output_init_std",
    "padded_vocab_size",
    "param_count",
    "remat_policy",
    "rope_frequencies",
    "rope_tables",
    "saves_attention_forward",
    "segment_name",
    "stack_layer_params",
    "unstack_layer_params",
]

# Logical axis names of activations (params use "embed" etc.; see sharding.LOGICAL_RULES).
ACT_BTD = ("batch", "length", "act_embed")
ACT_BTNH = ("batch", "length", "heads", "head_dim")
ACT_BTKH = ("batch", "length", "kv_heads", "head_dim")
ACT_BTF = ("batch", "length", "mlp")
ACT_BTV = ("batch", "length", "vocab")

# Outputs of the quantized projections, tagged so the remat policies can keep them even when the
# quantized GEMM is a custom_vjp that jax's dot policies do not recognise as a dot.
PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up", "mlp_down")
REMAT_OPTIONS = ("none", "full", "dots_saveable", "minimal", "minimal_attention")
# cuDNN flash attention's forward kernel (jax.nn.dot_product_attention, implementation="cudnn") is a
# primitive of this name, or this name + "_wrapper" (the one jax 0.10-0.11 binds). Its outputs are the
# attention output and the softmax statistics the backward kernel reads: saving them spares the rerun.
ATTENTION_FORWARD_PRIMITIVE = "dot_product_attention_fwd"
ATTENTION_OPTIONS = ("auto", "xla", "cudnn", "pallas")
# The Pallas (Triton) flash attention's query and key block: the sequence length must be a multiple of
# it, or shorter than it (then the whole sequence is one block).
PALLAS_ATTENTION_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama 3.1 model (frozen and hashable: usable as a static jit argument)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 500000.0
    rope_scaling: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Megatron/NeMo (the MLPerf reference): the projections that write into the residual stream
    # (attention out, MLP down) draw from normal(init_std / sqrt(2 * n_layers)), so the residual's
    # variance at init does not grow with depth. False: every matrix uses init_std.
    scaled_output_init: bool = True
    max_seq_len: int = 8192
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "full"
    attention: str = "auto"
    bf16_first_blocks: int = 0
    bf16_last_blocks: int = 0

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.remat not in REMAT_OPTIONS:
            raise ValueError(f"remat {self.remat!r} is not one of {REMAT_OPTIONS}")
        if self.attention not in ATTENTION_OPTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_OPTIONS}")
        for name in ("bf16_first_blocks", "bf16_last_blocks"):
            if not 0 <= getattr(self, name) <= self.n_layers:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, n_layers={self.n_layers}]")


# Named sizes. "8b" is exactly the MLPerf llama3.1_8b model; "1b" follows Llama 3.2-1B's shape (but with
# untied embeddings and the 3.1 RoPE scaling); "350m" / "125m" are GPT-3-paper sizes with GQA (4 kv heads)
# and SwiGLU d_ff ~ 8/3 d rounded up to a multiple of 256; "tiny" is for tests and smoke runs. The small
# sizes default to the GPT-2 vocabulary, 50,257 padded up to a multiple of 128 (50,304, as in nanoGPT);
# the trainer overrides vocab_size from its tokenizer (see padded_vocab_size).
_SIZES: dict[str, dict[str, int]] = {
    "8b": dict(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336
    ),
    "1b": dict(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192
    ),
    "350m": dict(
        vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=4, head_dim=64, d_ff=2816
    ),
    "125m": dict(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=2048
    ),
    "tiny": dict(vocab_size=50304, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192),
}
SIZES = tuple(_SIZES)


def llama_config(size: str, **overrides) -> LlamaConfig:
    """The named size with `overrides` applied (any LlamaConfig field)."""
    if size not in _SIZES:
        raise ValueError(f"unknown Llama size {size!r}; valid sizes: {', '.join(SIZES)}")
    return LlamaConfig(**{**_SIZES[size], **overrides})


def padded_vocab_size(n_tokens: int, multiple: int = 128) -> int:
    """`n_tokens` rounded up to a multiple of `multiple` (so vocab shards and GEMM tiles divide evenly)."""
    return -(-n_tokens // multiple) * multiple


# ----------------------------------------------------------------------------------------------- RoPE


def llama31_scale_frequencies(
    freqs_R: np.ndarray,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> np.ndarray:
    """Meta's Llama 3.1 `apply_scaling`, vectorised: long wavelengths / factor, short kept, smooth between."""
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen_R = 2 * math.pi / freqs_R
    smooth_R = (original_context / wavelen_R - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid_R = (1 - smooth_R) * freqs_R / factor + smooth_R * freqs_R
    out_R = np.where(wavelen_R > low_freq_wavelen, freqs_R / factor, mid_R)
    return np.where(wavelen_R < high_freq_wavelen, freqs_R, out_R)


def rope_frequencies(head_dim: int, theta: float, scaling: bool) -> np.ndarray:
    """Inverse frequencies theta^(-2r/H), r < H/2, float32, optionally with the Llama 3.1 scaling."""
    freqs_R = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling:
        freqs_R = llama31_scale_frequencies(freqs_R)
    return freqs_R.astype(np.float32)


def rope_tables(seq_len: int, config: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """cos_TR, sin_TR (fp32) of angle t * freq_r for positions t < seq_len."""
    freqs_R = jnp.asarray(rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    angle_TR = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs_R[None, :]
    return jnp.cos(angle_TR), jnp.sin(angle_TR)


def apply_rope(x_BTNH: jax.Array, cos_TR: jax.Array, sin_TR: jax.Array) -> jax.Array:
    """Rotates pairs (x[..., r], x[..., r + R]) by angle t * freq_r, in fp32; preserves each head's norm."""
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_TR[None, :, None, :], sin_TR[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


# ------------------------------------------------------------------------------------------ attention


def _on_nvidia_gpu() -> bool:
    """Whether the default device is an NVIDIA GPU: the library's one rule (probes.on_nvidia_gpu)."""
    return probes.on_nvidia_gpu()


def attention_implementation(option: str, dtype: Any, head_dim: int) -> str:
    """Resolves config.attention: "auto" -> "cudnn" on an NVIDIA GPU where cuDNN flash attention supports
    the dtype and head size, else "xla" (CPU, ROCm, fp32)."""
    if option != "auto":
        return option
    cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if cudnn_ok and _on_nvidia_gpu() else "xla"


def deterministic_attention(seq_len: int) -> str:
    """What "auto" attention becomes under --xla_gpu_deterministic_ops: the Pallas flash attention on an
    NVIDIA GPU where its blocks tile the sequence, else XLA's attention.

    Why: XLA failed to compile cuDNN flash attention under the flag (jax 0.11.2, the 125M step), and XLA's
    attention materialises the T x S scores: 2.6x the default step time at T = 1024, against 1.38x with
    the Pallas kernel, whose updates repeated bit for bit across processes (docs/training.md,
    Repeatability). Call it after the flag is set: it asks jax for the devices.
    """
    return "pallas" if pallas_attention_fits(seq_len) and _on_nvidia_gpu() else "xla"


def pallas_attention_fits(seq_len: int) -> bool:
    """Whether the Pallas attention's blocks tile the sequence (one block if it is shorter than one)."""
    return seq_len <= PALLAS_ATTENTION_BLOCK or seq_len % PALLAS_ATTENTION_BLOCK == 0


def causal_attention(
    q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, option: str = "auto"
) -> jax.Array:
    """softmax(q k^T / sqrt(H) + causal mask) v, with query head n reading kv head n // (N // K).

    High precision: QK^T and PV take `dtype` operands with fp32 accumulation, softmax in fp32.
    """
    impl = attention_implementation(option, q_BTNH.dtype, q_BTNH.shape[-1])
    if impl == "pallas":
        return pallas_causal_attention(q_BTNH, k_BSKH, v_BSKH)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation=impl)


def pallas_causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """causal_attention through jax's Pallas flash attention (jax.experimental.pallas.ops.gpu.attention).

    Why it exists: its backward computes dK/dV and dQ in separate loops, without atomic adds, so it is
    repeatable under --xla_gpu_deterministic_ops, where XLA's attention (the fallback of "auto")
    materialises the T x S scores. The kernel is a Triton kernel (NVIDIA and ROCm GPUs); on the CPU it
    runs in Pallas's interpreter (slow: tests only). The kernel takes as many kv heads as query heads, so
    grouped kv heads are repeated first (their gradients summed back by repeat's transpose).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # experimental: lazily

    seq_len, n_heads, n_kv = q_BTNH.shape[1], q_BTNH.shape[2], k_BSKH.shape[2]
    block = min(PALLAS_ATTENTION_BLOCK, seq_len)
    if not pallas_attention_fits(seq_len):
        raise ValueError(
            f"model.attention=pallas needs a sequence length that is a multiple of {block}, got {seq_len}; "
            "set --config.seq_len to one, or --config.model.attention=xla"
        )
    k_BSNH = jnp.repeat(k_BSKH, n_heads // n_kv, axis=2)
    v_BSNH = jnp.repeat(v_BSKH, n_heads // n_kv, axis=2)
    backward_block = min(32, block)
    blocks = pallas_attention.BlockSizes(
        block_q=block,
        block_k=block,
        block_q_dkv=backward_block,
        block_kv_dkv=backward_block,
        block_q_dq=backward_block,
        block_kv_dq=backward_block,
    )
    return pallas_attention.mha(
        q_BTNH,
        k_BSNH,
        v_BSNH,
        segment_ids=None,
        sm_scale=q_BTNH.shape[-1] ** -0.5,
        causal=True,
        block_sizes=blocks,
        interpret=jax.default_backend() == "cpu",
    )


# --------------------------------------------------------------------------------------------- layers


def _init(config: LlamaConfig, names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(config.init_std), names)


def output_init_std(config: LlamaConfig) -> float:
    """The std of the residual-writing projections (o, down): init_std / sqrt(2 n_layers) when scaled."""
    return config.init_std / math.sqrt(2 * config.n_layers) if config.scaled_output_init else config.init_std


def _kernel_init(std: float, names: tuple[str, ...], shape: tuple[int, ...]):
    """normal(std) drawn directly in the kernel's full shape, boxed with its logical names.

    DenseGeneral calls its kernel_init with the *flattened* 2-D shape and unboxes the result before
    reshaping; under a mesh that unbox constrains a 2-D value with N-D names and fails. Drawing the
    full shape here (ignoring the flat one) sidesteps it; the distribution is the same.
    """

    def init(key, _flat_shape, dtype=jnp.float32):
        value = nn.initializers.normal(std)(key, shape, dtype)
        return nn.LogicallyPartitioned(value, names)

    return init


def _dense(config: LlamaConfig, recipe: Any, in_shape, features, names: tuple[str, ...], name: str, std=None):
    """A bias-free linear layer over the trailing `in_shape` dims; its dot_general is the quantized
    chokepoint. Kernel init normal(std), default config.init_std."""
    features = (features,) if isinstance(features, int) else tuple(features)
    return nn.DenseGeneral(
        features=features,
        axis=tuple(range(-len(in_shape), 0)),
        use_bias=False,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        kernel_init=_kernel_init(config.init_std if std is None else std, names, tuple(in_shape) + features),
        dot_general_cls=functools.partial(QuantDotGeneral, recipe=recipe),
        name=name,
    )


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in fp32 and returned in `dtype`."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg = self.config
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (cfg.d_model,),
            jnp.dtype(cfg.param_dtype),
        )
        x32_BTD = x_BTD.astype(jnp.float32)
        ms_BT1 = jnp.mean(jnp.square(x32_BTD), axis=-1, keepdims=True)
        y_BTD = x32_BTD * jax.lax.rsqrt(ms_BT1 + cfg.norm_eps) * scale_D.astype(jnp.float32)
        return y_BTD.astype(jnp.dtype(cfg.dtype))


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE; q, k, v, o through the quantized dot."""

    config: LlamaConfig
    recipe: Any

    @nn.compact
    def __call__(self, x_BTD: jax.Array, cos_TR: jax.Array, sin_TR: jax.Array) -> jax.Array:
        cfg, recipe = self.config, self.recipe
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        D = cfg.d_model
        q_BTNH = _dense(cfg, recipe, (D,), (N, H), ("embed", "heads", "head_dim"), "q")(x_BTD)
        k_BTKH = _dense(cfg, recipe, (D,), (K, H), ("embed", "kv_heads", "head_dim"), "k")(x_BTD)
        v_BTKH = _dense(cfg, recipe, (D,), (K, H), ("embed", "kv_heads", "head_dim"), "v")(x_BTD)
        q_BTNH = checkpoint_name(q_BTNH, "q_proj")
        k_BTKH = checkpoint_name(k_BTKH, "k_proj")
        v_BTKH = checkpoint_name(v_BTKH, "v_proj")
        q_BTNH = nn.with_logical_constraint(apply_rope(q_BTNH, cos_TR, sin_TR), ACT_BTNH)
        k_BTKH = nn.with_logical_constraint(apply_rope(k_BTKH, cos_TR, sin_TR), ACT_BTKH)
        v_BTKH = nn.with_logical_constraint(v_BTKH, ACT_BTKH)
        o_BTNH = causal_attention(q_BTNH, k_BTKH, v_BTKH, cfg.attention)
        o_BTNH = nn.with_logical_constraint(o_BTNH, ACT_BTNH)
        out_names = ("heads", "head_dim", "embed")
        out_BTD = _dense(cfg, recipe, (N, H), D, out_names, "o", output_init_std(cfg))(o_BTNH)
        return checkpoint_name(out_BTD, "o_proj")


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the three GEMMs through the quantized dot."""

    config: LlamaConfig
    recipe: Any

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg, recipe = self.config, self.recipe
        D, F = cfg.d_model, cfg.d_ff
        gate_BTF = _dense(cfg, recipe, (D,), F, ("embed", "mlp"), "gate")(x_BTD)
        up_BTF = _dense(cfg, recipe, (D,), F, ("embed", "mlp"), "up")(x_BTD)
        gate_BTF = checkpoint_name(gate_BTF, "mlp_gate")
        up_BTF = checkpoint_name(up_BTF, "mlp_up")
        h_BTF = nn.silu(gate_BTF.astype(jnp.float32)) * up_BTF.astype(jnp.float32)
        h_BTF = nn.with_logical_constraint(h_BTF.astype(jnp.dtype(cfg.dtype)), ACT_BTF)
        out_BTD = _dense(cfg, recipe, (F,), D, ("mlp", "embed"), "down", output_init_std(cfg))(h_BTF)
        return checkpoint_name(out_BTD, "mlp_down")


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)). Returns (x, None) for nn.scan."""

    config: LlamaConfig
    recipe: Any

    @nn.compact
    def __call__(self, x_BTD: jax.Array, cos_TR: jax.Array, sin_TR: jax.Array):
        cfg = self.config
        x_BTD = nn.with_logical_constraint(x_BTD, ACT_BTD)
        h_BTD = RMSNorm(cfg, name="attn_norm")(x_BTD)
        x_BTD = x_BTD + Attention(cfg, self.recipe, name="attn")(h_BTD, cos_TR, sin_TR)
        h_BTD = RMSNorm(cfg, name="mlp_norm")(x_BTD)
        x_BTD = x_BTD + Mlp(cfg, self.recipe, name="mlp")(h_BTD)
        return nn.with_logical_constraint(x_BTD, ACT_BTD), None


# ------------------------------------------------------------------------------------- layer stacking


def remat_policy(name: str):
    """config.remat -> jax checkpoint policy (None for "none": no rematerialisation).

    "full": save nothing inside a block (only the residual stream between blocks);
    "dots_saveable": save every matmul output, attention logits included (memory-hungry at long T);
    "minimal" (MaxText's name): save the projections' outputs, recompute attention and elementwise ops;
    "minimal_attention": "minimal" plus cuDNN flash attention's forward outputs (the attention output and
    its softmax statistics, T x (N H + N) values per sequence and layer), so the backward pass does not
    rerun the attention forward; with XLA's attention (CPU, ROCm) it is "minimal".
    The named projection outputs are added to the dot policies so they hold for a custom_vjp quantized dot.
    """
    cp = jax.checkpoint_policies
    names = cp.save_only_these_names(*PROJ_NAMES)
    minimal = cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, names)
    policies = {
        "none": None,
        "full": cp.nothing_saveable,
        "dots_saveable": cp.save_from_both_policies(cp.dots_saveable, names),
        "minimal": minimal,
        "minimal_attention": cp.save_from_both_policies(minimal, saves_attention_forward),
    }
    return policies[name]


def saves_attention_forward(prim, *_, **__) -> bool:
    """Checkpoint policy: save the outputs of cuDNN flash attention's forward kernel (and nothing else)."""
    return prim.name.startswith(ATTENTION_FORWARD_PRIMITIVE)


def block_segments(config: LlamaConfig) -> tuple[tuple[int, int, bool], ...]:
    """Maximal runs [start, stop) of blocks sharing a precision; the flag is True for the "bf16" blocks."""
    L = config.n_layers
    hp = [i < config.bf16_first_blocks or i >= L - config.bf16_last_blocks for i in range(L)]
    segments, start = [], 0
    for i in range(1, L + 1):
        if i == L or hp[i] != hp[start]:
            segments.append((start, i, hp[start]))
            start = i
    return tuple(segments)


def segment_name(start: int, stop: int) -> str:
    return f"blocks_{start}_{stop}"


def _block_cls(config: LlamaConfig):
    if config.remat == "none":
        return Block
    # prevent_cse only matters outside scan; inside scan it only blocks optimisations.
    return nn.remat(Block, policy=remat_policy(config.remat), prevent_cse=not config.scan_layers)


def _run_blocks(config, recipe, start, stop, x_BTD, cos_TR, sin_TR):
    block_cls = _block_cls(config)
    if not config.scan_layers:
        for i in range(start, stop):
            x_BTD, _ = block_cls(config, recipe, name=f"block_{i}")(x_BTD, cos_TR, sin_TR)
        return x_BTD
    stack_cls = nn.scan(
        block_cls,
        variable_axes={"params": 0, "fp8_meta": 0},
        split_rngs={"params": True, "quant": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=stop - start,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x_BTD, _ = stack_cls(config, recipe, name=segment_name(start, stop))(x_BTD, cos_TR, sin_TR)
    return x_BTD


class Llama(nn.Module):
    """tokens_BT (int) -> logits_BTV (fp32). Randomised recipes need `rngs={"quant": key}` in apply/init."""

    config: LlamaConfig
    recipe: Any = "bf16"  # preset name or fp4jax.ops Recipe

    @nn.compact
    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        cfg = self.config
        get_recipe(self.recipe)  # an unknown preset fails here, naming the valid ones
        T = tokens_BT.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds config.max_seq_len {cfg.max_seq_len}")
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=_init(cfg, ("vocab", "embed")),
            dtype=dtype,
            param_dtype=param_dtype,
            name="embed",
        )
        x_BTD = nn.with_logical_constraint(embed(tokens_BT), ACT_BTD)
        cos_TR, sin_TR = rope_tables(T, cfg)
        for start, stop, high_precision in block_segments(cfg):
            recipe = "bf16" if high_precision else self.recipe
            x_BTD = _run_blocks(cfg, recipe, start, stop, x_BTD, cos_TR, sin_TR)
        x_BTD = RMSNorm(cfg, name="final_norm")(x_BTD)
        # The LM head is a plain high-precision matmul (not quantized), with fp32 accumulation and output.
        w_DV = self.param(
            "lm_head", _init(cfg, ("embed", "vocab")), (cfg.d_model, cfg.vocab_size), param_dtype
        )
        logits_BTV = lm_head_logits(x_BTD, w_DV.astype(dtype))
        return nn.with_logical_constraint(logits_BTV, ACT_BTV)


@jax.custom_vjp
def lm_head_logits(x_BTD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """logits_BTV = x_BTD @ w_DV with float32 accumulation and output; x and w in the compute dtype.

    Why a custom_vjp: the logits' cotangent is float32, so autodiff's two backward GEMMs would multiply a
    float32 operand with a bf16 one, i.e. run in float32 (TF32 on NVIDIA GPUs: 41 ms of a 1B model's
    ~500 ms step on an H200, the largest GEMMs of the step). Here the cotangent is first rounded to the
    compute dtype, so both run as compute-dtype GEMMs with float32 accumulation, like every other
    backward GEMM of the model; their results are rounded to that dtype either way. With a float32
    compute dtype this is exactly autodiff's rule.
    """
    return _lm_head_forward(x_BTD, w_DV)


def _lm_head_forward(x_BTD, w_DV):
    return jnp.einsum("BTD,DV->BTV", x_BTD, w_DV, preferred_element_type=jnp.float32)


def _lm_head_fwd(x_BTD, w_DV):
    return _lm_head_forward(x_BTD, w_DV), (x_BTD, w_DV)


def _lm_head_bwd(residuals, g_BTV):
    x_BTD, w_DV = residuals
    g_BTV = g_BTV.astype(x_BTD.dtype)
    dx_BTD = jnp.einsum("BTV,DV->BTD", g_BTV, w_DV, preferred_element_type=jnp.float32)
    dw_DV = jnp.einsum("BTD,BTV->DV", x_BTD, g_BTV, preferred_element_type=jnp.float32)
    return dx_BTD.astype(x_BTD.dtype), dw_DV.astype(w_DV.dtype)


lm_head_logits.defvjp(_lm_head_fwd, _lm_head_bwd)


# ------------------------------------------------------------------------------------ counting, layout


def param_count(config: LlamaConfig) -> int:
    """Exact number of parameters, from shapes only (jax.eval_shape; nothing is allocated)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract = jax.eval_shape(Llama(config).init, jax.random.key(0), tokens)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(abstract["params"])))


def matmul_param_count(config: LlamaConfig) -> int:
    """Parameters that take part in a matmul: the 7 projections of every block and the LM head."""
    D, F, H = config.d_model, config.d_ff, config.head_dim
    attn = D * (config.n_heads * H + 2 * config.n_kv_heads * H) + config.n_heads * H * D
    return config.n_layers * (attn + 3 * D * F) + D * config.vocab_size


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward; a multiply-add = 2 FLOPs).

    6 * matmul params (LM head included, embedding lookup excluded) + attention's QK^T and PV:
    12 * n_layers * (n_heads * head_dim) * seq_len / 2 -- PaLM's 12 L d_attn T, halved because a causal
    mask needs only the lower triangle (what flash attention computes). Remat recompute is not counted.
    """
    d_attn = config.n_heads * config.head_dim
    return 6.0 * matmul_param_count(config) + 12.0 * config.n_layers * d_attn * seq_len / 2


def _is_block_key(key: str) -> bool:
    return key.startswith("block_") or key.startswith("blocks_")


def unstack_layer_params(params: dict, config: LlamaConfig) -> dict:
    """Scanned params (`blocks_{start}_{stop}`, leading layer axis) -> per-block params (`block_{i}`).

    Works on unboxed trees (plain arrays); the other entries are passed through unchanged.
    """
    return _unstack_layers(nn.meta.unbox(params), config)


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def _layer_of(x, j: int):
    """Layer j of a stacked leaf; a box loses its leading "layers" axis name with the axis."""
    if _is_box(x):
        return x.replace_boxed(x.value[j]).remove_axis(0, {nn.PARTITION_NAME: "layers"})
    return x[j]


def _unstack_layers(tree: dict, config: LlamaConfig) -> dict:
    """unstack_layer_params for one variable collection, boxed (nn.Partitioned) or not; a segment the
    collection lacks (a bf16 segment has no fp8_meta) is skipped."""
    out = {k: v for k, v in tree.items() if not _is_block_key(k)}
    for start, stop, _ in block_segments(config):
        stacked = tree.get(segment_name(start, stop))
        if stacked is None:
            continue
        for i in range(start, stop):
            out[f"block_{i}"] = jax.tree.map(lambda x, j=i - start: _layer_of(x, j), stacked, is_leaf=_is_box)
    return out


def init_variables(model: Llama, rngs, tokens_BT: jax.Array) -> dict:
    """model.init with the same values whatever config.scan_layers: an unrolled model (scan_layers=False)
    is initialised as its scanned twin and its layers unstacked, so that the switch changes only the
    compiled program (one block in a loop, or every block inline), never the random draw. Boxes
    (logical axis names) are kept."""
    if model.config.scan_layers:
        return model.init(rngs, tokens_BT)
    twin = model.clone(config=dataclasses.replace(model.config, scan_layers=True))
    variables = twin.init(rngs, tokens_BT)
    return {name: _unstack_layers(dict(tree), model.config) for name, tree in variables.items()}


def stack_layer_params(params: dict, config: LlamaConfig) -> dict:
    """Per-block params (`block_{i}`) -> the scanned layout of `config` (inverse of unstack_layer_params)."""
    params = nn.meta.unbox(params)
    out = {k: v for k, v in params.items() if not _is_block_key(k)}
    for start, stop, _ in block_segments(config):
        blocks = [params[f"block_{i}"] for i in range(start, stop)]
        out[segment_name(start, stop)] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return out
