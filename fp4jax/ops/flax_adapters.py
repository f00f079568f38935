"""Thin Flax adapters around `mx_dot_general`: the only Flax import in fp4jax.ops.

They exist for what a plain function cannot do: draw a fresh PRNG key per call (stochastic rounding,
random Hadamard signs) and keep per-layer state (delayed-FP8 amax histories).

    nn.Dense(features, dot_general_cls=functools.partial(QuantDotGeneral, recipe="mxfp4_full_sr"))
    model.apply(variables, x, rngs={"quant": jax.random.fold_in(quant_key, step)})

    nnx.Linear(din, dout, dot_general=NnxQuantDotGeneral("mxfp4_full_sr", rngs=nnx.Rngs(quant=0)), rngs=...)

Keys: linen's make_rng folds the module path and a per-call counter into the step's key, so each layer,
GEMM and step gets its own; the random bits are drawn for the whole global array, so every device shard
sees different bits. Same seed, same run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from fp4jax.ops.quantized_dot import bind_recipe
from fp4jax.ops.recipes import Recipe, get_recipe

__all__ = [
    "FP8_HISTORY_LENGTH",
    "FP8_META",
    "QUANT_RNG",
    "NnxQuantDotGeneral",
    "QuantDotGeneral",
]


QUANT_RNG = "quant"
FP8_META = "fp8_meta"  # the variable collection of delayed-FP8 amax histories
FP8_HISTORY_LENGTH = 1024


class QuantDotGeneral(nn.Module):
    """A linen `dot_general_cls` running `mx_dot_general` with `recipe`.

    Delayed FP8: the amax histories live in the "fp8_meta" collection and are updated by
    overwrite-with-gradient: differentiate the loss w.r.t. fp8_meta too and replace fp8_meta by its
    cotangent. Each adapter must be called once per differentiated step for that to hold.

    Initialisation (`init`, `init_with_output`) creates the variables and returns lax.dot_general's
    unquantized product: init needs only shapes, and tracing the quantizers there would double the
    model's start-up compile for nothing. The parameters do not depend on it; `apply` always quantizes.
    """

    recipe: str | Recipe = "bf16"
    rng_collection: str = QUANT_RNG
    amax_history_length: int | None = None  # None: the recipe's fp8_amax_history_len

    @nn.compact
    def __call__(self, lhs, rhs, *args, **kwargs):
        """lax.dot_general's signature: (lhs, rhs, dimension_numbers, precision, preferred_element_type)."""
        recipe = get_recipe(self.recipe)
        fp8_meta = self._fp8_meta(recipe)
        if self.is_initializing():
            return jax.lax.dot_general(lhs, rhs, *args, **kwargs)
        dot_general = bind_recipe(recipe, key=self._key(recipe), fp8_meta=fp8_meta)
        return dot_general(lhs, rhs, *args, **kwargs)

    def _key(self, recipe: Recipe):
        if not recipe.needs_key:
            return None
        if self.has_rng(self.rng_collection):
            return self.make_rng(self.rng_collection)
        raise ValueError(
            f"recipe {recipe.name!r} needs randomness: pass rngs={{'{self.rng_collection}': key}} to apply "
            "(fold the step into the key)"
        )

    def _fp8_meta(self, recipe: Recipe):
        if not recipe.uses_delayed_fp8:
            return None
        shape = (self.amax_history_length or recipe.fp8_amax_history_len,)
        return {
            role: self.variable(FP8_META, f"{role}_amax_history", jnp.zeros, shape, jnp.float32).value
            for role in ("lhs", "rhs", "grad")
        }


class NnxQuantDotGeneral(nnx.Module):
    """An NNX `dot_general` for `nnx.Linear(..., dot_general=...)` running `mx_dot_general`.

    Draws one key per call from `rngs[rng_stream]` when the recipe needs randomness.
    """

    def __init__(self, recipe: str | Recipe, *, rngs: nnx.Rngs | None = None, rng_stream: str = QUANT_RNG):
        self.recipe = get_recipe(recipe)
        if self.recipe.uses_delayed_fp8:
            raise ValueError(
                f"recipe {self.recipe.name!r} keeps amax histories as overwrite-with-gradient state, which "
                "only the linen adapter QuantDotGeneral supports: use recipe 'fp8' (current scaling) with NNX"
            )
        if self.recipe.needs_key and rngs is None:
            raise ValueError(
                f"recipe {self.recipe.name!r} needs randomness: pass rngs=nnx.Rngs({rng_stream}=seed)"
            )
        self.rngs = rngs
        self.rng_stream = rng_stream

    def __call__(self, lhs, rhs, *args, **kwargs) -> Any:
        """lax.dot_general's signature: (lhs, rhs, dimension_numbers, precision, preferred_element_type)."""
        key = self.rngs[self.rng_stream]() if self.recipe.needs_key else None
        return bind_recipe(self.recipe, key=key)(lhs, rhs, *args, **kwargs)
