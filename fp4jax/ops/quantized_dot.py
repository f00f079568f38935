"""`mx_dot_general`: a quantized drop-in for `jax.lax.dot_general`, one `jax.custom_vjp`.

Every call is brought to one canonical form: each operand is transposed and reshaped to
(batch, free, contraction), so any dimension_numbers (batch dims, several contracting dims, either
operand contracting on any axis) become

    fprop   y[b, m, n]  = sum_k  x[b, m, k]  w[b, n, k]      (x = lhs, w = rhs)
    dgrad   dx[b, m, k] = sum_n dy[b, m, n]  w[b, n, k]
    wgrad   dw[b, n, k] = sum_m  x[b, m, k] dy[b, m, n]

and each of the three GEMMs goes through `_gemm`, which pads the contraction axis, rotates, quantizes
both operands along the contraction axis from the high-precision tensors, and multiplies with float32
accumulation. A quantized tensor is never reused across a change of contraction axis. The contract,
rule by rule: docs/numerics.md.

Each operand reaches its GEMMs as a (B, *, *) view that contracts on its last axis (row-wise) or its
middle axis (column-wise), whichever needs no copy of it (`to_gemm_view`): x (B, M, K) is row-wise in
Fprop and column-wise in Wgrad, a Dense kernel W (B, K, N) column-wise in Fprop and row-wise in Dgrad, dy
row-wise in Dgrad and column-wise in Wgrad. The reference path moves the contraction last, rotates
(rotation.rotate_blocks) and quantizes (quantize.quantize_mx); where the Pallas kernels run (one NVIDIA
GPU) or Recipe.quantizer="xla" asks for it, an MX operand is instead rotated and quantized in one pass
by fused_quantize.rotate_quantize, which reads a column-wise operand in place and, for the fp8 back end,
writes it already folded (`_fused_impl`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp4jax.ops import quantize
from fp4jax.ops.kernels import backends, fused_quantize
from fp4jax.ops.recipes import GemmSpec, QuantSpec, Recipe, RotationSpec, get_recipe
from fp4jax.ops.rotation import random_signs

__all__ = [
    "FP8_HISTORY_ROLES",
    "Layout",
    "RotatedOperands",
    "bind_recipe",
    "from_bcf",
    "from_bfc",
    "make_dot_general",
    "multiply_gemm_operands",
    "mx_dot_general",
    "operand_layouts",
    "quantize_gemm_operands",
    "quantize_operand",
    "rotated_gemm_operands",
    "to_bfc",
    "to_gemm_view",
]


Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]

# Which amax history each operand of each GEMM uses under delayed FP8 scaling.
FP8_HISTORY_ROLES = {"fprop": ("lhs", "rhs"), "dgrad": ("grad", "rhs"), "wgrad": ("lhs", "grad")}


# ----------------------------------------------------------------------------------------------------
# the canonical (batch, free, contraction) layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one operand maps to (B, F, C): the transpose `perm` and the shapes of the three groups."""

    perm: tuple[int, ...]
    batch_shape: tuple[int, ...]
    free_shape: tuple[int, ...]
    contract_shape: tuple[int, ...]

    @property
    def bfc_shape(self) -> tuple[int, int, int]:
        return (math.prod(self.batch_shape), math.prod(self.free_shape), math.prod(self.contract_shape))

    @property
    def bcf_perm(self) -> tuple[int, ...]:
        nb, nf = len(self.batch_shape), len(self.free_shape)
        return self.perm[:nb] + self.perm[nb + nf :] + self.perm[nb : nb + nf]

    @property
    def contraction_first(self) -> bool:
        """True where (B, C, F) is the operand's own order and (B, F, C) is not: a Dense kernel (K, N).

        The GEMMs then take it as it lies, contracting on axis -2, so that no transposed copy of it is made.
        A custom call (the Pallas quantizer) cannot fuse a transpose of its input, so XLA would otherwise
        materialise one; for the stacked float32 weights of a scanned model it hoists those copies out of
        the loop, where they stay live through the whole step (3.9 GB for the 1B model).
        """
        identity = tuple(range(len(self.perm)))
        return self.bcf_perm == identity and self.perm != identity


