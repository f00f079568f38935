"""GEMM recipes: how each operand of each of a linear layer's three GEMMs is quantized (docs/numerics.md).

For y = x W with tokens T, input features K and output features N:

    GEMM    computes       contraction   GemmSpec.lhs   GemmSpec.rhs
    fprop   y  = x W        K            x              W
    dgrad   dx = dy W^T     N            dy             W
    wgrad   dW = x^T dy     T            x              dy

Every spec is a frozen, hashable dataclass, so a Recipe can be a static jit argument. The study's named
presets live in one explicit dict, PRESETS; `get_recipe` takes a name or a Recipe. `with_fp8_scaling`
maps every FP8 operand of a recipe onto one FP8 scaling (the config key `fp8_scaling`), so each MXFP4
rung keeps exactly the FP8 baseline's scaling in the stages it leaves in FP8.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fp4jax.ops import quant_formats
from fp4jax.ops.formats import ALL_ELEM_FORMATS, require_power_of_two
from fp4jax.ops.kernels.sr_bits import GENERATORS
from fp4jax.ops.ms_eden import MS_EDEN_GROUP
from fp4jax.ops.quant_formats import (
    KINDS,
    MS_EDEN,
    RANDOM_ROUNDINGS,
    ROUNDINGS,
    SCALE_MODES,
    QuantFormat,
    QuantKind,
)
from fp4jax.ops.quantize import FP8_DIVIDES
from fp4jax.ops.rotation import rotate_blocks

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "BACKENDS",
    "BLOCK_KINDS",
    "FP8_DIVIDE_MODES",
    "FP8_ELEMS",
    "FP8_SCALINGS",
    "FP8_SCALING_MODES",
    "GEMMS",
    "H16",
    "H32",
    "HIGH_PRECISION_BLOCKS",
    "MLPERF_FP8_AMAX_ALGO",
    "MLPERF_FP8_HISTORY_LEN",
    "MXFP4",
    "MXFP4_OAS",
    "MXFP4_SR",
    "MXFP4_SR_PRESCALE",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "NVFP4",
    "NVFP4_4OVER6",
    "NVFP4_MS_EDEN",
    "NVFP4_SR",
    "NVFP4_W2D",
    "NVFP4_W2D_4OVER6",
    "NVIDIA_RHT_SEED",
    "PRESETS",
    "QUANTIZERS",
    "QUANT_KINDS",
    "RHT16",
    "RHT128",
    "RHT16_PER_RUN",
    "ROTATIONS",
    "ROTATION_KINDS",
    "SIGN_POLICIES",
    "SR_RNG_MODES",
    "WEIGHT_OPERANDS",
    "GemmSpec",
    "QuantSpec",
    "Recipe",
    "RotationKind",
    "RotationSpec",
    "get_recipe",
    "high_precision_blocks",
    "resolve_recipe",
    "with_fp8_divide",
    "with_fp8_scaling",
    "with_sr_rng",
]


GEMMS = ("fprop", "dgrad", "wgrad")  # a Recipe's three GemmSpec fields, in Recipe.gemms order
QUANT_KINDS = tuple(KINDS)  # the kinds of quant_formats.KINDS, the table each operand's kind is looked up in
# The kinds quantized in blocks along the contraction axis (their block size pads it).
BLOCK_KINDS = tuple(name for name, kind in KINDS.items() if kind.blocked)
# The operands that are the weight W, as (GEMM, side): the only ones that may take 2D NVFP4 blocks.
WEIGHT_OPERANDS = (("fprop", "rhs"), ("dgrad", "rhs"))
# Per-tensor FP8 elements; MX operands take any of formats.ALL_ELEM_FORMATS (E2M1, E2M3, E3M2, E4M3, E5M2).
FP8_ELEMS = quant_formats.FP8_ELEMS
FP8_SCALINGS = ("current", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The config key `fp8_scaling`: "preset" keeps each preset's own FP8 scaling; the others map onto it.
FP8_SCALING_MODES = ("preset", "current", "delayed")
# The config key `sr_rng`: "preset" keeps each operand's own generator; the others (sr_bits.GENERATORS)
# give every stochastically rounded operand that one (with_sr_rng).
SR_RNG_MODES = ("preset", *GENERATORS)
# The config key `fp8_divide`: "preset" keeps each operand's own (every preset's: "ieee"); the others
# (quantize.FP8_DIVIDES) give every per-tensor FP8 operand that one (with_fp8_divide).
FP8_DIVIDE_MODES = ("preset", *FP8_DIVIDES)


@dataclasses.dataclass(frozen=True)
class RotationKind:
    """One rotation kind (RotationSpec.kind) and the implementations that run it.

    reference: rotates the reference path's (B, F, C) operand along C in blocks of `size`, as
    rotation.rotate_blocks(x, axis=-1, size=size, signs=signs) does (None for "none": no rotation).
    fused: True where the fused quantizer (its XLA formulation and the Pallas kernels,
    tile_math.hadamard_rotate) computes this rotation; those implement the (signed) Hadamard only, so
    any other kind is refused there (fused_quantize.fused_refusal) and quantized on the reference path.
    signs: whether the rotation draws random signs (RotationSpec.signs, seed).
    """

    name: str
    reference: Any = None
    fused: bool = False
    signs: bool = False


# Every rotation kind, with the implementations that support it. A new kind is one entry here (and its
# reference function); it runs on the reference path only until the fused quantizer implements it.
ROTATIONS: dict[str, RotationKind] = {
    "none": RotationKind("none", fused=True),
    "deterministic": RotationKind("deterministic", rotate_blocks, fused=True),
    "random": RotationKind("random", rotate_blocks, fused=True, signs=True),
}
ROTATION_KINDS = tuple(ROTATIONS)  # the kinds defined here (ROTATIONS may gain more: tests register one)
SIGN_POLICIES = ("per_call", "per_run")
BACKENDS = ("auto", "emulate", "native", "fp8")
# Who quantizes MX operands: "auto" (the fused Pallas kernels where they run, the reference path
# elsewhere), "pallas" (the same), "xla" (the fused XLA formulation everywhere), "reference"
# (rotation.rotate_blocks + quantize.quantize_mx). The same bits wherever the rotation's sums are exact.
QUANTIZERS = ("auto", "pallas", "xla", "reference")


def _check_choice(value, choices, what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(map(str, choices))}")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized along that GEMM's contraction axis.

    kind "none" leaves the operand in its own dtype; "mx" is MX block quantization (elem any of
    formats.ALL_ELEM_FORMATS: MXFP4 E2M1, MXFP6 E2M3/E3M2, MXFP8 E4M3/E5M2; block_size, scale_mode,
    rounding); "fp8" is per-tensor FP8 (elem e4m3/e5m2, current or delayed scaling, round-half-even);
    "nvfp4" is NVFP4 (nvfp4.quantize_nvfp4: E2M1 elements, E4M3 scales per 16, one float32 scale per
    tensor; rounding nearest_even or stochastic; block_2d: 16 x 16 tiles, for the weight only, so that
    Fprop and Dgrad see the same quantized W).

    block_size defaults to the kind's own: 16 for "nvfp4" (the only size it takes), 32 otherwise.

    prescale (mx only): each block's scale is chosen from the operand itself, then its scaled values are
    multiplied by prescale before rounding (quantize_mx's `prescale`); the GEMM's output is divided by
    the product of both operands' prescales, so the product is unchanged in expectation. Why 3/4 with
    stochastic rounding (Tseng et al. 2025): with the "even" or "floor" rule a block's largest value
    lands in [3.5, 7) or [4, 8) times its scale, and values above E2M1's maximum 6 saturate, which
    biases SR; times 3/4 every value is at most 5.25 or 6, inside the range, so SR is unbiased.

    rng names the generator of stochastic rounding's random bits (kernels/sr_bits.GENERATORS): "threefry"
    (jax.random.bits, every preset's) or "threefry13" (a third of its arithmetic; docs/numerics.md).

    fp8_divide (fp8 only; quantize.FP8_DIVIDES): how the per-tensor scale max / amax and the GEMM's
    reciprocal of the scales are divided: "ieee" (IEEE's quotient on every back end, every preset's) or
    "xla" (the back end's own divide, up to 2 ulp off on GPUs: the 125M study's committed FP8 runs).
    """

    kind: str = "none"
    elem: str = "e2m1"
    block_size: int | None = None
    # "floor" (OCP MX v1.0's rule) is quantize_mx's default too, so a spec and a bare quantize_mx call
    # agree; the study's MXFP4 operand (MXFP4 below) sets AMD's "even" rule explicitly.
    scale_mode: str = "floor"
    rounding: str = "nearest_even"
    fp8_scaling: str = "current"
    prescale: float = 1.0
    block_2d: bool = False
    rng: str = "threefry"
    fp8_divide: str = "ieee"

    def __post_init__(self):
        _check_choice(self.kind, QUANT_KINDS, "quantization kind")
        if self.block_size is None:
            object.__setattr__(self, "block_size", self.quant_kind.default_block_size)
        _check_choice(self.elem, tuple(ALL_ELEM_FORMATS), "element format")
        _check_choice(self.scale_mode, SCALE_MODES, "scale_mode")
        _check_choice(self.rounding, ROUNDINGS, "rounding")
        _check_choice(self.fp8_scaling, FP8_SCALINGS, "fp8_scaling")
        _check_choice(self.rng, GENERATORS, "random-bit generator rng")
        _check_choice(self.fp8_divide, FP8_DIVIDES, "fp8_divide")
        if self.fp8_divide != "ieee" and not self.quant_kind.per_tensor:
            raise ValueError(f"fp8_divide applies to kind 'fp8' (per-tensor) only, not {self.kind!r}")
        require_power_of_two(self.block_size, "block_size")
        if not 0 < self.prescale <= 1:
            raise ValueError(f"prescale must lie in (0, 1], got {self.prescale!r}")
        if self.prescale != 1 and not self.quant_kind.prescale:
            raise ValueError("prescale applies to MX operands only (kind='mx')")
        if not isinstance(self.block_2d, bool):
            raise ValueError(f"block_2d must be True or False, got {self.block_2d!r}")
        if self.block_2d and not self.quant_kind.block_2d:
            raise ValueError(f"block_2d (16 x 16 tiles) applies to NVFP4 operands only, not {self.kind!r}")
        self.quant_kind.check(self)

    @property
    def quant_kind(self) -> QuantKind:
        """The kind's entry in the format table (quant_formats.KINDS): its quantizer and what it takes."""
        return KINDS[self.kind]

    @property
    def format(self) -> QuantFormat | None:
        """The named format (quant_formats.FORMATS) this spec quantizes to; None when unquantized."""
        return quant_formats.format_of(self)

    @property
    def blocked(self) -> bool:
        """True for the kinds quantized in blocks along the contraction axis (mx, nvfp4)."""
        return self.quant_kind.blocked

    @property
    def delayed(self) -> bool:
        """True for a per-tensor operand scaled from amax histories (delayed FP8 scaling)."""
        return self.quant_kind.delayed_scaling and self.fp8_scaling == "delayed"

    @property
    def needs_key(self) -> bool:
        return self.blocked and self.rounding in RANDOM_ROUNDINGS


