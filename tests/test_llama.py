"""The Llama model: shapes and counts, RoPE and attention against slow references, causality, scan
layout, remat policies and the per-block precision switches. Tiny shapes, fp32 compute where compared."""

import dataclasses
import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from helpers import all_eqns

from fp4jax.models import llama
from fp4jax.models.llama import Llama, llama_config

# fp32 compute so comparisons can be tight; vocab small to keep the LM head cheap.
TINY = llama_config("tiny", vocab_size=256, dtype="float32", remat="none")


# Inputs come from numpy: every eager jax op costs a compile on CPU.
def _tokens(B=2, T=8, vocab=256, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, T)), jnp.int32)


def _normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _init(config, recipe="bf16", tokens=None):
    tokens = _tokens() if tokens is None else tokens
    return nn.meta.unbox(jax.jit(Llama(config, recipe).init)(jax.random.key(1), tokens))


# Eager linen apply dispatches op by op; jitted (and cached per config) is much faster on CPU.
@functools.cache
def _apply(config, recipe="bf16"):
    return jax.jit(Llama(config, recipe).apply)


def _grad(config):
    def loss(params, tokens):
        return jnp.mean(Llama(config).apply({"params": params}, tokens) ** 2)

    return jax.jit(jax.grad(loss))


# ----------------------------------------------------------------------------------- sizes and counts


def test_8b_param_count_by_eval_shape():
    V, D, L, F, KV = 128256, 4096, 32, 14336, 1024
    by_hand = 2 * V * D + L * (D * (D + KV + KV + D) + 3 * D * F + 2 * D) + D
    assert by_hand == 8_030_261_248
    assert llama.param_count(llama_config("8b")) == by_hand