def _layout(shape: tuple[int, ...], batch: tuple[int, ...], contract: tuple[int, ...]) -> Layout:
    free = tuple(d for d in range(len(shape)) if d not in batch and d not in contract)
    return Layout(
        perm=batch + free + contract,
        batch_shape=tuple(shape[d] for d in batch),
        free_shape=tuple(shape[d] for d in free),
        contract_shape=tuple(shape[d] for d in contract),
    )


def operand_layouts(lhs_shape, rhs_shape, dimension_numbers) -> tuple[Layout, Layout]:
    """The canonical layouts of both operands; the backward GEMMs' dimension numbers follow from them.

    dimension_numbers as lax.dot_general takes them (any sequences of ints)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = _normalize_dims(dimension_numbers)
    return _layout(tuple(lhs_shape), lhs_batch, lhs_contract), _layout(
        tuple(rhs_shape), rhs_batch, rhs_contract
    )


def to_bfc(x: jax.Array, layout: Layout) -> jax.Array:
    return jnp.transpose(x, layout.perm).reshape(layout.bfc_shape)


def from_bfc(x_bfc: jax.Array, layout: Layout) -> jax.Array:
    grouped = x_bfc.reshape(layout.batch_shape + layout.free_shape + layout.contract_shape)
    return jnp.transpose(grouped, _inverse(layout.perm))


def to_gemm_view(x: jax.Array, layout: Layout) -> tuple[jax.Array, int]:
    """x as a (B, *, *) array and the axis it contracts on: (B, F, C) and -1, or, where the operand is
    contraction-first (Layout.contraction_first), (B, C, F) and -2 without moving its data."""
    if not layout.contraction_first:
        return to_bfc(x, layout), -1
    b, f, c = layout.bfc_shape
    return jnp.transpose(x, layout.bcf_perm).reshape(b, c, f), -2


def from_bcf(x_bcf: jax.Array, layout: Layout) -> jax.Array:
    grouped = x_bcf.reshape(layout.batch_shape + layout.contract_shape + layout.free_shape)
    return jnp.transpose(grouped, _inverse(layout.bcf_perm))


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=perm.__getitem__))


def _other_axis(axis: int) -> int:
    """The free axis of a (B, *, *) view that contracts on `axis`: what the backward GEMMs contract."""
    return -3 - axis


def _swap(x_bxy: jax.Array) -> jax.Array:
    return jnp.swapaxes(x_bxy, 1, 2)


def _normalize_dims(dimension_numbers) -> Dims:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb)))


# ----------------------------------------------------------------------------------------------------
# one quantized GEMM


def quantize_operand(x: jax.Array, spec: QuantSpec, key, fp8_scale):
    """One GEMM operand (B, F, C) quantized along C by `spec`, exactly as mx_dot_general quantizes it.

    kind "none": x itself; "mx": an MXArray (quantize_mx along the last axis with the spec's element,
    block size, scale rule, rounding and prescale); "fp8": an FP8Array with `fp8_scale` (None: current
    scaling from x's amax); "nvfp4": an NVFP4Array (2D blocks tile (F, C) in 16 x 16 tiles: F must be a
    multiple of 16). C must be a multiple of the block size (mx_dot_general pads it first); `key` is
    needed only where the spec rounds stochastically (else None). No rotation: rotated_gemm_operands
    rotates before calling this.
    """
    return spec.quant_kind.quantize(x, spec, key, fp8_scale)


def _rotation_signs(rotation: RotationSpec, key) -> jax.Array | None:
    if not rotation.implementation.signs:
        return None
    if rotation.signs == "per_run":
        key = jax.random.key(rotation.seed)
    return random_signs(key, rotation.size)


def _pad_contraction(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _dot_precision(gemm: GemmSpec, precision):
    """The precision of a GEMM's dot: the caller's, except where a plain operand meets a quantized one.

    Quantized operands are exact in the dtype they are multiplied in (bf16, FP8), so the caller's
    precision changes nothing for them, and a GEMM of two plain operands is the caller's lax.dot_general.
    A plain float32 operand times a quantized one is meant to be exact in float32: HIGHEST keeps GPUs from
    rounding it to TF32, which would add an error that is no part of the recipe.
    """
    plain = (not gemm.lhs.quant_kind.quantized, not gemm.rhs.quant_kind.quantized)
    return jax.lax.Precision.HIGHEST if plain in ((True, False), (False, True)) else precision


def _fused_impl(shape, axis: int, spec: QuantSpec, rotation: RotationSpec, quantizer: str) -> str | None:
    """The fused quantizer (fused_quantize.rotate_quantize) for this operand, or None for the reference path.

    quantizer (Recipe.quantizer) "auto" or "pallas": the Pallas kernels on MX operands where they run
    (`fused_quantize.pallas_supports`: one NVIDIA GPU, full tiles; any rounding), the reference path
    elsewhere. "xla": the fused XLA formulation everywhere (slower than the reference path on GPUs; it
    lets CPU tests exercise this wiring). "reference": the reference path. Elements the fused code does
    not encode (none today; fused_quantize.FUSED_ELEMS) take the reference path whatever the setting. Either
    way the operands are bit for bit the reference path's wherever the rotation's float32 sums are exact
    (tests/test_gemm_operands.py).
    """
    if quantizer == "reference" or fused_quantize.fused_refusal(spec, rotation) is not None:
        return None
    impl = fused_quantize.choose_impl(shape, axis, spec, rotation, setting=quantizer)
    # choose_impl falls back to the fused XLA formulation; here only an explicit "xla" gets it.
    return impl if impl == "pallas" or quantizer == "xla" else None


def _quantize_side(
    x, axis: int, spec: QuantSpec, rotation: RotationSpec, signs, key, fp8_scale, fold_out, quantizer
):
    """One (B, *, *) operand contracting on `axis` (-1 or -2) -> its quantized (B, F, C) form.

    Fused: one rotate_quantize pass that reads a column-wise operand in place and writes it transposed
    (folded into E4M3 where `fold_out`). Reference: moved to contraction-last, rotated, quantized.
    """
    impl = _fused_impl(x.shape, axis, spec, rotation, quantizer)
    if impl is not None:
        out = "fp8_fold" if fold_out else "mx"
        return fused_quantize.rotate_quantize(
            x, axis=axis, spec=spec, rotation=rotation, signs=signs, key=key, out=out, impl=impl
        )
    if spec.quant_kind.per_tensor and not rotation.rotates:
        # Per-tensor FP8 is elementwise, so it commutes with the transpose. Quantizing first gives each
        # tensor one amax and one cast that XLA's CSE shares between the two GEMMs reading it (x: Fprop
        # and Wgrad, dy: Dgrad and Wgrad, W: Fprop and Dgrad); the transpose then moves FP8 bytes.
        q = quantize_operand(x, spec, key, fp8_scale)
        return q if axis == -1 else dataclasses.replace(q, data=_swap(q.data))
    return quantize_operand(_rotated_rows(x, axis, rotation, signs), spec, key, fp8_scale)


def _rotated_rows(x, axis: int, rotation: RotationSpec, signs) -> jax.Array:
    """The reference path's operand before quantization: (B, F, C), rotated along C."""
    x = x if axis == -1 else _swap(x)
    if not rotation.rotates:
        return x
    return rotation.implementation.reference(x, axis=-1, size=rotation.size, signs=signs)