@dataclasses.dataclass(frozen=True)
class RotationSpec:
    """The rotation applied to both operands of a GEMM along its contraction axis before quantizing.

    Every block v of `size` contiguous elements (a row vector) becomes v Q. "deterministic": Q = H_size
    (the orthonormal Sylvester-Hadamard matrix). "random": Q = diag(s) H_size, i.e. v -> (v * s) @ H_size,
    with random signs s shared by both operands, drawn from the call's key ("per_call") or fixed for the
    whole run by `seed` ("per_run"). Q Q^T = I, so the rotation cancels in the product.
    """

    kind: str = "none"
    size: int = 16
    signs: str = "per_call"
    seed: int = 0

    def __post_init__(self):
        _check_choice(self.kind, tuple(ROTATIONS), "rotation kind")
        _check_choice(self.signs, SIGN_POLICIES, "sign policy")
        require_power_of_two(self.size, "rotation size")

    @property
    def implementation(self) -> RotationKind:
        """The kind's entry in ROTATIONS: which implementations run it."""
        return ROTATIONS[self.kind]

    @property
    def rotates(self) -> bool:
        return self.kind != "none"

    @property
    def needs_key(self) -> bool:
        return self.implementation.signs and self.signs == "per_call"

    def length_multiple(self, block_size: int) -> int:
        """What an axis quantized in blocks of `block_size` under this rotation must be a multiple of:
        every MX block and every rotation block must fit whole."""
        return max(block_size, self.size if self.rotates else 1)


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One GEMM: a spec per operand (in the order of the table above) and one rotation."""

    lhs: QuantSpec = QuantSpec()
    rhs: QuantSpec = QuantSpec()
    rotation: RotationSpec = RotationSpec()

    def __post_init__(self):
        # MS-EDEN's correction is unbiased over a random rotation of its group: it needs one, per call.
        eden = MS_EDEN in (self.lhs.rounding, self.rhs.rounding)
        wanted = RotationSpec(kind="random", size=MS_EDEN_GROUP, signs="per_call")
        if eden and dataclasses.replace(self.rotation, seed=0) != wanted:
            raise ValueError(
                f"rounding='ms_eden' corrects groups of {MS_EDEN_GROUP} rotated by random signs per call: "
                f"give its GEMM RotationSpec(kind='random', size={MS_EDEN_GROUP}), not {self.rotation}"
            )

    @property
    def needs_key(self) -> bool:
        return self.lhs.needs_key or self.rhs.needs_key or self.rotation.needs_key

    @property
    def contraction_multiple(self) -> int:
        """What the contraction axis is zero-padded to: every MX block and rotation block must fit."""
        sizes = [s.block_size for s in (self.lhs, self.rhs) if s.blocked]
        return self.rotation.length_multiple(max(sizes, default=1))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A linear layer's three GEMMs, who quantizes and which back end multiplies, and delayed-FP8 settings.

    `backend` (BACKENDS) runs the GEMMs; "auto" is the device's table entry (probes.choose_backend).
    `quantizer` (QUANTIZERS) says which implementation quantizes MX operands. Both are part of the
    recipe, so two equal recipes run the same code; the trainer's set-up fills them from its config and
    the environment, and records them in the run's summary.

    Delayed FP8 scaling keeps, per layer, one amax history per role (x, W, dy) of
    `fp8_amax_history_len` steps; an operand's scale is max_value / A with A the history's maximum
    ("max") or its newest entry ("most_recent"), as in Transformer Engine's DelayedScaling. The
    defaults are Transformer Engine's (1024, "max"); the MLPerf reference uses (4, "most_recent").
    """

    fprop: GemmSpec = GemmSpec()
    dgrad: GemmSpec = GemmSpec()
    wgrad: GemmSpec = GemmSpec()
    backend: str = "auto"
    name: str = "custom"
    quantizer: str = "auto"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"

    def __post_init__(self):
        _check_choice(self.backend, BACKENDS, "GEMM back end")
        _check_choice(self.quantizer, QUANTIZERS, "quantizer")
        _check_choice(self.fp8_amax_compute_algo, AMAX_COMPUTE_ALGOS, "fp8_amax_compute_algo")
        if not isinstance(self.fp8_amax_history_len, int) or self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len must be an int >= 1, got {self.fp8_amax_history_len!r}")
        for stage in GEMMS:
            for side in ("lhs", "rhs"):
                spec = getattr(getattr(self, stage), side)
                if spec.block_2d and (stage, side) not in WEIGHT_OPERANDS:
                    raise ValueError(
                        f"{stage}.{side} has block_2d=True, but 2D NVFP4 tiles are for the weight W only "
                        "(fprop.rhs, dgrad.rhs): use 1D blocks (block_2d=False) there"
                    )

    @property
    def gemms(self) -> tuple[GemmSpec, GemmSpec, GemmSpec]:
        return (self.fprop, self.dgrad, self.wgrad)

    @property
    def operands(self) -> tuple[QuantSpec, ...]:
        """The six operands' specs in GEMM order (fprop, dgrad, wgrad; lhs before rhs)."""
        return tuple(s for g in self.gemms for s in (g.lhs, g.rhs))

    @property
    def needs_key(self) -> bool:
        """True when some GEMM rounds stochastically or draws random signs per call."""
        return any(g.needs_key for g in self.gemms)

    @property
    def uses_delayed_fp8(self) -> bool:
        """True when some operand uses delayed FP8 scaling (its amax histories are layer state)."""
        return any(s.delayed for s in self.operands)


