"""The README's Python examples run as written (the quantized matmul, linen and NNX styles)."""

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_the_examples():
    blocks = _python_blocks(README.read_text())
    assert blocks, "README.md lost its ```python examples"
    code = "\n".join(blocks)
    for name in ("mx_dot.mx_dot_general", "mx_dot.QuantDotGeneral", "mx_dot.NnxQuantDotGeneral"):
        assert name in code, name


@pytest.fixture
def quick_compiles():
    """XLA without most of its optimisations: the examples run eagerly, op by op, and each of their few
    hundred ops is compiled on its own (most of the test's time). What is checked here is that the code
    runs as written; the numerics of the same calls are tested, optimised, elsewhere."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.parametrize("index", range(len(_python_blocks(README.read_text()))))
def test_readme_python_block_runs(index, quick_compiles):
    namespace = {}
    code = _python_blocks(README.read_text())[index]
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    arrays = [v for v in namespace.values() if isinstance(v, jax.Array)]
    assert all(bool(jax.numpy.isfinite(a).all()) for a in arrays)
    if "y" in namespace:  # the last product the example computed
        assert namespace["y"].shape == (8, 128)