class GemmKeys(NamedTuple):
    """One GEMM's random draws: the rotation's signs (None unless random) and a key per operand (None
    for deterministic recipes)."""

    signs: jax.Array | None
    a_key: jax.Array | None
    c_key: jax.Array | None


def _gemm_keys(gemm: GemmSpec, key) -> GemmKeys:
    """The draws of one GEMM from its key: split into (rotation, lhs, rhs) keys, signs from the first."""
    rotation_key, a_key, c_key = jax.random.split(key, 3) if key is not None else (None, None, None)
    return GemmKeys(_rotation_signs(gemm.rotation, rotation_key), a_key, c_key)


def _stage_keys(recipe: Recipe, key) -> tuple[GemmKeys, GemmKeys, GemmKeys]:
    """Fprop's, Dgrad's and Wgrad's draws: stage s gets exactly _gemm_keys(its GEMM, fold_in(key, s)).

    Derived in batched calls (one for the three fold-ins, one for the three splits, one per size of
    per-call signs) instead of up to nine tiny ones, because XLA expands every random call into fusions
    of its own: fewer, batched calls compile to a smaller step (docs/performance.md). vmap changes no
    value, so the draws are the per-GEMM ones bit for bit. Made in the forward pass; the backward GEMMs'
    draws are saved with the residuals.
    """
    gemms = (recipe.fprop, recipe.dgrad, recipe.wgrad)
    if key is None:
        return tuple(_gemm_keys(g, None) for g in gemms)
    stages = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(3, dtype=jnp.uint32))
    split = jax.vmap(lambda k: jax.random.split(k, 3))(stages)  # [stage, (rotation, lhs, rhs)]
    signs = [None if g.rotation.needs_key else _rotation_signs(g.rotation, None) for g in gemms]
    for size in sorted({g.rotation.size for g in gemms if g.rotation.needs_key}):
        drawn_for = [i for i, g in enumerate(gemms) if g.rotation.needs_key and g.rotation.size == size]
        drawn = jax.vmap(lambda k, n=size: random_signs(k, n))(split[jnp.array(drawn_for), 0])
        for row, i in enumerate(drawn_for):
            signs[i] = drawn[row]
    return tuple(GemmKeys(signs[i], split[i, 1], split[i, 2]) for i in range(3))