# ----------------------------------------------------------------------------------------------------
# The study's presets. Stages not in MXFP4 run in the FP8 baseline: E4M3 for x and W, E5M2 for dy.


def _fp8(elem: str, scaling: str = "current") -> QuantSpec:
    return QuantSpec(kind="fp8", elem=elem, fp8_scaling=scaling)


def _fp8_gemms(scaling: str = "current") -> dict[str, GemmSpec]:
    x, w, dy = _fp8("e4m3", scaling), _fp8("e4m3", scaling), _fp8("e5m2", scaling)
    return dict(fprop=GemmSpec(x, w), dgrad=GemmSpec(dy, w), wgrad=GemmSpec(x, dy))


# AMD's production MXFP4 operand: E2M1, blocks of 32, the EVEN scale rule, the hardware's RNE cast.
MXFP4 = QuantSpec(kind="mx", elem="e2m1", block_size=32, scale_mode="even", rounding="nearest_even")
MXFP4_SR = dataclasses.replace(MXFP4, rounding="stochastic")
# SR as Tseng et al. 2025 run it: values scaled by 3/4 first, so nothing saturates and SR stays unbiased.
MXFP4_SR_PRESCALE = dataclasses.replace(MXFP4_SR, prescale=0.75)
# MXFP6 (OCP MX v1.0: E2M3 or E3M2 elements, E8M0 scales per 32) with the study's MXFP4 scale rule and
# rounding, so that in a format comparison the element format is the only difference.
MXFP6_E2M3 = dataclasses.replace(MXFP4, elem="e2m3")
MXFP6_E3M2 = dataclasses.replace(MXFP4, elem="e3m2")
# NVFP4 (arXiv 2509.25149; the quantizer is nvfp4.quantize_nvfp4): E2M1 elements, E4M3 scales per 16,
# one FP32 scale per tensor, round-to-nearest-even; with stochastic rounding (NVIDIA's gradients); and
# the weight's 16 x 16 tiles (NVIDIA's weights: Fprop and Dgrad see the same quantized W).
NVFP4 = QuantSpec(kind="nvfp4", rounding="nearest_even")
NVFP4_SR = dataclasses.replace(NVFP4, rounding="stochastic")
NVFP4_W2D = dataclasses.replace(NVFP4, block_2d=True)
# Four-over-Six (Cook et al., arXiv 2512.02010; Transformer Engine's nvfp4_4over6 arithmetic) with the
# paper's error measure, MSE: per block the better of the maximum scaled to 6 or to 4.
NVFP4_4OVER6 = dataclasses.replace(NVFP4, scale_mode="4over6_mse")
NVFP4_W2D_4OVER6 = dataclasses.replace(NVFP4_W2D, scale_mode="4over6_mse")
# MS-EDEN (Quartet II, arXiv 2601.22813): unbiased, the randomness in the block scale; behind RHT128.
NVFP4_MS_EDEN = dataclasses.replace(NVFP4, rounding="ms_eden")
# qwix's Outlier-Aware Scaling on the study's MXFP4 operand (only the scale rule differs).
MXFP4_OAS = dataclasses.replace(MXFP4, scale_mode="oas")
# NVIDIA's MXFP8 recipe: E4M3 everywhere, scales rounded up (RCEIL).
MXFP8 = QuantSpec(kind="mx", elem="e4m3", block_size=32, scale_mode="ceil", rounding="nearest_even")

