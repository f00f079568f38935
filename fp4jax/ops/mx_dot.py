"""The quantized dot_general, as a Flax model imports it: `from fp4jax.ops import mx_dot`.

One module holds the whole public surface a model author needs:

    mx_dot.mx_dot_general(x, w, dimension_numbers, recipe="mxfp4_full_h16")   # any lax.dot_general call
    mx_dot.make_dot_general("mxfp4_full_h16")         # nn.Dense(dot_general=...): deterministic recipes
    mx_dot.QuantDotGeneral                            # linen dot_general_cls: a key per call, FP8 state
    mx_dot.NnxQuantDotGeneral("mxfp4_full_sr", rngs=nnx.Rngs(quant=0))   # nnx.Linear(dot_general=...)
    mx_dot.PRESETS, mx_dot.get_recipe, mx_dot.Recipe, GemmSpec, QuantSpec, RotationSpec

The implementation lives in quantized_dot.py (the custom_vjp), recipes.py and flax_adapters.py; every name
here is also exported by fp4jax.ops itself (`from fp4jax.ops import mx_dot_general`).
"""

from fp4jax.ops.flax_adapters import NnxQuantDotGeneral, QuantDotGeneral
from fp4jax.ops.quantized_dot import make_dot_general, mx_dot_general
from fp4jax.ops.recipes import PRESETS, GemmSpec, QuantSpec, Recipe, RotationSpec, get_recipe

__all__ = [
    "PRESETS",
    "GemmSpec",
    "NnxQuantDotGeneral",
    "QuantDotGeneral",
    "QuantSpec",
    "Recipe",
    "RotationSpec",
    "get_recipe",
    "make_dot_general",
    "mx_dot_general",
]