def _padded(a, a_axis: int, c, c_axis: int, gemm: GemmSpec):
    """(a, c) zero-padded along their contraction axes to the GEMM's contraction multiple."""
    a = _pad_contraction(a, a_axis, gemm.contraction_multiple)
    return a, _pad_contraction(c, c_axis, gemm.contraction_multiple)


def quantize_gemm_operands(
    a, a_axis: int, c, c_axis: int, gemm: GemmSpec, key, fp8_scales, *, backend: str, quantizer: str = "auto"
):
    """The two operands of out[b, m, n] = sum_k a[.., k ..] c[.., k ..] as the back end multiplies them.

    a and c are (B, *, *) with the contraction on a_axis / c_axis (-1 row-wise, -2 column-wise). Both are
    zero-padded along it, rotated (one set of signs for both) and quantized; the results are (B, M, K) and
    (B, N, K): MXArray, NVFP4Array, FP8Array, the plain array, or fold.FoldedOperand where the fused
    quantizer folds for the fp8 back end (`backends.quantizer_folds`). `backend` is resolved (not
    "auto"); `quantizer` is a Recipe.quantizer value (`_fused_impl`).
    """
    return _quantize_operands(
        a, a_axis, c, c_axis, gemm, _gemm_keys(gemm, key), fp8_scales, backend=backend, quantizer=quantizer
    )


def _quantize_operands(a, a_axis, c, c_axis, gemm, keys: GemmKeys, fp8_scales, *, backend, quantizer):
    """quantize_gemm_operands with the GEMM's draws already made (_gemm_keys or _stage_keys)."""
    a, c = _padded(a, a_axis, c, c_axis, gemm)
    fold_out = backends.quantizer_folds(gemm.lhs, gemm.rhs, backend)
    rotation, signs = gemm.rotation, keys.signs
    qa = _quantize_side(a, a_axis, gemm.lhs, rotation, signs, keys.a_key, fp8_scales[0], fold_out, quantizer)
    qc = _quantize_side(c, c_axis, gemm.rhs, rotation, signs, keys.c_key, fp8_scales[1], fold_out, quantizer)
    return qa, qc