H16 = RotationSpec(kind="deterministic", size=16)
H32 = RotationSpec(kind="deterministic", size=32)
RHT16 = RotationSpec(kind="random", size=16, signs="per_call")
# NVIDIA's NVFP4 recipe rotates with one random sign vector fixed for the whole run (Transformer Engine
# hard-codes one); here the vector is random_signs(jax.random.key(NVIDIA_RHT_SEED), 16).
NVIDIA_RHT_SEED = 0
RHT16_PER_RUN = RotationSpec(kind="random", size=16, signs="per_run", seed=NVIDIA_RHT_SEED)
# Quartet II's backward rotation: a 128-point Hadamard with random signs drawn anew for every backward.
RHT128 = RotationSpec(kind="random", size=MS_EDEN_GROUP, signs="per_call")


def _mxfp4_gemm(rotation: RotationSpec = RotationSpec(), spec: QuantSpec = MXFP4) -> GemmSpec:
    return GemmSpec(spec, spec, rotation)


def _recipe(name: str, **gemms: GemmSpec) -> Recipe:
    return Recipe(**{**_fp8_gemms(), **gemms}, name=name)


# The MLPerf llama3.1_8b reference's FP8 (NeMo MegatronMixedPrecision: fp8="hybrid",
# fp8_amax_history_len=4, fp8_amax_compute_algo="most_recent"): Transformer Engine's hybrid format
# (E4M3 forward, E5M2 gradients) with delayed scaling over a 4-step history, scaled by the newest amax.
MLPERF_FP8_HISTORY_LEN = 4
MLPERF_FP8_AMAX_ALGO = "most_recent"


