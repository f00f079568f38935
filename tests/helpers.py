"""What several test modules share: one quantized layer's forward and backward, random GEMM operands, a
source file's module name. Fixtures shared by several modules live in conftest.py (the gpt2 tokenizer,
the tiny runs)."""

from __future__ import annotations

import importlib
import pathlib
import sys

import jax
import jax.extend.core
import jax.numpy as jnp

from fp4jax.ops import mx_dot_general

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIMS = (((1,), (0,)), ((), ()))  # x (M, K) times w (K, N)


def fwd_bwd(x, w, dy, key=None, *, recipe, dims=DIMS, precision=None, pet=None, fp8_meta=None):
    """(y, dx, dw): mx_dot_general(x, w, dims, ...) and its vjp with the cotangent dy (cast to y's dtype)."""

    def layer(a, b):
        return mx_dot_general(a, b, dims, precision, pet, recipe=recipe, key=key, fp8_meta=fp8_meta)

    y, vjp = jax.vjp(layer, x, w)
    return (y, *vjp(dy.astype(y.dtype)))


def all_eqns(jaxpr):
    """Every equation of a jaxpr (or ClosedJaxpr), those of the jaxprs nested in its equations included
    (jits, custom rules, Pallas kernels): where a pass lands depends on the jax version and the device."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def random_operands(seed: int, x_shape, w_shape, dy_shape, scales=(1, 1, 1), dtype=jnp.float32):
    """(x, w, dy): standard normal draws from jax.random.split(key(seed), 3), each times its scale."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = (x_shape, w_shape, dy_shape)
    draws = (jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes, strict=True))
    return tuple(a if s == 1 else s * a for a, s in zip(draws, scales, strict=True))


def benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module, with benchmarks/ on sys.path as when the script runs (its
    harness and the scripts it imports beside it)."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def module_name(path: pathlib.Path) -> str:
    """The dotted module name of a .py file in the repository (a package's __init__: the package)."""
    parts = pathlib.Path(path).resolve().relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