def _gemm(
    a, a_axis, c, c_axis, gemm, keys, fp8_scales, out_dtype, *, backend: str, quantizer: str, precision
):
    """out[b, m, n] = sum_k a[.., k ..] c[.., k ..], each operand rotated and quantized along k with the
    GEMM's draws `keys` (GemmKeys)."""
    qa, qc = _quantize_operands(
        a, a_axis, c, c_axis, gemm, keys, fp8_scales, backend=backend, quantizer=quantizer
    )
    return multiply_gemm_operands(qa, qc, gemm, backend=backend, precision=precision, out_dtype=out_dtype)


def multiply_gemm_operands(qa, qc, gemm: GemmSpec, *, backend: str, precision=None, out_dtype=jnp.float32):
    """The product of one GEMM's quantized operands (quantize_gemm_operands) as mx_dot_general forms it.

    The back end's float32 product (`backend` resolved), at `_dot_precision`, the operands' prescales
    undone on it: times float32(1 / (lhs.prescale * rhs.prescale)), one float32 rounding. Float32, or
    already `out_dtype` (what the caller rounds it to) where the back end can give the same values
    directly (backends.matmul).
    """
    prescale = gemm.lhs.prescale * gemm.rhs.prescale  # QuantSpec.prescale: undone on the float32 product
    out = backends.matmul(
        qa,
        qc,
        backend=backend,
        precision=_dot_precision(gemm, precision),
        out_dtype=out_dtype if prescale == 1 else jnp.float32,
    )
    # Undone as a multiply by the float32 reciprocal: what XLA compiles a division by a constant into
    # anyway, written out so that the bits are the contract's rather than the compiler's choice.
    return out if prescale == 1 else out * jnp.float32(1 / prescale)


@dataclasses.dataclass(frozen=True)
class RotatedOperands:
    """One GEMM's row-wise operands as the reference path forms them: `a` (B, M, K) and `c` (B, N, K)
    zero-padded and rotated along K (the basis the GEMM quantizes in), and their quantized forms."""

    a: jax.Array
    c: jax.Array
    qa: Any
    qc: Any


def rotated_gemm_operands(a, c, gemm: GemmSpec, key, fp8_scales=(None, None)) -> RotatedOperands:
    """The operands of out[b, m, n] = sum_k a[b, m, k] c[b, n, k] under `gemm`, on the reference path.

    The same padding, signs, keys and quantization as quantize_gemm_operands with quantizer="reference"
    on row-wise operands (`key` is the GEMM's key; fp8_scales None: current scaling), with the rotated
    unquantized operands kept: what the per-GEMM diagnostics measure against. An unquantized operand is
    its own quantized form; a prescaled MX operand represents prescale * its operand.
    """
    a, c = _padded(a, -1, c, -1, gemm)
    signs, a_key, c_key = _gemm_keys(gemm, key)
    a = _rotated_rows(a, -1, gemm.rotation, signs)
    c = _rotated_rows(c, -1, gemm.rotation, signs)
    qa = quantize_operand(a, gemm.lhs, a_key, fp8_scales[0])
    qc = quantize_operand(c, gemm.rhs, c_key, fp8_scales[1])
    return RotatedOperands(a, c, qa, qc)


def _fp8_scales(recipe: Recipe, fp8_meta, stage: str) -> tuple[Any, Any]:
    """Delayed-scaling FP8 scales for one GEMM's operands from the amax histories (None = current)."""
    gemm = getattr(recipe, stage)
    algo = recipe.fp8_amax_compute_algo
    scales = []
    for spec, role in zip((gemm.lhs, gemm.rhs), FP8_HISTORY_ROLES[stage], strict=True):
        if spec.delayed:
            scales.append(quantize.fp8_scale_from_history(fp8_meta[role], spec.elem, algo, spec.fp8_divide))
        else:
            scales.append(None)
    return tuple(scales)


# ----------------------------------------------------------------------------------------------------
# the custom_vjp