_FULL = dict(fprop=_mxfp4_gemm(), dgrad=_mxfp4_gemm(), wgrad=_mxfp4_gemm())


def _rotated(rotation: RotationSpec) -> dict[str, GemmSpec]:
    return {stage: _mxfp4_gemm(rotation) for stage in GEMMS}


# The literature's recipes in MXFP4 (docs/numerics.md, "Recipes of the literature"). Tseng et al. 2025
# (arXiv 2502.20586): both backward GEMMs stochastic with the 3/4 pre-scale, each behind a random
# Hadamard drawn per call. NVIDIA's NVFP4 recipe (arXiv 2509.25149) on MXFP4 elements and scales: only the
# output gradient dy rounds stochastically, and only Wgrad is rotated, by one fixed random-sign H16.
_TSENG = dict(
    fprop=_mxfp4_gemm(),
    dgrad=_mxfp4_gemm(RHT16, MXFP4_SR_PRESCALE),
    wgrad=_mxfp4_gemm(RHT16, MXFP4_SR_PRESCALE),
)
_NVIDIA = dict(
    fprop=_mxfp4_gemm(),
    dgrad=GemmSpec(MXFP4_SR, MXFP4),  # (dy, W)
    wgrad=GemmSpec(MXFP4, MXFP4_SR, RHT16_PER_RUN),  # (x, dy)
)
# NVIDIA's NVFP4 recipe itself (arXiv 2509.25149, section 4): NVFP4 in all three GEMMs, W in 16 x 16 tiles
# (both of its GEMMs), dy rounded stochastically (both of its GEMMs), x and W to nearest, one fixed
# random-sign H16 on Wgrad's inputs. Its final BF16 layers are the model's `bf16_last_blocks`.
_NVIDIA_NVFP4 = dict(
    fprop=GemmSpec(NVFP4, NVFP4_W2D),  # (x, W)
    dgrad=GemmSpec(NVFP4_SR, NVFP4_W2D),  # (dy, W)
    wgrad=GemmSpec(NVFP4, NVFP4_SR, RHT16_PER_RUN),  # (x, dy)
)


