"""Which code runs a recipe's GEMMs in this process: the back end and the quantizer, resolved once.

A Recipe names its GEMM back end (`backend`, "auto" = the device's table entry) and who quantizes its
MX operands (`quantizer`). `resolve_execution` is the edge where a caller (the trainer's set-up, the
self-check) settles both before anything is traced: it applies the caller's overrides, maps "auto" to
this device's back end, checks that the back end can run here, and runs the probes its GEMMs would
otherwise run while traced. The library itself reads no environment variable.
"""

from __future__ import annotations

import dataclasses

import jax

from fp4jax.ops.kernels import backends, probes
from fp4jax.ops.quant_formats import FORMATS, format_of
from fp4jax.ops.recipes import QuantSpec, Recipe, get_recipe

__all__ = ["Execution", "resolve_execution"]


@dataclasses.dataclass(frozen=True)
class Execution:
    """What runs a recipe's GEMMs here, for the run's summary and the self-check.

    backend: the resolved GEMM back end ("emulate", "native" or "fp8"), and why (backend_reason).
    quantizer: Recipe.quantizer; quantizer_runs: what that means on this process's devices.
    """

    backend: str
    backend_reason: str
    quantizer: str
    quantizer_runs: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _quantizer_runs(recipe: Recipe) -> str:
    if recipe.quantizer in ("xla", "reference"):
        return recipe.quantizer
    if probes.describe_device().vendor == "nvidia" and jax.device_count() == 1:
        return f"pallas kernels{_kernel_extras(recipe)} where the tiles fit, reference elsewhere"
    return "reference (the Pallas kernels run on one NVIDIA GPU only)"


def _kernel_extras(recipe: Recipe) -> str:
    """What the kernels do for this recipe beyond nearest rounding, as a parenthesis (or nothing)."""
    mx = [s for s in recipe.operands if s.quant_kind.fused]
    extras = []
    if any(s.rounding == "stochastic" for s in mx):
        extras.append(
            "stochastic rounding in the kernels, which draw its bits themselves where jax's threefry "
            "formula applies"
        )
    if any(s.prescale != 1 for s in mx):
        extras.append("prescale in the kernels")
    return f" ({'; '.join(extras)})" if extras else ""


def _e4m3_scaled(spec: QuantSpec) -> bool:
    """Whether the operand's blocks carry E4M3 scales (its FORMATS row's `scale`; NVFP4's is the one such
    row). native's scaled_dot takes E4M3 scales only where backends.native_multiplies_nvfp4 holds, and
    only against another E4M3-scaled operand (backends.native_supports); E8M0 (MX) scales need no probe."""
    return spec.format is not None and spec.format.scale == "E4M3"


def _unfolded(recipe: Recipe, backend: str) -> str:
    """Which operands the resolved back end multiplies as emulate, as a clause for the reason; else nothing.

    fp8: the block-scaled operands it does not fold exactly into E4M3 (backends.fp8_unfolded: MX other
    than E2M1 and E2M3, i.e. E3M2 and MXFP8's E4M3/E5M2, and NVFP4). native: NVFP4 (E4M3-scaled,
    _e4m3_scaled) operands of GEMMs whose other operand is not, and every such operand where
    backends.native_multiplies_nvfp4 is false (off NVIDIA GPUs and the CPU, or where XLA does not compile
    its scaled_dot): scaled_dot multiplies MX x MX and NVFP4 x NVFP4 (backends.native_supports). Shapes it
    does not take are not named.
    """
    if backend == "fp8":
        unfolded = backends.fp8_unfolded(recipe)
        why = "no exact fold"
    # The native reasons name NVFP4, the one E4M3-scaled row (tests and docs/numerics.md quote them).
    elif backend == "native" and not backends.native_multiplies_nvfp4():
        unfolded = tuple(s for s in recipe.operands if _e4m3_scaled(s))
        why = "native multiplies NVFP4 on NVIDIA GPUs only, where XLA compiles its scaled_dot"
    elif backend == "native":
        mixed = [g for g in recipe.gemms if _e4m3_scaled(g.lhs) != _e4m3_scaled(g.rhs)]
        unfolded = tuple(s for g in mixed for s in (g.lhs, g.rhs) if _e4m3_scaled(s))
        why = "native multiplies NVFP4 by NVFP4 only"
    else:
        return ""
    if not unfolded:
        return ""
    names = sorted({format_of(s).name for s in unfolded}, key=list(FORMATS).index)
    return f"; GEMMs with {' or '.join(names)} operands run as in emulate ({why})"


def resolve_execution(
    recipe: str | Recipe, *, backend: str | None = None, quantizer: str | None = None, source: str = "recipe"
) -> tuple[Recipe, Execution]:
    """(the recipe with the overrides applied, what it runs with here).

    backend / quantizer (None: the recipe's own) override the recipe's fields; `source` names where an
    override came from, for the one-line error of a back end that cannot run here. A back end of "auto"
    stays "auto" in the recipe (so a preset stays equal to itself): it is resolved here, once per
    process (probes.auto_choice, cached and logged once), and the traced GEMMs get that same answer.
    """
    recipe = get_recipe(recipe)
    recipe = dataclasses.replace(
        recipe, backend=backend or recipe.backend, quantizer=quantizer or recipe.quantizer
    )  # __post_init__ checks the names
    if recipe.backend == "auto":
        choice = probes.auto_choice()
        resolved, reason = choice.backend, choice.reason
    else:
        backends.check_backend(recipe.backend, source if backend else "recipe")
        resolved, reason = recipe.backend, f"set by {source}" if backend else "set by the recipe"
    probes.run_probes(resolved)
    execution = Execution(
        resolved, reason + _unfolded(recipe, resolved), recipe.quantizer, _quantizer_runs(recipe)
    )
    return recipe, execution