def _forward(lhs, rhs, fprop_keys: GemmKeys, fp8_meta, dims, recipe, backend, precision, out_dtype):
    lhs_layout, rhs_layout = operand_layouts(lhs.shape, rhs.shape, dims)
    out_bmn = _gemm(
        *to_gemm_view(lhs, lhs_layout),
        *to_gemm_view(rhs, rhs_layout),
        recipe.fprop,
        fprop_keys,
        _fp8_scales(recipe, fp8_meta, "fprop"),
        out_dtype,
        backend=backend,
        quantizer=recipe.quantizer,
        precision=precision,
    )
    out_shape = lhs_layout.batch_shape + lhs_layout.free_shape + rhs_layout.free_shape
    return out_bmn.reshape(out_shape).astype(out_dtype)


# Each pass is jitted, its static arguments the recipe, dimension numbers, back end, precision and
# output dtype. Called eagerly (or under an eager grad) the custom_vjp would otherwise dispatch each of the
# quantizers' hundreds of primitives on its own: an 8 x 256 x 128 product took 5 s on a CPU. inline=True:
# on jax 0.10 each pass is traced into a caller's jaxpr as before (no nested jit, every preset's jaxpr
# unchanged); jax 0.11.2 keeps the passes as nested jits in the caller's jaxpr.
_STATIC = (4, 5, 6, 7, 8)
_jit_pass = functools.partial(jax.jit, static_argnums=_STATIC, inline=True)


@_jit_pass
def _mx_dot_primal(lhs, rhs, key, fp8_meta, dims, recipe, backend, precision, out_dtype):
    fprop_keys = _stage_keys(recipe, key)[0]
    return _forward(lhs, rhs, fprop_keys, fp8_meta, dims, recipe, backend, precision, out_dtype)


@_jit_pass
def _mx_dot_fwd(lhs, rhs, key, fp8_meta, dims, recipe, backend, precision, out_dtype):
    """The forward, with the backward GEMMs' draws made here with Fprop's (_stage_keys) and saved."""
    fprop_keys, dgrad_keys, wgrad_keys = _stage_keys(recipe, key)
    out = _forward(lhs, rhs, fprop_keys, fp8_meta, dims, recipe, backend, precision, out_dtype)
    return out, (lhs, rhs, (dgrad_keys, wgrad_keys), fp8_meta)


@functools.partial(jax.jit, static_argnums=tuple(range(len(_STATIC))), inline=True)
def _mx_dot_bwd(dims, recipe, backend, precision, out_dtype, residuals, g):
    """Dgrad and Wgrad, each re-quantizing its operands along its own contraction axis.

    Under delayed FP8 scaling the "cotangent" of fp8_meta is the updated amax histories
    (overwrite-with-gradient): the caller replaces its state by it.
    """
    lhs, rhs, (dgrad_keys, wgrad_keys), fp8_meta = residuals
    lhs_layout, rhs_layout = operand_layouts(lhs.shape, rhs.shape, dims)
    x, x_axis = to_gemm_view(lhs, lhs_layout)
    w, w_axis = to_gemm_view(rhs, rhs_layout)
    dy_bmn = g.reshape(lhs_layout.bfc_shape[:2] + rhs_layout.bfc_shape[1:2])
    gemm = functools.partial(_gemm, backend=backend, quantizer=recipe.quantizer, precision=precision)

    # Dgrad contracts N: dy row-wise, W on its free axis. Wgrad contracts M (tokens): x on its free axis,
    # dy column-wise. For x (B, M, K) and a Dense kernel W (B, K, N) both views are the arrays themselves.
    dgrad_scales, wgrad_scales = (
        _fp8_scales(recipe, fp8_meta, "dgrad"),
        _fp8_scales(recipe, fp8_meta, "wgrad"),
    )
    dx_bmk = gemm(dy_bmn, -1, w, _other_axis(w_axis), recipe.dgrad, dgrad_keys, dgrad_scales, lhs.dtype)
    dw_bkn = gemm(x, _other_axis(x_axis), dy_bmn, -2, recipe.wgrad, wgrad_keys, wgrad_scales, rhs.dtype)
    d_lhs = from_bfc(dx_bmk, lhs_layout).astype(lhs.dtype)
    # dw is (B, K, N) = (B, C, F) of W: W's own order when W is contraction-first.
    d_rhs = from_bcf(dw_bkn, rhs_layout).astype(rhs.dtype)
    new_meta = None
    if fp8_meta is not None:
        update = quantize.fp8_amax_history_update
        new_meta = {
            "lhs": update(fp8_meta["lhs"], lhs),
            "rhs": update(fp8_meta["rhs"], rhs),
            "grad": update(fp8_meta["grad"], g),
        }
    return d_lhs, d_rhs, None, new_meta