# NVIDIA's NVFP4 recipe with Four-over-Six on the forward pass: x and W of Fprop, and W's one quantization
# (its 16 x 16 tiles) in Dgrad too, so that both GEMMs still multiply the same W; dy and Wgrad as NVIDIA's.
_NVIDIA_NVFP4_4OVER6 = dict(
    fprop=GemmSpec(NVFP4_4OVER6, NVFP4_W2D_4OVER6),  # (x, W)
    dgrad=GemmSpec(NVFP4_SR, NVFP4_W2D_4OVER6),  # (dy, W)
    wgrad=_NVIDIA_NVFP4["wgrad"],  # (x, dy)
)
# Quartet II (the authors' Quartet_II_fn, IST-DASLab/Quartet-II): Fprop NVFP4 to nearest with
# Four-over-Six; both backward GEMMs MS-EDEN on both operands behind a 128-point random-sign Hadamard.
_QUARTET2 = dict(
    fprop=GemmSpec(NVFP4_4OVER6, NVFP4_4OVER6),  # (x, W)
    dgrad=GemmSpec(NVFP4_MS_EDEN, NVFP4_MS_EDEN, RHT128),  # (dy, W)
    wgrad=GemmSpec(NVFP4_MS_EDEN, NVFP4_MS_EDEN, RHT128),  # (x, dy)
)
# The MLPerf Training v6.0 llama3.1_8b MI355X submission (FP4_RECIPE=mxfp4, NVTE_MXFP4_USE_HADAMARD=1):
# MXFP4 in all three GEMMs behind the fixed 16-point Hadamard, which is the study's full_h16 rung;
# one definition serves both names (docs/numerics.md says what its public config leaves open).
_MI355X_MLPERF = _rotated(H16)

# Presets that carry the number of transformer blocks kept in BF16 (first, last): NVIDIA's NVFP4 recipe as
# published at 12B (the first two and the last eight blocks) and at 8B (the last four). The trainer sets
# model.bf16_first_blocks / bf16_last_blocks from here (training.setup.resolve_config).
HIGH_PRECISION_BLOCKS: dict[str, tuple[int, int]] = {"nvfp4_nvidia_12b": (2, 8), "nvfp4_nvidia_8b": (0, 4)}


def high_precision_blocks(recipe: str | Recipe) -> tuple[int, int]:
    """(first, last): the blocks a preset keeps in BF16 ((0, 0) for every other preset and for a Recipe)."""
    return HIGH_PRECISION_BLOCKS.get(recipe, (0, 0)) if isinstance(recipe, str) else (0, 0)