@pytest.mark.parametrize("size", llama.SIZES)
def test_every_size_eval_shapes(size):
    cfg = llama_config(size)
    abstract = jax.eval_shape(Llama(cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    params = nn.meta.unbox(abstract["params"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    embedding = cfg.vocab_size * cfg.d_model
    assert llama.param_count(cfg) == llama.matmul_param_count(cfg) + embedding + norms
    assert cfg.vocab_size % 128 == 0


def test_config_errors_and_vocab_padding():
    with pytest.raises(ValueError, match="8b, 1b, 350m, 125m, tiny"):
        llama_config("7b")
    with pytest.raises(ValueError, match="n_kv_heads"):
        llama_config("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="remat"):
        llama_config("tiny", remat="some")
    assert llama.padded_vocab_size(50257) == 50304
    assert llama.padded_vocab_size(128256) == 128256
    assert llama_config("tiny", vocab_size=512).vocab_size == 512


def test_flops_per_token_convention():
    cfg = llama_config("8b")
    T = 8192
    matmul = 32 * (4096 * (4096 + 2048) + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 128256
    assert llama.flops_per_token(cfg, T) == 6 * matmul + 6 * 32 * 4096 * T


# --------------------------------------------------------------------------------------------- RoPE


def _meta_apply_scaling(freqs):
    """Meta's llama3 `apply_scaling` (models/llama3/reference_impl/model.py), transcribed as a loop."""
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return np.array(new_freqs)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_scaling_matches_meta(head_dim):
    theta = 500000.0
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2)[: head_dim // 2].astype(np.float64) / head_dim))
    want = _meta_apply_scaling(freqs)
    got = llama.rope_frequencies(head_dim, theta, scaling=True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # all three regimes are exercised: kept, divided by 8, and smoothly interpolated
    assert np.any(got == np.float32(freqs)) and np.any(np.isclose(got, freqs / 8, rtol=1e-6))
    assert np.any((got < freqs * 0.99) & (got > freqs / 8 * 1.01))
    np.testing.assert_allclose(llama.rope_frequencies(head_dim, theta, scaling=False), freqs, rtol=1e-6)


def test_apply_rope_matches_complex_rotation():
    B, T, N, H = 2, 5, 3, 8
    x = _normal(B, T, N, H)
    cfg = llama_config("tiny", head_dim=H, rope_theta=10000.0)
    got = jax.jit(lambda x: llama.apply_rope(x, *llama.rope_tables(T, cfg)))(x)
    freqs = llama.rope_frequencies(H, 10000.0, True).astype(np.float64)
    z = (x[..., : H // 2] + 1j * x[..., H // 2 :]) * np.exp(1j * np.arange(T)[None, :, None, None] * freqs)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=1e-5)


# ---------------------------------------------------------------------------------------- attention


def _naive_gqa(q, k, v):
    B, T, N, H = q.shape
    G = N // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head n reads kv head n // G
    s = np.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("BNTS,BSNH->BTNH", p, v)


def test_gqa_attention_matches_naive():
    q, k, v = _normal(2, 6, 4, 8, seed=0), _normal(2, 6, 2, 8, seed=1), _normal(2, 6, 2, 8, seed=2)
    assert llama.attention_implementation("auto", jnp.float32, 8) == "xla"
    got = jax.jit(llama.causal_attention, static_argnums=3)(q, k, v, "auto")
    np.testing.assert_allclose(got, _naive_gqa(q, k, v), atol=1e-5)


def test_pallas_attention_matches_naive_and_xla_gradients():
    """The Pallas flash attention (interpreted on the CPU): forward against the naive numpy attention,
    gradients of every input (grouped kv heads included) against XLA's attention."""
    q, k, v = _normal(2, 32, 4, 16, seed=0), _normal(2, 32, 2, 16, seed=1), _normal(2, 32, 2, 16, seed=2)
    # On a GPU the Triton kernel multiplies float32 as TF32 (10 fraction bits); interpreted, in float32.
    atol = 1e-5 if jax.default_backend() == "cpu" else 5e-3
    got = jax.jit(llama.causal_attention, static_argnums=3)(q, k, v, "pallas")
    np.testing.assert_allclose(got, _naive_gqa(q, k, v), atol=atol)

    def loss(impl):
        return lambda q, k, v: jnp.sum(jnp.sin(llama.causal_attention(q, k, v, impl)))

    want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)  # eagerly: 40 programs
    got = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2 * atol, err_msg=f"d{name}")


def test_pallas_attention_rejects_a_sequence_its_blocks_do_not_tile():
    q, kv = _normal(1, 160, 2, 8), _normal(1, 160, 2, 8)
    with pytest.raises(ValueError, match="multiple of 128"):
        llama.causal_attention(q, kv, kv, "pallas")


# ------------------------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def tiny_params():
    return _init(TINY)


def test_causality(tiny_params):
    tokens, params = _tokens(T=8), tiny_params
    apply = _apply(TINY)
    logits = apply(params, tokens)
    assert logits.shape == (2, 8, 256) and logits.dtype == jnp.float32
    changed = tokens.at[:, 5:].set((tokens[:, 5:] + 7) % 256)
    logits2 = apply(params, changed)
    np.testing.assert_array_equal(logits[:, :5], logits2[:, :5])
    assert not np.allclose(logits[:, 5:], logits2[:, 5:])


def test_scan_matches_unrolled_layers():
    cfg = llama_config(
        "tiny", vocab_size=256, n_layers=3, dtype="float32", bf16_first_blocks=1, bf16_last_blocks=1
    )
    assert llama.block_segments(cfg) == ((0, 1, True), (1, 2, False), (2, 3, True))
    tokens = _tokens()
    scanned = _init(cfg, tokens=tokens)["params"]
    assert set(scanned) >= {"blocks_0_1", "blocks_1_2", "blocks_2_3"}
    per_block = llama.unstack_layer_params(scanned, cfg)
    assert set(per_block) == {"embed", "final_norm", "lm_head", "block_0", "block_1", "block_2"}
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    want = _apply(cfg)({"params": scanned}, tokens)
    got = _apply(unrolled)({"params": per_block}, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    restacked = llama.stack_layer_params(per_block, cfg)
    jax.tree.map(np.testing.assert_array_equal, restacked, scanned)


def test_unrolled_init_draws_what_the_scanned_model_draws():
    """init_variables(scan_layers=False) = the scanned init, unstacked: the same values, per-block boxes
    with the unrolled model's own logical names, and the delayed-FP8 state (absent from bf16 segments)."""
    cfg = llama_config(
        "tiny", vocab_size=256, n_layers=3, dtype="float32", bf16_first_blocks=1, bf16_last_blocks=0
    )
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    tokens, key = _tokens(), jax.random.key(3)
    init = jax.jit(
        lambda k, c: llama.init_variables(Llama(c, "fp8_mlperf"), {"params": k}, tokens), static_argnums=1
    )
    scanned, got = init(key, cfg), init(key, unrolled)
    for collection in ("params", "fp8_meta"):
        want = llama.unstack_layer_params(scanned[collection], cfg)
        jax.tree.map(np.testing.assert_array_equal, nn.meta.unbox(got[collection]), want)
    assert "block_0" not in got["fp8_meta"] and {"block_1", "block_2"} <= set(got["fp8_meta"])
    own = jax.eval_shape(Llama(unrolled, "fp8_mlperf").init, key, tokens)  # the unrolled model's own boxes
    names = lambda tree: jax.tree.map(
        lambda b: b.names, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )  # noqa: E731
    assert names(got["params"]) == names(own["params"])
    # and it trains as that model: the unrolled forward of the unstacked init is the scanned forward
    np.testing.assert_allclose(
        _apply(unrolled, "fp8_mlperf")(nn.meta.unbox(got), tokens),
        _apply(cfg, "fp8_mlperf")(nn.meta.unbox(scanned), tokens),
        rtol=1e-6,
        atol=1e-6,
    )


def test_remat_policies_give_same_gradients(tiny_params):
    """Float32 products (HIGHEST: a GPU would otherwise round them to TF32, and two programs' GEMMs may
    then round differently), so the policies differ at most in float32 summation order."""
    tokens, params = _tokens(T=8), tiny_params["params"]
    with jax.default_matmul_precision("highest"):
        want = _grad(TINY)(params, tokens)
        for remat in llama.REMAT_OPTIONS[1:]:  # against "none"
            got = _grad(dataclasses.replace(TINY, remat=remat))(params, tokens)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
    assert llama.remat_policy("none") is None
    assert all(callable(llama.remat_policy(name)) for name in llama.REMAT_OPTIONS if name != "none")


def _checkpoint_names(jaxpr) -> set[str]:
    """Every checkpoint_name in a jaxpr, its sub-jaxprs (scan, remat, custom_vjp) included."""
    return {eqn.params["name"] for eqn in all_eqns(jaxpr) if eqn.primitive.name == "name"}


def test_every_name_a_remat_policy_saves_is_tagged_in_the_model(tiny_params):
    cfg = dataclasses.replace(TINY, remat="minimal_attention")
    jaxpr = jax.make_jaxpr(Llama(cfg).apply)({"params": tiny_params["params"]}, _tokens())
    assert _checkpoint_names(jaxpr.jaxpr) == set(llama.PROJ_NAMES)


def test_minimal_attention_saves_the_cudnn_attention_forward_and_nothing_else():
    """The policy names jax's cuDNN attention primitive by its name, a private detail: check that this
    jax still has a forward primitive of that name, and that the policy picks it and only it."""
    from jax._src import core
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    names = {v.name for v in vars(cudnn_attention).values() if isinstance(v, core.Primitive)}
    forward = {n for n in names if llama.saves_attention_forward(types.SimpleNamespace(name=n))}
    assert forward and all("fwd" in n and "fp8" not in n for n in forward), names
    policy = llama.remat_policy("minimal_attention")
    for name in sorted(forward):
        assert policy(types.SimpleNamespace(name=name))
    for name in ("dot_product_attention_bwd_wrapper", "exp", "add", "reduce_max"):
        assert not policy(types.SimpleNamespace(name=name))


@pytest.mark.skipif(
    llama.attention_implementation("auto", jnp.bfloat16, 64) != "cudnn", reason="needs cuDNN flash attention"
)
def test_minimal_attention_runs_the_attention_forward_once_per_layer():
    """On cuDNN attention, "minimal" reruns the forward kernel in the backward pass and
    "minimal_attention" does not; both give the same gradients (the rerun is deterministic)."""
    cfg = llama_config("tiny", vocab_size=256, dtype="bfloat16", head_dim=64, attention="cudnn")
    tokens = _tokens(T=128)
    params = _init(dataclasses.replace(cfg, remat="none"), tokens=tokens)["params"]
    forwards, grads = {}, {}
    for remat in ("minimal", "minimal_attention"):
        grad = _grad(dataclasses.replace(cfg, remat=remat))
        hlo = grad.lower(params, tokens).compile().as_text()
        forwards[remat] = len(re.findall(r'custom_call_target="__cudnn\$fmha[A-Za-z]*"', hlo)) - len(
            re.findall(r'custom_call_target="__cudnn\$fmha[A-Za-z]*Backward[A-Za-z]*"', hlo)
        )
        grads[remat] = grad(params, tokens)
    assert forwards["minimal"] == 2 * forwards["minimal_attention"] > 0, forwards
    jax.tree.map(np.testing.assert_array_equal, grads["minimal_attention"], grads["minimal"])


def test_bf16_blocks_use_bf16_recipe(tiny_params):
    cfg = dataclasses.replace(TINY, scan_layers=False)  # block_{i} names whatever the segments
    tokens = _tokens()
    params = {"params": llama.unstack_layer_params(tiny_params["params"], TINY)}

    def run(recipe, first=0, last=0):
        c = dataclasses.replace(cfg, bf16_first_blocks=first, bf16_last_blocks=last)
        return np.asarray(_apply(c, recipe)(params, tokens))

    quantized, reference = run("mxfp4_full"), run("bf16")
    first, both = run("mxfp4_full", first=1), run("mxfp4_full", first=1, last=1)
    assert not np.allclose(quantized, reference, atol=1e-4)
    assert not np.allclose(first, quantized, atol=1e-6)  # block 0 left the quantized path ...
    assert not np.allclose(first, reference, atol=1e-6)  # ... block 1 did not
    np.testing.assert_array_equal(both, reference)  # first 1 + last 1 = both blocks in bf16


def test_stochastic_rounding_recipe_needs_quant_rng(tiny_params):
    cfg = llama_config("tiny", vocab_size=256, remat="full")  # bf16 compute, scanned, rematerialised
    tokens, params = _tokens(), tiny_params["params"]
    with pytest.raises(ValueError, match="quant"):
        Llama(cfg, "mxfp4_full_sr").apply({"params": params}, tokens)
    logits = _apply(cfg, "mxfp4_full_sr")({"params": params}, tokens, rngs={"quant": jax.random.key(3)})
    assert logits.shape == (2, 8, 256) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_unknown_recipe_and_too_long_sequence():
    with pytest.raises(ValueError, match="mxfp4_full"):
        Llama(TINY, "mxfp5").init(jax.random.key(0), _tokens())
    short = llama_config("tiny", vocab_size=256, max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        Llama(short).init(jax.random.key(0), _tokens(T=8))


# ----------------------------------------------------------------------------------------------------
# initialisation: Megatron/NeMo's scaled init of the residual-writing projections


def _kernel_std(params, layer: str) -> float:
    """Sample std of one kind of kernel over every block (scanned: stacked on a leading axis)."""
    leaves = [
        np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
        if any(getattr(p, "key", None) == layer for p in path)
    ]
    return float(np.std(np.concatenate([a.ravel() for a in leaves])))


@pytest.mark.parametrize("scaled", [True, False])
def test_output_projections_init_std(scaled):
    """o and down ~ normal(0.02 / sqrt(2 n_layers)) when scaled (the default), else 0.02; the others 0.02.

    Each kernel kind has >= 8k samples here, so the sample std is within ~1 % of the true one (its
    standard error is std / sqrt(2 n)); 5 % tolerance cannot mistake 0.02 for 0.01 or the reverse.
    """
    config = dataclasses.replace(TINY, n_layers=4, scaled_output_init=scaled)
    params = _init(config)["params"]
    out_std = 0.02 / math.sqrt(2 * 4) if scaled else 0.02
    assert llama.output_init_std(config) == pytest.approx(out_std)
    for layer, want in (("o", out_std), ("down", out_std), ("q", 0.02), ("gate", 0.02), ("up", 0.02)):
        assert _kernel_std(params, layer) == pytest.approx(want, rel=0.05), layer


def test_scaled_output_init_is_the_default():
    assert llama_config("8b").scaled_output_init
    assert llama.output_init_std(llama_config("8b")) == pytest.approx(0.02 / 8)


def _head_grads(head, x, w, g):
    _, vjp = jax.vjp(head, x, w)
    return vjp(g)


def test_lm_head_backward_runs_in_the_compute_dtype():
    """bf16: the cotangent is rounded to bf16 and both backward GEMMs take bf16 operands (no float32
    GEMM, i.e. no TF32 on GPUs); their results match a float64 reference made from the rounded cotangent
    to bf16's resolution. float32: exactly autodiff's gradients."""
    from fp4jax import selfcheck

    x, w, g = _normal(2, 16, 32, seed=1), _normal(32, 48, seed=2), _normal(2, 16, 48, seed=3)
    plain = lambda x, w: jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)
    for got, want in zip(
        _head_grads(llama.lm_head_logits, x, w, g), _head_grads(plain, x, w, g), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    grads = jax.jit(functools.partial(_head_grads, llama.lm_head_logits))
    dx, dw = grads(xb, wb, jnp.asarray(g))
    assert dx.dtype == dw.dtype == jnp.bfloat16
    g16 = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)
    x64, w64 = np.asarray(xb, np.float64), np.asarray(wb, np.float64)
    np.testing.assert_allclose(np.asarray(dx, np.float64), g16 @ w64.T, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), np.einsum("btd,btv->dv", x64, g16), rtol=2**-8, atol=1e-6
    )
    hlo = grads.lower(xb, wb, jnp.asarray(g)).compile().as_text()
    assert selfcheck.gemm_operand_types(hlo) and set(selfcheck.gemm_operand_types(hlo)) == {"bf16"}, hlo