_mx_dot = jax.custom_vjp(_mx_dot_primal, nondiff_argnums=_STATIC)
_mx_dot.defvjp(_mx_dot_fwd, _mx_dot_bwd)


def mx_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: str | Recipe,
    key: jax.Array | None = None,
    fp8_meta: dict[str, jax.Array] | None = None,
    out_sharding=None,
) -> jax.Array:
    """`jax.lax.dot_general` with each of its three GEMMs quantized as `recipe` says.

    Args:
      recipe: a preset name (see PRESETS) or a Recipe.
      key: PRNG key; required when the recipe rounds stochastically or draws random signs per call.
        It is folded per GEMM; pass a different key per layer and per step (the Flax adapters do).
      fp8_meta: amax histories {"lhs", "rhs", "grad"} (float32 vectors) for delayed FP8 scaling; their
        cotangent is the updated histories (the Flax adapters handle this).
    Returns the product in `preferred_element_type`, else in the promoted input dtype, as lax.dot_general.
    """
    bind = bind_recipe(get_recipe(recipe), key, fp8_meta)
    return bind(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding)


def _recipe_dot_general(
    recipe: Recipe,
    key,
    fp8_meta,
    lhs,
    rhs,
    dimension_numbers,
    precision,
    preferred_element_type,
    out_sharding,
) -> jax.Array:
    """mx_dot_general for a Recipe already looked up (get_recipe once, at the caller's edge).

    The back end is resolved here, once per call (an "auto" one from probes.auto_choice, which
    execution.resolve_execution settles before anything is traced), and both passes use that answer.
    """
    if out_sharding is not None:
        raise NotImplementedError("mx_dot_general does not take out_sharding yet: shard its inputs instead")
    if recipe.needs_key and key is None:
        raise ValueError(
            f"recipe {recipe.name!r} rounds stochastically or draws random signs: pass key=..., "
            "or use the Flax adapters, which draw one from the 'quant' rng stream"
        )
    if recipe.uses_delayed_fp8 and fp8_meta is None:
        raise ValueError(
            f"recipe {recipe.name!r} uses delayed FP8 scaling: pass fp8_meta (amax histories), "
            "or use the linen adapter QuantDotGeneral, which keeps them"
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.promote_types(lhs.dtype, rhs.dtype))
    dims = _normalize_dims(dimension_numbers)
    backend = backends.resolve_backend(recipe.backend)
    return _mx_dot(lhs, rhs, key, fp8_meta, dims, recipe, backend, precision, out_dtype)


def make_dot_general(
    recipe: str | Recipe, key: jax.Array | None = None, fp8_meta: dict[str, jax.Array] | None = None
):
    """`mx_dot_general` with recipe, key and fp8_meta bound, behind lax.dot_general's signature.

    For `nn.Dense(dot_general=...)` / `nnx.Linear(dot_general=...)`, and the one path by which the Flax
    adapters call `mx_dot_general` (they bind a fresh key and their amax histories per call). For recipes
    that need a key per call, prefer the adapters: a fixed `key` here reuses the same random draws at
    every step. The recipe is looked up here, once, not again per call.
    """
    return bind_recipe(get_recipe(recipe), key, fp8_meta)


def bind_recipe(recipe: Recipe, key: jax.Array | None = None, fp8_meta: dict[str, jax.Array] | None = None):
    """make_dot_general for a Recipe already looked up: what the Flax adapters call (no second lookup)."""

    def dot_general(
        lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None
    ):
        args = (lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)
        return _recipe_dot_general(recipe, key, fp8_meta, *args)

    return dot_general
