"""benchmarks/hlo_fusions.py on a real XLA dump of a small program (CPU): a kernel name finds its fusion."""

import os
import subprocess
import sys

from helpers import benchmark_script
from tiny_runs import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
hf = benchmark_script("hlo_fusions")

MODULE = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->bf16[4]{0}}

%fused_computation.1 (param_0.5: f32[4]) -> bf16[4] {
  %param_0.5 = f32[4]{0} parameter(0)
  %sine.0 = f32[4]{0} sine(%param_0.5)
  ROOT %convert.1 = bf16[4]{0} convert(%sine.0)
}

ENTRY %main.3 (x.1: f32[4]) -> bf16[4] {
  %x.1 = f32[4]{0} parameter(0)
  ROOT %loop_convert_fusion.31 = bf16[4]{0} fusion(%x.1), kind=kLoop, calls=%fused_computation.1
}
"""


def test_a_kernel_name_finds_its_instruction_and_body():
    text = hf.describe(MODULE, ["loop_convert_fusion_31", "no_such_kernel"], chars=4000)
    assert "ROOT %loop_convert_fusion.31 = bf16[4]{0} fusion(%x.1)" in text
    assert "`fused_computation.1`:" in text and "%sine.0 = f32[4]{0} sine(%param_0.5)" in text
    assert "## no_such_kernel\n\nnot in this module" in text
    assert set(hf.computations(MODULE)) == {"fused_computation.1", "main.3"}


def test_reads_the_dump_of_a_compiled_program(tmp_path):
    """XLA's own dump of a jitted function (the CPU back end's names), through the command line."""
    dump = tmp_path / "dump"
    program = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x).astype(jnp.bfloat16))(jnp.ones(8))"
    env = subprocess_env(ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    path = hf.optimized_module(str(dump), "lambda")
    with open(path) as f:
        text = f.read()
    name = next(n for n in hf.computations(text) if "fus" in n)  # a fused computation of the dump
    caller = next(line for line in text.splitlines() if f"calls=%{name}" in line)
    kernel = caller.split("=")[0].strip().removeprefix("ROOT ").lstrip("%")
    out = subprocess.run(
        [sys.executable, "benchmarks/hlo_fusions.py", str(dump), kernel, "--module", "lambda"],
        cwd=ROOT,
        env=subprocess_env(ROOT),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert f"## {kernel}" in out and f"`{name}`:" in out and "sine" in out
