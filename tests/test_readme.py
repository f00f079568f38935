"""The README's Python examples run as written (the quantized matmul, linen and NNX styles); the docs'
index names every document, and design.md's Layout every module outside fp4jax.ops' kernels."""

import re
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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


def test_the_docs_index_names_every_document():
    docs = ROOT / "docs"
    index = (docs / "README.md").read_text()
    missing = [p.name for p in docs.glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not name {missing}"


def test_design_layout_names_every_module():
    """Every module of fp4jax/*.py, fp4jax/training/ and fp4jax/study/ is in design.md's Layout block."""
    design = (ROOT / "docs" / "design.md").read_text()
    layout = design.split("## Layout", 1)[1].split("```")[1]
    package = ROOT / "fp4jax"
    modules = [*package.glob("*.py"), *(package / "training").glob("*.py"), *(package / "study").glob("*.py")]
    named = {Path(name).name for name in re.findall(r"[\w/]+\.py", layout)}
    missing = [
        str(m.relative_to(package))
        for m in modules
        if m.name not in ("__init__.py", "__main__.py") and m.name not in named
    ]
    assert not missing, f"design.md's Layout does not name {missing}"


def test_the_repository_stays_light():
    """A clone carries under 10 MB: the library, its docs and reports under 7.5 MB, and the runs' records
    compressed (records/*.tar.xz; about 19 KB a run of 1,000 updates since metrics.jsonl is archived slim,
    45 KB before) under 2.5 MB. The records grow with every stage run, the rest must not: 2.5 MB leaves
    room for about fifty such runs above the 1.5 MB of 2026-12-07 (the limit was 5 MB while the records
    were 3.6 MB). Run logs and checkpoints belong in records/ or outside the repository, never in docs/."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    sizes = {f: f.stat().st_size for f in files if f.is_file()}
    records = sum(size for f, size in sizes.items() if f.relative_to(ROOT).parts[0] == "records")
    rest = sum(sizes.values()) - records
    assert rest < 7_500_000, f"tracked files outside records/ hold {rest:,} bytes; compress or move what grew"
    assert records < 2_500_000, f"records/ holds {records:,} bytes; pack with xz or move old stages out"
    assert rest + records < 10_000_000, f"tracked files hold {rest + records:,} bytes"
    assert not [f for f in files if "docs/results" in f.as_posix() and f.name == "metrics.jsonl"]
