"""Pallas (Triton) kernels for fused_quantize: the same tile functions, one HBM pass per operand.

Every kernel body calls fused_quantize's tile functions (hadamard_rotate or hadamard_parts,
_quantize_tile or block_info_from_amax and encode_nearest, _fold_codes), so it computes exactly what the
XLA path computes; only the tiling differs.

- mx: a 2-D grid of (tm, tk) tiles of x; a column-wise tile is transposed in registers, so both layouts
  read x once and write the transposed output directly. A rotated tile is taken "by parts" (part k =
  element k of every rotation block), so the butterflies are elementwise between parts
  (fused_quantize.hadamard_parts), and each part's codes go back to position k of every block. A row
  tile is read contiguously and split into parts in registers (SPLIT_LOADS), and the codes are joined
  back into runs in registers and stored contiguously (JOINED_STORES). An unrotated column-wise tile is
  taken by parts too (COLUMN_PARTS), which makes its transpose a set of small ones.
- fp8_fold, method "two_pass" (kept for comparison): one program per strip of whole output rows (a
  contract-B row spans the whole contraction axis). Pass 1 walks the strip and keeps only each row's
  top non-zero block exponent; pass 2 walks it backwards (the chunks read last are the likeliest to
  still be in L2), re-quantizes and writes E4M3.
- fp8_fold, method "via_mx" (both layouts): the mx kernel also writes each tile's part of the row
  tops; a small row-wise kernel then folds its E2M1 output, packed byte by packed byte (one uint16 of
  two E4M3 codes each). It moves 1.06 more bytes per element but keeps the transposing kernel small
  (the two-pass column kernel needs ~170 registers at sm_90).
- fp8_fold, method "one_pass" (the row default; rows of at most ONE_PASS_MAX_ROW, others go via_mx): the
  mx kernel's quantization with a whole row per program, so it knows each row's top block and writes
  E4M3 directly (one pass, no E2M1 round trip).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax.ops import formats
from fp4jax.ops.formats import get_elem_format
from fp4jax.ops.kernels import fold
from fp4jax.ops.kernels import fused_quantize as fq
from fp4jax.ops.kernels.codes import fold_e2m1_to_e4m3fn


@dataclasses.dataclass(frozen=True)
class Tile:
    """Output-orientation rows per program, columns per tile (mx) or per loop step (fold), warps.

    Powers of two. Chosen from the compiled kernels (no register spills, few shared-memory layout
    changes at sm_90); benchmarks/bench_quantize.py --tiles overrides them for tuning.
    """

    rows: int
    cols: int
    warps: int


# (out, column layout) -> Tile; "mx_unrotated" is the column-wise mx kernel without a rotation, which
# reads its tile by parts of COLUMN_PARTS and has a best tile of its own (the --column-parts sweep).
TILES = {
    ("mx", False): Tile(32, 256, 4),
    ("mx", True): Tile(16, 256, 8),
    ("mx_unrotated", True): Tile(32, 128, 8),
    ("fp8_fold", False): Tile(8, 512, 4),
    ("fp8_fold", True): Tile(16, 256, 8),
    ("fold_from_mx", False): Tile(32, 256, 8),
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


# Whether the mx kernel rotates "by parts" (fused_quantize.hadamard_parts; SPLIT_LOADS says how the parts
# are read) where it can, instead of butterflies over reshaped tiles. The same bits either way; a switch
# for timing both.
ROTATE_BY_PARTS = True

# Parts per run for an unrotated column-wise tile (0: read the tile whole and transpose it). Reading
# by parts transposes (runs, rows) slices instead of the whole (cols, rows) tile; the quantization is
# elementwise once the block maxima are known, so the bits are the same. 8 was the fastest of 0/8/16/32
# in a sweep (`benchmarks/bench_quantize.py --shapes 32768x2048 --column-parts 0,8,16,32`). On an H200
# (2026-12-01, `--impls pallas`, same shape) the column mx kernel takes 102.2 us by parts against 169.3
# read whole, the fold through it 189.5 against 399.4 (docs/performance.md).
COLUMN_PARTS = 8


def _parts(spec, rotation, column: bool) -> int:
    """Elements per run when the mx kernel reads the tile by parts, or 0 when it reads it whole."""
    if rotation.kind != "none":
        return rotation.size if ROTATE_BY_PARTS and spec.block_size % rotation.size == 0 else 0
    return COLUMN_PARTS if column and COLUMN_PARTS and spec.block_size % COLUMN_PARTS == 0 else 0


# How a tile read by parts moves through memory; the same bits either way.
# - SPLIT_LOADS, per kernel (row layout, where a part's elements lie `size` apart in a row): one
#   contiguous, vectorizable read of the tile, split into parts in registers, instead of one strided read
#   per part. The column layout's parts are whole rows of x, contiguous already.
# - JOINED_STORES (both layouts): the parts' codes joined back into runs in registers and written with one
#   contiguous store, instead of one strided store per part.
# On an H200 (2026-12-02, H16, 32768 x 8192, docs/performance.md) the row mx kernel took 329 us split and
# joined against 420 strided, the column one 381 against 504 joined; the one-pass fold 516 us joined with
# strided loads against 535 split (and 1,199 with neither). benchmarks/bench_quantize.py --access times them.
SPLIT_LOADS = {"mx": True, "one_pass": False}
JOINED_STORES = True


def _load_parts(x_ref, column: bool, size: int, split: bool) -> list[jax.Array]:
    """The tile by parts: [element k of every run of `size`, as (output rows, runs) float32]."""
    if column or not split:
        return [_load_part(x_ref, column, k, size) for k in range(size)]
    t = x_ref[...].astype(jnp.float32)
    rows, runs = t.shape[0], t.shape[1] // size
    return [p.reshape(rows, runs) for p in jnp.split(t.reshape(rows, runs, size), size, axis=2)]


def _interleave(values: list[jax.Array]) -> jax.Array:
    """[v_0 .. v_{m-1}], each (rows, runs), m a power of two -> (rows, runs * m), v_q at position q of
    every run. Built from two-way joins along a new last axis (all Triton's join offers): each round
    pairs the values whose index differs in the highest bit left, so that bit becomes the slowest of
    the new axes and the final reshape reads the runs in order."""
    rows = values[0].shape[0]
    while len(values) > 1:
        half = len(values) // 2
        values = [jnp.stack([values[r], values[r + half]], axis=-1) for r in range(half)]
    return values[0].reshape(rows, -1)


def _store_parts(data_ref, parts: list[jax.Array], stride: int):
    """Writes the uint8 (rows, runs) parts to data_ref, part k at position k of every run of `stride`."""
    if JOINED_STORES:
        data_ref[...] = _interleave(parts)
        return
    runs = parts[0].shape[1]
    for k, part in enumerate(parts):
        data_ref[:, pl.ds(k, runs, stride=stride)] = part


def _load_part(x_ref, column: bool, k: int, size: int):
    """Element k of every run of `size` along the quantized axis, as an (output rows, runs) float32 tile."""
    runs = (x_ref.shape[0] if column else x_ref.shape[1]) // size
    if column:
        return x_ref[pl.ds(k, runs, stride=size), :].T.astype(jnp.float32)
    return x_ref[:, pl.ds(k, runs, stride=size)].astype(jnp.float32)


def _quantize_by_parts(x_ref, s_ref, data_ref, column, spec, rotation, fmt, size, fold_rows=None):
    """The (rotated) tile's codes written to data_ref; (block exponents, finite, non-zero), (rows, blocks).

    Part k holds element k of every run of `size` (a rotation block, fused_quantize.hadamard_parts);
    an MX block is `per_block` consecutive runs. Codes go back to position k of every run (halved for
    packed E2M1: byte p of a run holds its elements 2p, 2p + 1). With `fold_rows` (the one-pass kernel: a
    whole row per tile, _RowFold) they go out folded into E4M3, one byte each.
    """
    split = SPLIT_LOADS["one_pass" if fold_rows is not None else "mx"]
    parts = _load_parts(x_ref, column, size, split)
    rows, runs = parts[0].shape
    if rotation.kind != "none":
        signs = None if s_ref is None else [s_ref[:, pl.ds(k, runs, stride=size)] for k in range(size)]
        parts = fq.hadamard_parts(parts, signs)
    bits = [fq.f32_bits(p) for p in parts]
    per_block = spec.block_size // size
    amax = functools.reduce(jnp.maximum, [b & fq._ABS_MASK for b in bits])
    amax = jnp.max(amax.reshape(rows, runs // per_block, per_block), axis=-1)
    exponent, finite, nonzero = fq.block_info_from_amax(amax, fmt, spec)

    def per_run(v):  # (rows, blocks) -> (rows, runs)
        return jnp.broadcast_to(v[:, :, None], (rows, runs // per_block, per_block)).reshape(rows, runs)

    e, f = per_run(exponent), per_run(finite)
    codes = [jnp.where(f, fq.encode_nearest(b, e, fmt, spec), 0) for b in bits]
    if fold_rows is not None:
        shift, keep, nan_row = fold_rows.per_block(exponent, finite, nonzero)
        shift, keep = per_run(shift), per_run(keep)
        folded = [fq.fold_elements(c, shift, keep, nan_row).astype(jnp.uint8) for c in codes]
        _store_parts(data_ref, folded, size)
    elif fmt.name == "e2m1":
        pairs = [(codes[2 * p] & 0xF) | ((codes[2 * p + 1] & 0xF) << 4) for p in range(size // 2)]
        _store_parts(data_ref, [b.astype(jnp.uint8) for b in pairs], size // 2)
    else:
        _store_parts(data_ref, [c.astype(jnp.uint8) for c in codes], size)
    return exponent, finite, nonzero


@dataclasses.dataclass
class _RowFold:
    """The fold of a tile that holds whole rows (fold.py's rule), and what it reports per row."""

    row_top: jax.Array | None = None  # (rows, 1) int32, once per_block has run
    nan_row: jax.Array | None = None  # (rows, 1) bool
    flushed: jax.Array | None = None  # (rows, 1) int32

    def per_block(self, exponent, finite, nonzero):
        """(rows, blocks) block exponents etc. -> per block: (E4M3 shift, kept, NaN row (rows, 1))."""
        top = jnp.max(jnp.where(nonzero, exponent, fq._NO_BLOCK), axis=1, keepdims=True)
        self.row_top = jnp.where(top == fq._NO_BLOCK, 0, top)
        self.nan_row = jnp.max((~finite).astype(jnp.int32), axis=1, keepdims=True) > 0
        shift, in_window = fq.fold_window(exponent, self.row_top, fold.fold_shift(jnp.float8_e4m3fn))
        flushed = nonzero & ~in_window & ~self.nan_row
        self.flushed = jnp.sum(flushed.astype(jnp.int32), axis=1, keepdims=True)
        return shift, in_window, self.nan_row


def _mx_kernel(x_ref, *refs, column, spec, rotation, has_signs, with_tops):
    s_ref = refs[0] if has_signs else None
    outs = refs[1:] if has_signs else refs
    data_ref, scale_ref = outs[:2]
    fmt = get_elem_format(spec.elem)
    rows = data_ref.shape[0]
    size = _parts(spec, rotation, column)
    if size:
        exponent, finite, nonzero = _quantize_by_parts(
            x_ref, s_ref, data_ref, column, spec, rotation, fmt, size
        )
    else:
        t = _rotate(_load_tile(x_ref, column), rotation, s_ref)
        codes, exponent, finite, nonzero = fq._quantize_tile(t, fmt, spec)
        data = fq._pack_e2m1(codes) if fmt.name == "e2m1" else codes
        data_ref[...] = data.reshape(rows, -1).astype(jnp.uint8)
    scale_ref[...] = fq._scale_bits(exponent, finite).reshape(rows, -1).astype(jnp.uint8)
    if with_tops:  # this tile's part of each row's top non-zero block exponent, and of its NaN flag
        top_ref, nan_ref = outs[2:]
        top = jnp.where(nonzero, exponent, fq._NO_BLOCK).reshape(rows, -1)
        top_ref[...] = jnp.max(top, axis=1, keepdims=True)
        nan_ref[...] = jnp.max((~finite).astype(jnp.int32).reshape(rows, -1), axis=1, keepdims=True)


def _mx_call(x3, column, spec, rotation, sign_row, interpret, with_tops=False):
    """Packed data and scales, (batch * rows, ...); with_tops adds per-tile row tops and NaN flags."""
    batch, r0, c0 = x3.shape
    out_rows, n = (c0, r0) if column else (r0, c0)
    multiple = max(spec.block_size, rotation.size if rotation.kind != "none" else 1)
    unrotated_parts = rotation.kind == "none" and _parts(spec, rotation, column)  # column-wise only
    tile = TILES["mx_unrotated" if unrotated_parts else "mx", column]
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
        _mx_kernel,
        column=column,
        spec=spec,
        rotation=rotation,
        has_signs=sign_row is not None,
        with_tops=with_tops,
    )
    out_specs = [
        pl.BlockSpec((None, tr, tn // per_byte), lambda b, i, j: (b, i, j)),
        pl.BlockSpec((None, tr, tn // spec.block_size), lambda b, i, j: (b, i, j)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, out_rows, n // per_byte), jnp.uint8),
        jax.ShapeDtypeStruct((batch, out_rows, nb), jnp.uint8),
    ]
    if with_tops:
        out_specs += [pl.BlockSpec((None, tr, 1), lambda b, i, j: (b, i, j))] * 2
        out_shape += [jax.ShapeDtypeStruct((batch, out_rows, n // tn), jnp.int32)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(tile),
        interpret=interpret,
        name="fused_rotate_quantize_mx",
    )(*args)
    return tuple(o.reshape(batch * out_rows, -1) for o in outs)


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


# ----------------------------------------------------------------------------------------------------
# out="fp8_fold" through the MX kernel: write E2M1 + scales + per-tile row tops, then fold row-wise


def _fold_from_mx_kernel(data_ref, scale_ref, top_ref, nan_ref, out_ref, flushed_ref, *, block_size):
    """Folds packed E2M1 bytes into pairs of E4M3 codes, one uint16 per byte (low byte: element 2i).

    Working on the packed bytes keeps the two codes of a byte together: no interleaving of nibbles in
    registers, and one 16-bit store per pair.
    """
    packed = data_ref[...].astype(jnp.int32)  # (rows, bytes)
    rows, n_bytes = packed.shape
    nb, per_block = scale_ref.shape[1], block_size // 2
    by_block = packed.reshape(rows, nb, per_block)
    scale = scale_ref[...].astype(jnp.int32).reshape(rows, nb, 1)
    exponent, row_top = scale - formats.SCALE_BIAS, top_ref[...].reshape(rows, 1, 1)
    shift, in_window = fq.fold_window(exponent, row_top, fold.fold_shift(jnp.float8_e4m3fn))
    pair = fold_e2m1_to_e4m3fn(by_block & 0xF, shift) | (fold_e2m1_to_e4m3fn(by_block >> 4, shift) << 8)
    pair = jnp.where(in_window, pair, 0)
    nan_row = nan_ref[...].reshape(rows, 1, 1) > 0
    pair = jnp.where(nan_row, fq._E4M3FN_NAN * 0x101, pair)
    out_ref[...] = pair.reshape(rows, n_bytes).astype(jnp.uint16)
    finite = scale != formats.SCALE_NAN_BITS
    nonzero = finite & (jnp.max(by_block & 0x77, axis=2, keepdims=True) > 0)
    flushed = (nonzero & ~in_window & ~nan_row).astype(jnp.int32)
    flushed_ref[...] = jnp.sum(flushed.reshape(rows, nb), axis=1, keepdims=True)


def _fold_via_mx(x3, column, spec, rotation, sign_row, interpret):
    data, scale, tops, nans = _mx_call(x3, column, spec, rotation, sign_row, interpret, with_tops=True)
    top = jnp.max(tops, axis=1, keepdims=True)
    top = jnp.where(top == fq._NO_BLOCK, 0, top)
    nan_row = jnp.max(nans, axis=1, keepdims=True)
    rows, n_bytes = data.shape
    tile = TILES["fold_from_mx", False]
    tr, tb = _pick(rows, tile.rows, 1), _pick(n_bytes, tile.cols // 2, spec.block_size // 2)
    pairs, flushed = pl.pallas_call(
        functools.partial(_fold_from_mx_kernel, block_size=spec.block_size),
        grid=(rows // tr, n_bytes // tb),
        in_specs=[
            pl.BlockSpec((tr, tb), lambda i, j: (i, j)),
            pl.BlockSpec((tr, tb * 2 // spec.block_size), lambda i, j: (i, j)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((tr, tb), lambda i, j: (i, j)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, n_bytes), jnp.uint16),
            jax.ShapeDtypeStruct((rows, n_bytes // tb), jnp.int32),
        ],
        compiler_params=_params(tile),
        interpret=interpret,
        name="fused_fold_from_mx",
    )(data, scale, top, nan_row)
    folded = jax.lax.bitcast_convert_type(pairs, jnp.uint8).reshape(rows, 2 * n_bytes)  # little-endian
    shift = fold.fold_shift(jnp.float8_e4m3fn)
    row_exponent = jnp.where(nan_row[:, 0] > 0, 0, top[:, 0] - shift)
    return folded, row_exponent, jnp.sum(flushed)


# ----------------------------------------------------------------------------------------------------
# out="fp8_fold" in one pass, where a program holds whole rows (row layout, a short contraction axis)


# Rows up to this length (a power of two), by whether they are rotated, fold in one pass; a program
# takes ONE_PASS.cols elements of whole rows (at least one row) with ONE_PASS.warps warps. On an H200
# (2026-12-02) the one-pass fold beat via_mx with H16 at rows of 2048 (160 against 213 us, 32768 rows)
# and 8192 (516 against 795), and unrotated at 2048 (134 against 162) but not at 8192 (626 against 584).
ONE_PASS_MAX_ROW = {True: 8192, False: 2048}
ONE_PASS = Tile(rows=1, cols=8192, warps=8)


def _one_pass_fits(n: int, spec, rotation) -> bool:
    rotated = rotation.kind != "none"
    multiple = max(spec.block_size, rotation.size if rotated else 1)
    return n <= ONE_PASS_MAX_ROW[rotated] and n & (n - 1) == 0 and n % multiple == 0


def _fold_one_pass_kernel(x_ref, *refs, spec, rotation, has_signs):
    """The mx kernel's quantization of whole rows, written folded: E4M3 bytes, row exponents, flushes."""
    s_ref = refs[0] if has_signs else None
    data_ref, rowexp_ref, flushed_ref = refs[-3:]
    fmt, rows = get_elem_format(spec.elem), data_ref.shape[0]
    fold_rows = _RowFold()
    size = _parts(spec, rotation, column=False)
    if size:
        _quantize_by_parts(x_ref, s_ref, data_ref, False, spec, rotation, fmt, size, fold_rows)
    else:
        t = _rotate(_load_tile(x_ref, False), rotation, s_ref)
        codes, exponent, finite, nonzero = fq._quantize_tile(t, fmt, spec)
        by_row = lambda v: v.reshape(rows, -1)  # noqa: E731  (rows, blocks)
        shift, keep, nan_row = fold_rows.per_block(by_row(exponent), by_row(finite), by_row(nonzero))
        by_block = codes.reshape(rows, -1, spec.block_size)
        folded = fq.fold_elements(by_block, shift[:, :, None], keep[:, :, None], nan_row[:, :, None])
        data_ref[...] = folded.reshape(rows, -1).astype(jnp.uint8)
    shift = fold.fold_shift(jnp.float8_e4m3fn)
    rowexp_ref[...] = jnp.where(fold_rows.nan_row, 0, fold_rows.row_top - shift)
    flushed_ref[...] = fold_rows.flushed


def _fold_one_pass(x3, spec, rotation, sign_row, interpret):
    batch, out_rows, n = x3.shape
    tr = _pick(out_rows, max(1, ONE_PASS.cols // n), 1)
    in_specs, args = [pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0))], [x3]
    if sign_row is not None:
        in_specs.append(pl.BlockSpec((1, n), lambda b, i: (0, 0)))
        args.append(sign_row)
    kernel = functools.partial(
        _fold_one_pass_kernel, spec=spec, rotation=rotation, has_signs=sign_row is not None
    )
    per_row = pl.BlockSpec((None, tr, 1), lambda b, i: (b, i, 0))
    data, row_exponent, flushed = pl.pallas_call(
        kernel,
        grid=(batch, out_rows // tr),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0)), per_row, per_row],
        out_shape=[
            jax.ShapeDtypeStruct((batch, out_rows, n), jnp.uint8),
            jax.ShapeDtypeStruct((batch, out_rows, 1), jnp.int32),
            jax.ShapeDtypeStruct((batch, out_rows, 1), jnp.int32),
        ],
        compiler_params=_params(ONE_PASS),
        interpret=interpret,
        name="fused_rotate_quantize_fold_one_pass",
    )(*args)
    return data.reshape(batch * out_rows, n), row_exponent.reshape(-1), jnp.sum(flushed)


# How each layout's fold runs: "two_pass" (one kernel, reads x twice, the second time mostly from L2)
# or "via_mx" (the MX kernel, then a fold of its E2M1 output: 1.06 extra bytes per element, but the
# kernels stay small). via_mx for both: on an H200 (2026-12-01) the row layout with H16 took 538 against
# 671 us at 32768x2048 and 1,983 against 2,756 us at 32768x8192, and without rotation the two tied
# (348 / 333, 1,288 / 1,326 us); in the 1B step it raised mxfp4_full_h16 from 46,385 to 49,924 tokens/s
# (docs/performance.md). After the short encoder and the packed-byte fold (2026-12-01, later) via_mx still
# wins with H16 at 32768x2048: rows 345 against 445-481 us (two-pass tiles), columns 281 against 812.
# A third, "one_pass" (row layout only, rows up to ONE_PASS_MAX_ROW; other rows go via_mx), writes E4M3
# from the mx kernel itself: a whole row per program knows its top block. It is the row default since
# the joined stores (2026-12-02: the timings at ONE_PASS_MAX_ROW). benchmarks/bench_quantize.py --sweep
# times all three.
FOLD_METHOD = {False: "one_pass", True: "via_mx"}


def rotate_quantize_3d(x3, column, spec, rotation, sign_row, out, interpret):
    """x3: (batch, rows, cols); returns fused_quantize's raw outputs (uint8 / int32 arrays)."""
    if out == "mx":
        return _mx_call(x3, column, spec, rotation, sign_row, interpret)
    method = FOLD_METHOD[column]
    if method == "one_pass" and not column and _one_pass_fits(x3.shape[2], spec, rotation):
        return _fold_one_pass(x3, spec, rotation, sign_row, interpret)
    if method in ("via_mx", "one_pass"):
        return _fold_via_mx(x3, column, spec, rotation, sign_row, interpret)
    return _fold_call(x3, column, spec, rotation, sign_row, interpret)
