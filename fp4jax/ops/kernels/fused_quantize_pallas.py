"""Pallas (Triton) kernels for fused_quantize: the same tile functions, one HBM pass per operand.

Every kernel body calls fused_quantize's tile functions (hadamard_rotate, _quantize_tile, _fold_codes),
so it computes exactly what the XLA path computes; only the tiling differs.

- mx: a 2-D grid of (tm, tk) tiles of x; a column-wise tile is transposed in registers, so both layouts
  read x once and write the transposed output directly.
- fp8_fold: one program per strip of whole output rows (a contract-B row spans the whole contraction
  axis). Pass 1 walks the strip and keeps only each row's top non-zero block exponent; pass 2 walks it
  backwards (the chunks read last are the likeliest to still be in L2), re-quantizes and writes E4M3.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax.ops.formats import get_elem_format
from fp4jax.ops.kernels import fold
from fp4jax.ops.kernels import fused_quantize as fq


@dataclasses.dataclass(frozen=True)
class Tile:
    """Output-orientation rows per program, columns per tile (mx) or per loop step (fold), warps.

    Powers of two. Chosen from the compiled kernels (no register spills, few shared-memory layout
    changes at sm_90); benchmarks/bench_quantize.py --tiles overrides them for tuning.
    """

    rows: int
    cols: int
    warps: int


# (out, column layout) -> Tile
TILES = {
    ("mx", False): Tile(32, 256, 4),
    ("mx", True): Tile(16, 256, 8),
    ("fp8_fold", False): Tile(8, 512, 4),
    ("fp8_fold", True): Tile(16, 256, 8),
}


def _pick(length: int, want: int, minimum: int) -> int:
    """The largest power of two <= want dividing length, at least minimum; ValueError if none."""
    size = want
    while size >= minimum:
        if length % size == 0:
            return size
        size //= 2
    raise ValueError(
        f"no Pallas tile fits an axis of length {length} (needs a multiple of {minimum}): use impl='xla'"
    )


def _load_tile(x_ref, column: bool, rows=slice(None), cols=slice(None)):
    t = x_ref[rows, cols]
    # Transpose in the input dtype (bf16: half the bytes through shared memory), then widen.
    return (t.T if column else t).astype(jnp.float32)


def _rotate(t, rotation, s_ref):
    if rotation.kind == "none":
        return t
    return fq.hadamard_rotate(t, rotation.size, None if s_ref is None else s_ref[...], spelling="reductions")


def _params(tile: Tile):
    return plgpu.CompilerParams(num_warps=tile.warps, num_stages=2)


# ----------------------------------------------------------------------------------------------------
# out="mx"


def _mx_kernel(x_ref, *refs, column, spec, rotation, has_signs):
    s_ref = refs[0] if has_signs else None
    data_ref, scale_ref = refs[-2:]
    fmt = get_elem_format(spec.elem)
    t = _rotate(_load_tile(x_ref, column), rotation, s_ref)
    rows = t.shape[0]
    codes, exponent, finite, _ = fq._quantize_tile(t, fmt, spec)
    data = fq._pack_e2m1(codes) if fmt.name == "e2m1" else codes
    data_ref[...] = data.reshape(rows, -1).astype(jnp.uint8)
    scale_ref[...] = fq._scale_bits(exponent, finite).reshape(rows, -1).astype(jnp.uint8)


def _mx_call(x3, column, spec, rotation, sign_row, interpret):
    batch, r0, c0 = x3.shape
    out_rows, n = (c0, r0) if column else (r0, c0)
    multiple = max(spec.block_size, rotation.size if rotation.kind != "none" else 1)
    tile = TILES["mx", column]
    tr = _pick(out_rows, tile.rows, 1)  # output-orientation rows per tile
    tn = _pick(n, tile.cols, multiple)  # output-orientation columns (the quantized axis)
    per_byte = 2 if spec.elem == "e2m1" else 1
    nb = n // spec.block_size
    grid = (batch, out_rows // tr, n // tn)
    if column:
        x_spec = pl.BlockSpec((None, tn, tr), lambda b, i, j: (b, j, i))
    else:
        x_spec = pl.BlockSpec((None, tr, tn), lambda b, i, j: (b, i, j))
    in_specs, args = [x_spec], [x3]
    if sign_row is not None:
        in_specs.append(pl.BlockSpec((1, tn), lambda b, i, j: (0, j)))
        args.append(sign_row)
    kernel = functools.partial(
        _mx_kernel, column=column, spec=spec, rotation=rotation, has_signs=sign_row is not None
    )
    data, scale = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, tr, tn // per_byte), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, tr, tn // spec.block_size), lambda b, i, j: (b, i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, out_rows, n // per_byte), jnp.uint8),
            jax.ShapeDtypeStruct((batch, out_rows, nb), jnp.uint8),
        ],
        compiler_params=_params(tile),
        interpret=interpret,
        name="fused_rotate_quantize_mx",
    )(*args)
    return data.reshape(batch * out_rows, -1), scale.reshape(batch * out_rows, -1)


# ----------------------------------------------------------------------------------------------------
# out="fp8_fold"


def _fold_kernel(x_ref, *refs, column, spec, rotation, has_signs, chunk, n_chunks):
    s_ref = refs[0] if has_signs else None
    data_ref, rowexp_ref, flushed_ref = refs[-3:]
    fmt = get_elem_format(spec.elem)
    nb = chunk // spec.block_size

    def tile(c):
        start = pl.multiple_of(c * chunk, chunk)
        window = pl.ds(start, chunk)
        t = _load_tile(x_ref, column, rows=window) if column else _load_tile(x_ref, column, cols=window)
        if s_ref is None:
            return _rotate(t, rotation, None)
        return fq.hadamard_rotate(t, rotation.size, s_ref[:, window], spelling="reductions")

    def per_row(v, rows):
        return v.reshape(rows, nb)

    def scan_top(c, carry):
        top, nan = carry
        t = tile(c)
        rows = t.shape[0]
        _, exponent, finite, nonzero = fq._block_info(t, fmt, spec)
        block_top = jnp.where(nonzero, exponent, fq._NO_BLOCK)
        top = jnp.maximum(top, jnp.max(per_row(block_top, rows), axis=1))
        nan = jnp.maximum(nan, jnp.max(per_row((~finite).astype(jnp.int32), rows), axis=1))
        return top, nan

    rows = data_ref.shape[0]
    init = (jnp.full((rows,), fq._NO_BLOCK, jnp.int32), jnp.zeros((rows,), jnp.int32))
    top, nan = jax.lax.fori_loop(0, n_chunks, scan_top, init)
    row_top = jnp.where(top == fq._NO_BLOCK, 0, top)
    nan_row = nan > 0
    shift = fold.fold_shift(jnp.float8_e4m3fn)

    def write(i, flushed):
        c = n_chunks - 1 - i
        codes, exponent, finite, nonzero = fq._quantize_tile(tile(c), fmt, spec)
        spread = lambda v: jnp.broadcast_to(v[:, None], (rows, nb)).reshape(rows * nb)  # noqa: E731
        folded, flushed_blocks = fq._fold_codes(
            codes, exponent, nonzero, spread(row_top), spread(nan_row), shift
        )
        start = pl.multiple_of(c * chunk, chunk)
        data_ref[:, pl.ds(start, chunk)] = folded.reshape(rows, chunk).astype(jnp.uint8)
        return flushed + jnp.sum(per_row(flushed_blocks.astype(jnp.int32), rows), axis=1)

    flushed = jax.lax.fori_loop(0, n_chunks, write, jnp.zeros((rows,), jnp.int32))
    rowexp_ref[...] = jnp.where(nan_row, 0, row_top - shift)
    flushed_ref[...] = flushed


def _fold_call(x3, column, spec, rotation, sign_row, interpret):
    batch, r0, c0 = x3.shape
    out_rows, n = (c0, r0) if column else (r0, c0)
    multiple = max(spec.block_size, rotation.size if rotation.kind != "none" else 1)
    tile = TILES["fp8_fold", column]
    tr = _pick(out_rows, tile.rows, 1)
    chunk = _pick(n, tile.cols, multiple)
    if column:
        x_spec = pl.BlockSpec((None, n, tr), lambda b, i: (b, 0, i))
    else:
        x_spec = pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0))
    in_specs, args = [x_spec], [x3]
    if sign_row is not None:
        in_specs.append(pl.BlockSpec((1, n), lambda b, i: (0, 0)))
        args.append(sign_row)
    kernel = functools.partial(
        _fold_kernel,
        column=column,
        spec=spec,
        rotation=rotation,
        has_signs=sign_row is not None,
        chunk=chunk,
        n_chunks=n // chunk,
    )
    data, row_exponent, flushed = pl.pallas_call(
        kernel,
        grid=(batch, out_rows // tr),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, tr), lambda b, i: (b, i)),
            pl.BlockSpec((None, tr), lambda b, i: (b, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, out_rows, n), jnp.uint8),
            jax.ShapeDtypeStruct((batch, out_rows), jnp.int32),
            jax.ShapeDtypeStruct((batch, out_rows), jnp.int32),
        ],
        compiler_params=_params(tile),
        interpret=interpret,
        name="fused_rotate_quantize_fold",
    )(*args)
    return data.reshape(batch * out_rows, n), row_exponent.reshape(-1), jnp.sum(flushed)


def rotate_quantize_3d(x3, column, spec, rotation, sign_row, out, interpret):
    """x3: (batch, rows, cols); returns fused_quantize's raw outputs (uint8 / int32 arrays)."""
    if out == "mx":
        return _mx_call(x3, column, spec, rotation, sign_row, interpret)
    return _fold_call(x3, column, spec, rotation, sign_row, interpret)
