"""Pallas (Triton) kernels for fused_quantize: the shared tile math, one HBM pass per operand.

Every kernel body calls tile_math's functions (hadamard_rotate or hadamard_parts, quantize_tile or
block_info_from_amax and encode_nearest, the fold's window), so it computes exactly what the XLA path
computes; only the tiling differs. How the kernels tile and move memory is a `KernelConfig`, a frozen
(hashable) dataclass passed as a static argument: the default is the tuned one,
benchmarks/bench_quantize.py times others, and every config gives the same bits.

- mx: a 2-D grid of (tm, tk) tiles of x; a column-wise tile is transposed in registers, so both layouts
  read x once and write the transposed output directly. A rotated tile whose rotation blocks tile the MX
  block is taken "by parts" (part k = element k of every rotation block), so the butterflies are
  elementwise between parts (tile_math.hadamard_parts); each part's codes are joined back into runs in
  registers and stored contiguously. From 32 parts on, in columns and one-pass folds
  (KernelConfig.encode_joined_from), the rotated parts are joined instead and the tile encoded once,
  which keeps the Triton program (and its compile) short. A row tile's parts are split from one
  contiguous read in registers or read with strided loads (KernelConfig.split_loads). An unrotated
  column-wise tile is taken by parts too (KernelConfig.column_parts), which makes its transpose a set of
  small ones. Other tiles are read whole and rotated with butterflies over reshaped views.
- fp8_fold in one pass (row layout, rows of at most KernelConfig.one_pass_max_row): the mx kernel's
  quantization with whole rows per program, so it knows each row's top block and writes E4M3 directly.
- fp8_fold via mx (columns, and longer rows): the mx kernel also writes each tile's part of the row tops;
  a small row-wise kernel then folds its output: E2M1 packed byte by packed byte (one uint16 of two E4M3
  codes each; 1.06 more bytes per element moved), E2M3's stored E4M3 bytes one to one (2.06 more). It
  keeps the transposing kernel small.

Stochastic rounding: the mx and one-pass kernels draw each tile's random bits themselves (uint32, one
per output element): threefry.random_bits of the key's two words at the element's row-major index in
the output (batch, rows, n), which is its index in the reference's draw (_KernelDraw). Where that formula
is not jax's (threefry.formula_applies, asked by fused_quantize when tracing) or KernelConfig.kernel_bits
is off, they take bits drawn by XLA as one more input with the output's tiling instead. Either way the
bits are read (or drawn) whole or by the same parts as the values, and rounded with
tile_math.encode_elements; a block's non-zero flag (the fold's row top) then comes from its codes. A
prescale needs no input: encode_elements applies it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax.ops import formats
from fp4jax.ops.formats import F32_ABS_MASK, ElemFormat, f32_bits, get_elem_format, require_power_of_two
from fp4jax.ops.kernels import fold, sr_bits, threefry
from fp4jax.ops.kernels import tile_math as tm
from fp4jax.ops.kernels.codes import MAGNITUDE_MASK, fold_e2m1_to_e4m3fn, scale_e4m3fn

__all__ = ["KernelConfig", "Tile", "rotate_quantize_3d"]


@dataclasses.dataclass(frozen=True)
class Tile:
    """Output-orientation rows per program, columns per tile, warps. Powers of two."""

    rows: int
    cols: int
    warps: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            require_power_of_two(getattr(self, field.name), f"Tile.{field.name}")


KERNEL_BITS = ("always", "columns", "never")  # KernelConfig.kernel_bits


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the Pallas kernels tile and move memory; the same bits whatever it says (a speed knob only).

    The defaults were chosen from the compiled kernels on an H200 (no register spills, few shared-memory
    layout changes at sm_90) and timed by benchmarks/bench_quantize.py (docs/performance.md).

      mx_row, mx_column: the mx kernel's tile per layout; mx_column_unrotated: the column-wise mx kernel
        without a rotation (read by parts of column_parts, with a best tile of its own).
      fold_from_mx: the tile of the fold of the mx kernel's output (the "via mx" fold; `cols` elements).
      one_pass: the one-pass fold's program: `cols` elements of whole rows (at least one row).
      column_parts: parts per run for an unrotated column-wise tile (0: read the tile whole).
      split_loads, one_pass_split_loads: whether the row-wise mx kernel / the one-pass fold read a tile
        by parts with one contiguous load split in registers (True) or with one strided load per part.
      one_pass_max_row_rotated, _unrotated: the longest rows (powers of two) the row-wise fold runs in
        one pass; longer rows, and 0 for none, fold via the mx kernel.
      kernel_bits: where stochastic rounding's bits are drawn inside the kernels (threefry.formula_applies
        permitting; no bits in HBM) rather than drawn by XLA and read (4 + 4 bytes per element): "always",
        "columns" (column-wise operands only) or "never". The same bits either way. "columns" is the
        H200's faster choice for rng="threefry": drawing in the kernel saved 9-13 % on column-wise tiles,
        where the transpose leaves the SM room, and cost 8-42 % on row-wise ones, which are
        compute-bound already (docs/performance.md, "Stochastic rounding in the kernels"). The cheaper
        generator rng="threefry13" is drawn in the kernels for both layouts under "columns" (its
        arithmetic is a third of threefry's; reading 4 bytes per element more is not cheaper than that).
      encode_joined_from, encode_joined_from_rows: a tile read by parts of at least this many elements
        (0: none) joins its rotated parts in registers and encodes the joined tile once; a tile of fewer
        parts encodes each part apart (the form bench_quantize timed: 16-point rotations, unrotated
        columns). The first for the column-wise mx kernel and the one-pass fold, the second for the
        row-wise mx kernel. Apart, the Triton program holds a copy of the encoding (and of SR's
        generator) per part, and Triton's coalescing pass walks it from every tile load: the 32-part
        column-wise kernels compiled in 27-54 s on an H100; joined, 1.7-2.5 s against 6-27 s apart on
        a CPU (pip triton 3.5, sm_90, the rotation's signs read as scalars). A row-wise mx tile joined
        compiled 1-3 s faster but used 255 registers, spilling with SR, against 92-168 apart: it stays
        apart until a GPU says otherwise.
    """

    mx_row: Tile = Tile(32, 256, 4)
    mx_column: Tile = Tile(16, 256, 8)
    mx_column_unrotated: Tile = Tile(32, 128, 8)
    fold_from_mx: Tile = Tile(32, 256, 8)
    one_pass: Tile = Tile(1, 8192, 8)
    column_parts: int = 8
    split_loads: bool = True
    one_pass_split_loads: bool = False
    one_pass_max_row_rotated: int = 8192
    one_pass_max_row_unrotated: int = 2048
    kernel_bits: str = "columns"
    encode_joined_from: int = 32
    encode_joined_from_rows: int = 0

    def __post_init__(self):
        for name in ("encode_joined_from", "encode_joined_from_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"KernelConfig.{name} must be >= 0 (0: never), got {getattr(self, name)}")
        if self.column_parts:
            require_power_of_two(self.column_parts, "KernelConfig.column_parts (or 0)")
        if self.kernel_bits not in KERNEL_BITS:
            raise ValueError(
                f"unknown KernelConfig.kernel_bits {self.kernel_bits!r}: use one of {', '.join(KERNEL_BITS)}"
            )

    def draws_in_kernel(self, column: bool, rng: str = "threefry") -> bool:
        """Whether SR's bits for this layout and generator are drawn inside the kernels (kernel_bits)."""
        if self.kernel_bits == "columns":
            return column or rng != "threefry"
        return self.kernel_bits == "always"

    def one_pass_max_row(self, rotated: bool) -> int:
        return self.one_pass_max_row_rotated if rotated else self.one_pass_max_row_unrotated

    def encodes_apart(self, parts: int, row_mx: bool = False) -> bool:
        """Whether a tile read by `parts` parts (0: read whole) encodes each part apart; row_mx: in the
        row-wise mx kernel (encode_joined_from_rows), else encode_joined_from."""
        joined_from = self.encode_joined_from_rows if row_mx else self.encode_joined_from
        joined = 0 < joined_from <= parts
        return parts > 0 and not joined


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


@dataclasses.dataclass(frozen=True)
class _Random:
    """Stochastic rounding's source for one pallas_call: `array` is the bits drawn by XLA ((batch, output
    rows, n) uint32, tiled like the output), or with `in_kernel` the key's two uint32 words, from which
    every tile draws its own (_KernelDraw) with generator `rng` (sr_bits.GENERATORS)."""

    array: jax.Array
    in_kernel: bool
    rng: str = "threefry"

    def spec(self, tile_spec: pl.BlockSpec) -> pl.BlockSpec:
        """The input's BlockSpec: the output's tiling, or the two key words whole for every program."""
        return pl.BlockSpec((2,), lambda *_: (0,)) if self.in_kernel else tile_spec

    def draw(self, out_rows: int, n: int, rows: int, cols: int):
        """The kernels' _KernelDraw for tiles of rows x cols, or None where the bits are an input."""
        return _KernelDraw(out_rows, n, rows, cols, self.rng) if self.in_kernel else None


@dataclasses.dataclass(frozen=True)
class _KernelDraw:
    """Stochastic rounding's bits drawn in a kernel: what a tile needs to know to draw the reference's.

    The reference draws jax.random.bits over (..., out_rows, n / block, block), row-major, which is
    row-major over the output (batch, out_rows, n) (fused_quantize flattens the leading axes in order):
    output element (b, r, c) is draw number (b * out_rows + r) * n + c, whatever the layout of x (a
    column-wise tile is transposed to the output's orientation; its bits are drawn there). The program
    (b, i[, j]) holds output rows i * rows + [0, rows) and columns j * cols + [0, cols) of batch b (no
    third grid axis where cols == n). Its bits are the generator's formula at those indices, in uint32:
    exact, because fused_quantize takes this path only for at most 2**32 elements. rng "threefry":
    threefry.random_bits, one block per element; "threefry13": sr_bits.pair_bits, one block per two
    neighbours (2p, 2p + 1), whose words are interleaved along the row: every tile and part starts at an
    even index where its width is even, so the pairs never straddle two of them.
    """

    out_rows: int
    n: int
    rows: int
    cols: int
    rng: str = "threefry"

    def _indices(self, runs: int, step: int) -> jax.Array:
        """(rows, runs) uint32: the draw numbers of the tile's columns 0, step, 2 step, ... (all rows)."""
        b, i = (pl.program_id(axis).astype(jnp.uint32) for axis in (0, 1))
        j = pl.program_id(2).astype(jnp.uint32) if self.cols < self.n else jnp.uint32(0)
        origin = (b * jnp.uint32(self.out_rows) + i * jnp.uint32(self.rows)) * jnp.uint32(self.n)
        origin = origin + j * jnp.uint32(self.cols)
        r, q = (jax.lax.broadcasted_iota(jnp.int32, (self.rows, runs), d).astype(jnp.uint32) for d in (0, 1))
        return origin + r * jnp.uint32(self.n) + q * jnp.uint32(step)

    def _paired(self, width: int) -> bool:
        return self.rng == "threefry13" and width % 2 == 0 and self.n % 2 == 0

    def _bits(self, words, index: jax.Array) -> jax.Array:
        """The generator's bits at element indices `index`, one formula evaluation per element."""
        if self.rng == "threefry":
            return threefry.random_bits(words, index)
        return sr_bits.random_bits(words, index)

    def tile(self, key_ref) -> jax.Array:
        """The whole tile's bits, (rows, cols) uint32."""
        words = (key_ref[0], key_ref[1])
        if not self._paired(self.cols):
            return self._bits(words, self._indices(self.cols, 1))
        even, odd = sr_bits.pair_bits(words, self._indices(self.cols // 2, 2) >> jnp.uint32(1))
        return jnp.stack([even, odd], axis=-1).reshape(self.rows, self.cols)

    def parts(self, key_ref, size: int) -> list[jax.Array]:
        """The tile's bits by parts (_load_parts' row parts): [bits of column k of every run of `size`]."""
        words, first = (key_ref[0], key_ref[1]), self._indices(self.cols // size, size)
        if not self._paired(size):
            return [self._bits(words, first + jnp.uint32(k)) for k in range(size)]
        pair_first = first >> jnp.uint32(1)  # parts 2m and 2m + 1 are the two words of one block
        pairs = [sr_bits.pair_bits(words, pair_first + jnp.uint32(m)) for m in range(size // 2)]
        return [word for pair in pairs for word in pair]


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """A kernel's input refs: x's tile, the sign row's (random rotations), and stochastic rounding's
    `random`: the bits' tile (uint32, one per output element, in the output orientation: (rows, cols) of
    the output), or with `draw` (a _KernelDraw) the key's two words, from which the tile draws them."""

    x: object
    signs: object = None
    random: object = None
    draw: _KernelDraw | None = None

    @staticmethod
    def split(refs, has_signs: bool, has_random: bool, draw: _KernelDraw | None):
        """(_Inputs, the output refs) from a kernel's refs: x, [signs], [bits or key words], outputs..."""
        x, rest = refs[0], list(refs[1:])
        signs = rest.pop(0) if has_signs else None
        random = rest.pop(0) if has_random else None
        return _Inputs(x, signs, random, draw), rest

    def random_tile(self):
        """The tile's random bits, (rows, cols) uint32, or None (nearest rounding)."""
        if self.random is None:
            return None
        return self.random[...] if self.draw is None else self.draw.tile(self.random)

    def random_parts(self, size: int, split: bool) -> list:
        """The random bits by the values' parts (row parts: they lie in the output orientation whatever
        the layout of x), or [None] * size."""
        if self.random is None:
            return [None] * size
        if self.draw is None:
            return _load_parts(self.random, False, size, split, jnp.uint32)
        return self.draw.parts(self.random, size)

    def sign_parts(self, size: int) -> list[jax.Array] | None:
        """The rotation's signs by parts, [sign of element k of every run], as scalars; or None.

        Every run of the sign row holds the same `size` signs (fused_quantize tiles them), so part k's
        sign is the scalar at column k: one scalar read, not a strided tile load per part. Triton's
        coalescing pass walks the whole program once from every tile load or store, so each load it
        is spared shortens the compile (a random32 column kernel read its signs in 32 of its 66)."""
        if self.signs is None:
            return None
        return [self.signs[0, k] for k in range(size)]

    def quantize_tile(self, column, spec, rotation, fmt, parts: int = 0, split: bool = False):
        """tile_math.quantize_tile of the rotated tile (`rotated_tile`), with the tile's random bits."""
        t = self.rotated_tile(column, rotation, parts, split)
        return tm.quantize_tile(t, fmt, spec, self.random_tile())

    def rotated_tile(self, column, rotation, parts: int, split: bool) -> jax.Array:
        """The tile rotated, (rows, cols) float32 in the output orientation.

        parts == 0: read whole and rotated with butterflies over reshaped views. Otherwise read by parts
        (_load_parts), rotated elementwise between them (tile_math.hadamard_parts), and joined back in
        registers (_interleave): the same tile, element for element."""
        if not parts:
            return _rotate(_load_tile(self.x, column), rotation, self.signs)
        return _interleave(self.rotated_parts(column, rotation, parts, split))

    def rotated_parts(self, column, rotation, size: int, split: bool) -> list[jax.Array]:
        """The tile by parts (_load_parts: element k of every run of `size`), rotated elementwise between
        them (tile_math.hadamard_parts) where the rotation rotates."""
        values = _load_parts(self.x, column, size, split)
        return tm.hadamard_parts(values, self.sign_parts(size)) if rotation.rotates else values


def _side_inputs(sign_row, random: _Random | None, sign_spec, bits_spec):
    """The in_specs and arrays of the optional inputs, in the order _Inputs.split takes them."""
    specs, args = [], []
    if sign_row is not None:
        specs.append(sign_spec)
        args.append(sign_row)
    if random is not None:
        specs.append(random.spec(bits_spec))
        args.append(random.array)
    return specs, args


def _load_tile(x_ref, column: bool):
    t = x_ref[...]
    # Transpose in the input dtype (bf16: half the bytes through shared memory), then widen.
    return (t.T if column else t).astype(jnp.float32)


def _rotate(t, rotation, s_ref):
    if not rotation.rotates:
        return t
    return tm.hadamard_rotate(t, rotation.size, None if s_ref is None else s_ref[...], spelling="reductions")


def _params(tile: Tile):
    return plgpu.CompilerParams(num_warps=tile.warps, num_stages=2)


# ----------------------------------------------------------------------------------------------------
# out="mx"


def _parts(spec, rotation, column: bool, config: KernelConfig) -> int:
    """Elements per run when the mx kernel reads the tile by parts, or 0 when it reads it whole."""
    if rotation.rotates:
        return rotation.size if spec.block_size % rotation.size == 0 else 0
    parts = config.column_parts
    return parts if column and parts and spec.block_size % parts == 0 else 0


def _load_parts(x_ref, column: bool, size: int, split: bool, dtype=jnp.float32) -> list[jax.Array]:
    """The tile by parts: [element k of every run of `size`, as (output rows, runs) `dtype`]."""
    if column or not split:
        return [_load_part(x_ref, column, k, size, dtype) for k in range(size)]
    t = x_ref[...].astype(dtype)
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


def _load_part(x_ref, column: bool, k: int, size: int, dtype=jnp.float32):
    """Element k of every run of `size` along the quantized axis, as an (output rows, runs) `dtype` tile."""
    runs = (x_ref.shape[0] if column else x_ref.shape[1]) // size
    if column:
        return x_ref[pl.ds(k, runs, stride=size), :].T.astype(dtype)
    return x_ref[:, pl.ds(k, runs, stride=size)].astype(dtype)


def _quantize_by_parts(inputs, data_ref, column, spec, rotation, fmt, size, split, fold_rows=None):
    """The (rotated) tile's codes written to data_ref; (block exponents, finite, non-zero), (rows, blocks).

    Each part encoded apart (KernelConfig.encodes_apart; otherwise _Inputs.quantize_tile joins them).
    inputs: the tile's _Inputs (x, and the sign row and random bits or key where there are any).
    Part k holds element k of every run of `size` (a rotation block, tile_math.hadamard_parts); an MX
    block is `per_block` consecutive runs. Codes go back to position k of every run (halved for packed
    E2M1: byte p of a run holds its elements 2p, 2p + 1), joined in registers into one contiguous store.
    With `fold_rows` (the one-pass kernel: a whole row per tile, _RowFold) they go out folded into E4M3,
    one byte each. `split`: read the parts with one contiguous load (row layout), else strided loads.
    """
    parts = inputs.rotated_parts(column, rotation, size, split)
    rows, runs = parts[0].shape
    bits = [f32_bits(p) for p in parts]
    per_block = spec.block_size // size
    amax = functools.reduce(jnp.maximum, [b & F32_ABS_MASK for b in bits])
    amax = jnp.max(amax.reshape(rows, runs // per_block, per_block), axis=-1)
    exponent, finite, nonzero = tm.block_info_from_amax(amax, fmt, spec)

    def per_run(v):  # (rows, blocks) -> (rows, runs)
        return jnp.broadcast_to(v[:, :, None], (rows, runs // per_block, per_block)).reshape(rows, runs)

    e, f = per_run(exponent), per_run(finite)
    random = inputs.random_parts(size, split)
    codes = [tm.encode_elements(b, e, f, fmt, spec, r) for b, r in zip(bits, random, strict=True)]
    if spec.rounding == "stochastic":  # non-zero-ness depends on the draw: read it off the codes
        top = functools.reduce(jnp.maximum, [c & MAGNITUDE_MASK[fmt.name] for c in codes])
        nonzero = tm.rounded_nonzero(top.reshape(rows, runs // per_block, per_block), finite, fmt)
    if fold_rows is not None:
        shift, keep, nan_row = fold_rows.per_block(exponent, finite, nonzero)
        shift, keep = per_run(shift), per_run(keep)
        data_ref[...] = _interleave(
            [tm.fold_elements(c, shift, keep, nan_row, fmt).astype(jnp.uint8) for c in codes]
        )
    elif fmt.name == "e2m1":
        pairs = [(codes[2 * p] & 0xF) | ((codes[2 * p + 1] & 0xF) << 4) for p in range(size // 2)]
        data_ref[...] = _interleave([b.astype(jnp.uint8) for b in pairs])
    else:
        data_ref[...] = _interleave([tm.stored_codes(c, fmt).astype(jnp.uint8) for c in codes])
    return exponent, finite, nonzero


@dataclasses.dataclass
class _RowFold:
    """The fold of a tile that holds whole rows (fold.py's rule), and what it reports per row."""

    fmt: ElemFormat  # the element format folded (fold.FOLDED_ELEMS)
    row_top: jax.Array | None = None  # (rows, 1) int32, once per_block has run
    nan_row: jax.Array | None = None  # (rows, 1) bool
    flushed: jax.Array | None = None  # (rows, 1) int32

    def per_block(self, exponent, finite, nonzero):
        """(rows, blocks) block exponents etc. -> per block: (E4M3 shift, kept, NaN row (rows, 1))."""
        top = jnp.max(jnp.where(nonzero, exponent, tm.NO_BLOCK), axis=1, keepdims=True)
        self.row_top = jnp.where(top == tm.NO_BLOCK, 0, top)
        self.nan_row = jnp.max((~finite).astype(jnp.int32), axis=1, keepdims=True) > 0
        shift, in_window = tm.fold_window(exponent, self.row_top, self.fmt)
        flushed = nonzero & ~in_window & ~self.nan_row
        self.flushed = jnp.sum(flushed.astype(jnp.int32), axis=1, keepdims=True)
        return shift, in_window, self.nan_row


def _mx_kernel(*refs, column, spec, rotation, has_signs, has_random, draw, with_tops, config):
    inputs, outs = _Inputs.split(refs, has_signs, has_random, draw)
    data_ref, scale_ref = outs[:2]
    fmt = get_elem_format(spec.elem)
    rows = data_ref.shape[0]
    parts = _parts(spec, rotation, column, config)
    if config.encodes_apart(parts, row_mx=not column):
        exponent, finite, nonzero = _quantize_by_parts(
            inputs, data_ref, column, spec, rotation, fmt, parts, config.split_loads
        )
    else:
        codes, exponent, finite, nonzero = inputs.quantize_tile(
            column, spec, rotation, fmt, parts, config.split_loads
        )
        data_ref[...] = tm.stored_data(codes, fmt).reshape(rows, -1).astype(jnp.uint8)
    scale_ref[...] = tm.scale_bits(exponent, finite).reshape(rows, -1).astype(jnp.uint8)
    if with_tops:  # this tile's part of each row's top non-zero block exponent, and of its NaN flag
        top_ref, nan_ref = outs[2:]
        top = jnp.where(nonzero, exponent, tm.NO_BLOCK).reshape(rows, -1)
        top_ref[...] = jnp.max(top, axis=1, keepdims=True)
        nan_ref[...] = jnp.max((~finite).astype(jnp.int32).reshape(rows, -1), axis=1, keepdims=True)


def _mx_tile(spec, rotation, column: bool, config: KernelConfig) -> Tile:
    if not column:
        return config.mx_row
    unrotated_parts = not rotation.rotates and _parts(spec, rotation, column, config)
    return config.mx_column_unrotated if unrotated_parts else config.mx_column


def _mx_call(x3, column, spec, rotation, sign_row, random, interpret, config, with_tops=False):
    """Packed data and scales, (batch * rows, ...); with_tops adds per-tile row tops and NaN flags.

    random: None, or stochastic rounding's _Random (bits tiled like the output, or the key's words)."""
    batch, r0, c0 = x3.shape
    out_rows, n = (c0, r0) if column else (r0, c0)
    tile = _mx_tile(spec, rotation, column, config)
    tr = _pick(out_rows, tile.rows, 1)  # output-orientation rows per tile
    tn = _pick(n, tile.cols, rotation.length_multiple(spec.block_size))  # columns: the quantized axis
    per_byte = tm.elements_per_byte(get_elem_format(spec.elem))
    nb = n // spec.block_size
    grid = (batch, out_rows // tr, n // tn)
    if column:
        x_spec = pl.BlockSpec((None, tn, tr), lambda b, i, j: (b, j, i))
    else:
        x_spec = pl.BlockSpec((None, tr, tn), lambda b, i, j: (b, i, j))
    side_specs, side_args = _side_inputs(
        sign_row,
        random,
        pl.BlockSpec((1, tn), lambda b, i, j: (0, j)),
        pl.BlockSpec((None, tr, tn), lambda b, i, j: (b, i, j)),
    )
    in_specs, args = [x_spec, *side_specs], [x3, *side_args]
    kernel = functools.partial(
        _mx_kernel,
        column=column,
        spec=spec,
        rotation=rotation,
        has_signs=sign_row is not None,
        has_random=random is not None,
        draw=None if random is None else random.draw(out_rows, n, tr, tn),
        with_tops=with_tops,
        config=config,
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
# out="fp8_fold" through the MX kernel: write its elements + scales + per-tile row tops, then fold row-wise


def _fold_from_mx_kernel(data_ref, scale_ref, top_ref, nan_ref, out_ref, flushed_ref, *, fmt):
    """Folds a tile of the mx kernel's output row-wise: packed E2M1 bytes into pairs of E4M3 codes, one
    uint16 per byte (low byte: element 2i); MXFP6's stored E4M3 bytes one to one.

    Working on the packed bytes keeps the two codes of a byte together: no interleaving of nibbles in
    registers, and one 16-bit store per pair.
    """
    stored = data_ref[...].astype(jnp.int32)  # (rows, bytes)
    rows, n_bytes = stored.shape
    nb = scale_ref.shape[1]
    by_block = stored.reshape(rows, nb, n_bytes // nb)
    scale = scale_ref[...].astype(jnp.int32).reshape(rows, nb, 1)
    exponent, row_top = scale - formats.SCALE_BIAS, top_ref[...].reshape(rows, 1, 1)
    shift, in_window = tm.fold_window(exponent, row_top, fmt)
    if fmt.name == "e2m1":
        folded = fold_e2m1_to_e4m3fn(by_block & 0xF, shift) | (fold_e2m1_to_e4m3fn(by_block >> 4, shift) << 8)
        nan_code, magnitudes = tm.E4M3FN_NAN * 0x101, 0x77  # a NaN pair; both nibbles' magnitude bits
    else:
        folded = scale_e4m3fn(by_block, shift)
        nan_code, magnitudes = tm.E4M3FN_NAN, 0x7F  # an E4M3 byte's magnitude bits
    nan_row = nan_ref[...].reshape(rows, 1, 1) > 0
    folded = jnp.where(nan_row, nan_code, jnp.where(in_window, folded, 0))
    out_ref[...] = folded.reshape(rows, n_bytes).astype(out_ref.dtype)
    finite = scale != formats.SCALE_NAN_BITS
    nonzero = finite & (jnp.max(by_block & magnitudes, axis=2, keepdims=True) > 0)
    flushed = (nonzero & ~in_window & ~nan_row).astype(jnp.int32)
    flushed_ref[...] = jnp.sum(flushed.reshape(rows, nb), axis=1, keepdims=True)


def _fold_via_mx(x3, column, spec, rotation, sign_row, random, interpret, config):
    data, scale, tops, nans = _mx_call(
        x3, column, spec, rotation, sign_row, random, interpret, config, with_tops=True
    )
    top = jnp.max(tops, axis=1, keepdims=True)
    top = jnp.where(top == tm.NO_BLOCK, 0, top)
    nan_row = jnp.max(nans, axis=1, keepdims=True)
    fmt = get_elem_format(spec.elem)
    per_byte = tm.elements_per_byte(fmt)
    rows, n_bytes = data.shape
    tile = config.fold_from_mx
    block_bytes = spec.block_size // per_byte
    tr, tb = _pick(rows, tile.rows, 1), _pick(n_bytes, tile.cols // per_byte, block_bytes)
    codes, flushed = pl.pallas_call(
        functools.partial(_fold_from_mx_kernel, fmt=fmt),
        grid=(rows // tr, n_bytes // tb),
        in_specs=[
            pl.BlockSpec((tr, tb), lambda i, j: (i, j)),
            pl.BlockSpec((tr, tb // block_bytes), lambda i, j: (i, j)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((tr, tb), lambda i, j: (i, j)),
            pl.BlockSpec((tr, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, n_bytes), jnp.uint16 if per_byte == 2 else jnp.uint8),
            jax.ShapeDtypeStruct((rows, n_bytes // tb), jnp.int32),
        ],
        compiler_params=_params(tile),
        interpret=interpret,
        name="fused_fold_from_mx",
    )(data, scale, top, nan_row)
    folded = jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(rows, per_byte * n_bytes)  # little-endian
    shift = fold.fold_shift(jnp.float8_e4m3fn, spec.elem)
    row_exponent = jnp.where(nan_row[:, 0] > 0, 0, top[:, 0] - shift)
    return folded, row_exponent, jnp.sum(flushed)


# ----------------------------------------------------------------------------------------------------
# out="fp8_fold" in one pass, where a program holds whole rows (row layout, a short contraction axis)


def _one_pass_fits(n: int, spec, rotation, config: KernelConfig) -> bool:
    rotated = rotation.rotates
    fits = n <= config.one_pass_max_row(rotated) and n & (n - 1) == 0
    return fits and n % rotation.length_multiple(spec.block_size) == 0


def _fold_one_pass_kernel(*refs, spec, rotation, has_signs, has_random, draw, config):
    """The mx kernel's quantization of whole rows, written folded: E4M3 bytes, row exponents, flushes."""
    inputs, (data_ref, rowexp_ref, flushed_ref) = _Inputs.split(refs, has_signs, has_random, draw)
    fmt, rows = get_elem_format(spec.elem), data_ref.shape[0]
    fold_rows = _RowFold(fmt)
    parts, split = _parts(spec, rotation, False, config), config.one_pass_split_loads
    if config.encodes_apart(parts):
        _quantize_by_parts(inputs, data_ref, False, spec, rotation, fmt, parts, split, fold_rows)
    else:
        codes, exponent, finite, nonzero = inputs.quantize_tile(False, spec, rotation, fmt, parts, split)
        by_row = lambda v: v.reshape(rows, -1)  # noqa: E731  (rows, blocks)
        shift, keep, nan_row = fold_rows.per_block(by_row(exponent), by_row(finite), by_row(nonzero))
        by_block = codes.reshape(rows, -1, spec.block_size)
        folded = tm.fold_elements(by_block, shift[:, :, None], keep[:, :, None], nan_row[:, :, None], fmt)
        data_ref[...] = folded.reshape(rows, -1).astype(jnp.uint8)
    shift = fold.fold_shift(jnp.float8_e4m3fn, spec.elem)
    rowexp_ref[...] = jnp.where(fold_rows.nan_row, 0, fold_rows.row_top - shift)
    flushed_ref[...] = fold_rows.flushed


def _fold_one_pass(x3, spec, rotation, sign_row, random, interpret, config):
    batch, out_rows, n = x3.shape
    tr = _pick(out_rows, max(1, config.one_pass.cols // n), 1)
    row_tile = pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0))
    side_specs, side_args = _side_inputs(
        sign_row, random, pl.BlockSpec((1, n), lambda b, i: (0, 0)), row_tile
    )
    kernel = functools.partial(
        _fold_one_pass_kernel,
        spec=spec,
        rotation=rotation,
        has_signs=sign_row is not None,
        has_random=random is not None,
        draw=None if random is None else random.draw(out_rows, n, tr, n),
        config=config,
    )
    per_row = pl.BlockSpec((None, tr, 1), lambda b, i: (b, i, 0))
    data, row_exponent, flushed = pl.pallas_call(
        kernel,
        grid=(batch, out_rows // tr),
        in_specs=[row_tile, *side_specs],
        out_specs=[pl.BlockSpec((None, tr, n), lambda b, i: (b, i, 0)), per_row, per_row],
        out_shape=[
            jax.ShapeDtypeStruct((batch, out_rows, n), jnp.uint8),
            jax.ShapeDtypeStruct((batch, out_rows, 1), jnp.int32),
            jax.ShapeDtypeStruct((batch, out_rows, 1), jnp.int32),
        ],
        compiler_params=_params(config.one_pass),
        interpret=interpret,
        name="fused_rotate_quantize_fold_one_pass",
    )(x3, *side_args)
    return data.reshape(batch * out_rows, n), row_exponent.reshape(-1), jnp.sum(flushed)


def rotate_quantize_3d(
    x3, column, spec, rotation, sign_row, random_bits, out, interpret, config: KernelConfig, key_words=None
):
    """x3: (batch, rows, cols); returns fused_quantize's raw outputs (uint8 / int32 arrays).

    Stochastic rounding takes exactly one of: random_bits, (batch, output rows, n) uint32 in the output
    orientation, one per output element (drawn as quantize_mx draws them); or key_words, the key's two
    uint32 words (jax.random.key_data), from which the kernels draw the same bits, which the caller
    vouches for (threefry.formula_applies for batch * rows * cols elements). Neither for nearest rounding.
    """
    given = [a for a in (random_bits, key_words) if a is not None]
    if len(given) != (spec.rounding == "stochastic"):
        raise ValueError("stochastic rounding takes one of random_bits and key_words; nearest rounding none")
    random = _Random(given[0], key_words is not None, spec.rng) if given else None
    if out == "mx":
        return _mx_call(x3, column, spec, rotation, sign_row, random, interpret, config)
    if not column and _one_pass_fits(x3.shape[2], spec, rotation, config):
        return _fold_one_pass(x3, spec, rotation, sign_row, random, interpret, config)
    return _fold_via_mx(x3, column, spec, rotation, sign_row, random, interpret, config)
