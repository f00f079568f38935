"""The shape of fp4jax.ops: one public face, no import circle, no module state, no environment.

- `fp4jax.ops.__all__` is the list docs/api.md documents, name for name, and every name resolves.
- Every module under fp4jax/ops declares `__all__`, and every name in it exists.
- Outside fp4jax/ops, what is imported from fp4jax.ops itself is public (its `__all__`); internal names
  are imported from their own modules.
- The modules of fp4jax import each other without a circle (module-level imports, the ones that run
  at import time).
- mx_dot_general traces to the same program whatever FP4JAX_GEMM_BACKEND and FP4JAX_QUANTIZE_IMPL say:
  the library reads no environment variable (the trainer's set-up does, training.setup).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import module_name

import fp4jax.ops
from fp4jax.ops import get_recipe, mx_dot_general

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp4jax"


@pytest.mark.parametrize("path", sorted((PACKAGE / "ops").rglob("*.py")), ids=lambda p: p.name)
def test_every_ops_module_declares_all_and_it_is_true(path):
    module = importlib.import_module(module_name(path))
    assert hasattr(module, "__all__"), f"{path.relative_to(ROOT)} has no __all__"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{path.relative_to(ROOT)}: __all__ names {missing} that do not exist"


def _imports_from_the_face(path: pathlib.Path) -> set[str]:
    """The names a file imports as `from fp4jax.ops import name` that are not submodules of fp4jax.ops."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fp4jax.ops":
            names |= {a.name for a in node.names if not (PACKAGE / "ops" / f"{a.name}.py").exists()}
    return names


def test_what_is_imported_from_the_face_is_public():
    """Outside fp4jax/ops, `from fp4jax.ops import x` takes public names only (fp4jax.ops.__all__); what
    the trainer, the study, the tools and the benchmarks use from inside is imported from its own
    module (fp4jax.ops.kernels.probes, fp4jax.ops.quantized_dot, ...), so that it reads as internal."""
    files = [p for p in PACKAGE.rglob("*.py") if "ops" not in p.relative_to(PACKAGE).parts[:1]]
    files += sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    offenders = {
        str(p.relative_to(ROOT)): sorted(names - set(fp4jax.ops.__all__))
        for p in files
        if (names := _imports_from_the_face(p))
    }
    assert not {k: v for k, v in offenders.items() if v}


def _program(recipe, x, w, dy) -> str:
    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe), x, w)
        return (y, *vjp(dy))

    return str(jax.make_jaxpr(layer)(x, w, dy))


@pytest.mark.parametrize("recipe", ["mxfp4_full_h16", "fp8", "mxfp8"])
def test_the_library_reads_no_environment_variable_while_tracing(recipe, monkeypatch):
    x = jnp.zeros((64, 128), jnp.bfloat16)
    w = jnp.zeros((128, 64), jnp.bfloat16)
    dy = jnp.zeros((64, 64), jnp.bfloat16)
    want = _program(get_recipe(recipe), x, w, dy)
    for value in ("xla", "reference", "fp8", "native", "bogus"):
        monkeypatch.setenv("FP4JAX_GEMM_BACKEND", value)
        monkeypatch.setenv("FP4JAX_QUANTIZE_IMPL", value)
        assert _program(get_recipe(recipe), x, w, dy) == want, value
    # and the recipe's own fields do change it (the test can fail)
    if recipe == "mxfp4_full_h16":
        xla = dataclasses.replace(get_recipe(recipe), quantizer="xla")
        assert _program(xla, x, w, dy) != want


def _documented_names() -> list[str]:
    """The names docs/api.md's "Public API" section lists, one bullet "- `name`: what it is" each."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([A-Za-z_][A-Za-z0-9_]*)`: \S", section, flags=re.MULTILINE)


def test_the_public_face_is_the_documented_list():
    documented = _documented_names()
    assert len(documented) == len(set(documented)), "docs/api.md lists a name twice"
    assert sorted(documented) == sorted(fp4jax.ops.__all__), (
        f"only documented: {sorted(set(documented) - set(fp4jax.ops.__all__))}, "
        f"only in __all__: {sorted(set(fp4jax.ops.__all__) - set(documented))}"
    )
    assert 25 <= len(documented) <= 35  # a face a model author can hold in mind
    for name in documented:
        assert getattr(fp4jax.ops, name) is not None, name
    namespace = {}
    exec("from fp4jax.ops import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(documented)


def test_the_internal_names_stay_importable_from_their_modules():
    """What the trainer, the tools and the benchmarks use from inside is there, in the module docs/api.md
    names (the face no longer re-exports it)."""
    internal = {
        "fp4jax.ops.quantized_dot": ["quantize_operand", "quantize_gemm_operands", "operand_layouts"],
        "fp4jax.ops.kernels.fused_quantize": ["rotate_quantize", "KernelConfig", "pallas_supports"],
        "fp4jax.ops.kernels.fold": ["fold_mx_to_fp8", "is_foldable", "count_fold_flushes", "FoldedOperand"],
        "fp4jax.ops.kernels.backends": ["fp8_matmul", "fp8_unfolded", "matmul"],
        "fp4jax.ops.kernels.probes": ["describe_device", "choose_backend", "scaled_in_epilogue"],
        "fp4jax.ops.quantize": ["fp8_amax_history_update", "fp8_scale_from_history", "ldexp_exact"],
        "fp4jax.ops.packing": ["PackedMXArray", "PackedNVFP4Array", "PACKED_BITS"],
        "fp4jax.ops.recipes": ["resolve_recipe"],
    }
    for module, names in internal.items():
        imported = importlib.import_module(module)
        assert set(names) <= set(imported.__all__), module
        assert not set(names) & set(fp4jax.ops.__all__), module


def test_the_public_face_lists_what_models_import():
    from fp4jax.ops import mx_dot

    assert set(mx_dot.__all__) <= set(fp4jax.ops.__all__)
    for name in mx_dot.__all__:
        assert getattr(mx_dot, name) is getattr(fp4jax.ops, name)