def _format_rungs(prefix: str, spec: QuantSpec) -> dict[str, Recipe]:
    """The study's ladder rungs fprop, fprop_dgrad, full and full_h16 with the MX operands in `spec`'s
    format (FP8 where a rung leaves a GEMM unquantized to MX, as the MXFP4 rungs do)."""
    mx, h16 = _mxfp4_gemm(spec=spec), _mxfp4_gemm(H16, spec)
    rungs = {
        "fprop": dict(fprop=mx),
        "fprop_dgrad": dict(fprop=mx, dgrad=mx),
        "full": dict(fprop=mx, dgrad=mx, wgrad=mx),
        "full_h16": dict(fprop=h16, dgrad=h16, wgrad=h16),
    }
    return {f"{prefix}_{rung}": _recipe(f"{prefix}_{rung}", **gemms) for rung, gemms in rungs.items()}


PRESETS: dict[str, Recipe] = {
    "bf16": Recipe(name="bf16"),
    "fp8": _recipe("fp8"),
    "fp8_delayed": Recipe(**_fp8_gemms("delayed"), name="fp8_delayed"),  # Transformer Engine's defaults
    "fp8_mlperf": Recipe(
        **_fp8_gemms("delayed"),
        name="fp8_mlperf",
        fp8_amax_history_len=MLPERF_FP8_HISTORY_LEN,
        fp8_amax_compute_algo=MLPERF_FP8_AMAX_ALGO,
    ),
    "mxfp4_fprop": _recipe("mxfp4_fprop", fprop=_mxfp4_gemm()),
    "mxfp4_fprop_dgrad": _recipe("mxfp4_fprop_dgrad", fprop=_mxfp4_gemm(), dgrad=_mxfp4_gemm()),
    "mxfp4_full": _recipe("mxfp4_full", **_FULL),
    "mxfp4_full_sr": _recipe(
        "mxfp4_full_sr",
        fprop=_mxfp4_gemm(),
        dgrad=_mxfp4_gemm(spec=MXFP4_SR),
        wgrad=_mxfp4_gemm(spec=MXFP4_SR),
    ),
    "mxfp4_full_sr_prescale": _recipe(
        "mxfp4_full_sr_prescale",
        fprop=_mxfp4_gemm(),
        dgrad=_mxfp4_gemm(spec=MXFP4_SR_PRESCALE),
        wgrad=_mxfp4_gemm(spec=MXFP4_SR_PRESCALE),
    ),
    "mxfp4_full_rht": _recipe("mxfp4_full_rht", **_rotated(RHT16)),
    "mxfp4_full_h16": _recipe("mxfp4_full_h16", **_MI355X_MLPERF),
    "mxfp4_full_h32": _recipe("mxfp4_full_h32", **_rotated(H32)),
    "mxfp4_full_h16_wgrad_only": _recipe("mxfp4_full_h16_wgrad_only", **{**_FULL, "wgrad": _mxfp4_gemm(H16)}),
    # The decomposition arms (docs/study_plan.md, amendment "H16's channel"): Wgrad's quantization alone,
    # and H16 on Fprop only / on Fprop and Dgrad, to locate through which GEMM the rotation recovers.
    "mxfp4_wgrad": _recipe("mxfp4_wgrad", wgrad=_mxfp4_gemm()),
    "mxfp4_full_h16_fprop": _recipe("mxfp4_full_h16_fprop", **{**_FULL, "fprop": _mxfp4_gemm(H16)}),
    "mxfp4_full_h16_fprop_dgrad": _recipe(
        "mxfp4_full_h16_fprop_dgrad", **{**_FULL, "fprop": _mxfp4_gemm(H16), "dgrad": _mxfp4_gemm(H16)}
    ),
    "mxfp4_tseng": _recipe("mxfp4_tseng", **_TSENG),
    "mxfp4_nvidia": _recipe("mxfp4_nvidia", **_NVIDIA),
    "mxfp8": Recipe(
        fprop=_mxfp4_gemm(spec=MXFP8),
        dgrad=_mxfp4_gemm(spec=MXFP8),
        wgrad=_mxfp4_gemm(spec=MXFP8),
        name="mxfp8",
    ),
    **_format_rungs("mxfp6_e2m3", MXFP6_E2M3),
    **_format_rungs("mxfp6_e3m2", MXFP6_E3M2),
    **_format_rungs("nvfp4", NVFP4),
    "nvfp4_nvidia": _recipe("nvfp4_nvidia", **_NVIDIA_NVFP4),
    # The literature's newer recipes (docs/numerics.md, "Recipes of the literature").
    "nvfp4_nvidia_12b": _recipe("nvfp4_nvidia_12b", **_NVIDIA_NVFP4),  # + BF16 blocks: HIGH_PRECISION_BLOCKS
    "nvfp4_nvidia_8b": _recipe("nvfp4_nvidia_8b", **_NVIDIA_NVFP4),
    "nvfp4_4over6": _recipe("nvfp4_4over6", **_NVIDIA_NVFP4_4OVER6),
    "nvfp4_quartet2": _recipe("nvfp4_quartet2", **_QUARTET2),
    "mxfp4_full_oas": _recipe("mxfp4_full_oas", **{stage: _mxfp4_gemm(spec=MXFP4_OAS) for stage in GEMMS}),
    "mxfp4_mlperf_mi355x": _recipe("mxfp4_mlperf_mi355x", **_MI355X_MLPERF),
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    """A preset by name, or the Recipe itself; an unknown name is a ValueError listing the presets."""
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return PRESETS[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"unknown recipe {recipe!r}: use one of {', '.join(PRESETS)} or a Recipe") from None


def _with_operands(recipe: Recipe, spec) -> Recipe:
    """`recipe` with each of its six operand specs s replaced by spec(s)."""
    gemms = {
        stage: dataclasses.replace(g, lhs=spec(g.lhs), rhs=spec(g.rhs))
        for stage, g in zip(GEMMS, recipe.gemms, strict=True)
    }
    return dataclasses.replace(recipe, **gemms)


def with_fp8_scaling(recipe: str | Recipe, mode: str) -> Recipe:
    """`recipe` with every FP8 operand on one scaling; MX and unquantized operands are untouched.

    mode "preset": the recipe as it is. "current": per-tensor current scaling. "delayed": the MLPerf
    reference's delayed scaling (amax history of MLPERF_FP8_HISTORY_LEN steps, newest amax). A recipe
    without FP8 operands comes back equal to itself, so bf16 and all-MXFP4 rungs are unaffected.
    """
    _check_choice(mode, FP8_SCALING_MODES, "fp8_scaling")
    recipe = get_recipe(recipe)
    if mode == "preset" or not any(s.quant_kind.delayed_scaling for s in recipe.operands):
        return recipe

    def spec(s: QuantSpec) -> QuantSpec:
        return dataclasses.replace(s, fp8_scaling=mode) if s.quant_kind.delayed_scaling else s

    history = dict(fp8_amax_history_len=MLPERF_FP8_HISTORY_LEN, fp8_amax_compute_algo=MLPERF_FP8_AMAX_ALGO)
    return dataclasses.replace(_with_operands(recipe, spec), **(history if mode == "delayed" else {}))


def with_sr_rng(recipe: str | Recipe, rng: str) -> Recipe:
    """`recipe` with every stochastically rounded operand drawing its bits from generator `rng`
    (SR_RNG_MODES; "preset": the recipe as it is). Other operands are untouched, so a recipe without
    stochastic rounding comes back equal to itself."""
    _check_choice(rng, SR_RNG_MODES, "sr_rng")
    recipe = get_recipe(recipe)
    if rng == "preset":
        return recipe

    def spec(s: QuantSpec) -> QuantSpec:
        return dataclasses.replace(s, rng=rng) if s.rounding == "stochastic" else s

    return _with_operands(recipe, spec)


def with_fp8_divide(recipe: str | Recipe, divide: str) -> Recipe:
    """`recipe` with every per-tensor FP8 operand's scale divided as `divide` does (FP8_DIVIDE_MODES;
    "preset": the recipe as it is). A recipe without such operands comes back equal to itself."""
    _check_choice(divide, FP8_DIVIDE_MODES, "fp8_divide")
    recipe = get_recipe(recipe)
    if divide == "preset":
        return recipe

    def spec(s: QuantSpec) -> QuantSpec:
        return dataclasses.replace(s, fp8_divide=divide) if s.quant_kind.per_tensor else s

    return _with_operands(recipe, spec)


def resolve_recipe(
    recipe: str | Recipe, fp8_scaling: str = "preset", sr_rng: str = "preset", fp8_divide: str = "preset"
) -> Recipe:
    """The Recipe a run trains with: the preset `recipe` under the config's `fp8_scaling`, `sr_rng` and
    `fp8_divide`."""
    return with_fp8_divide(with_sr_rng(with_fp8_scaling(recipe, fp8_scaling), sr_rng), fp8_divide)
