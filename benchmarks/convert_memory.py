"""Peak host memory of `python -m fp4jax.convert` (from-hf, then to-hf) at the 8B model's tensor shapes.

    python benchmarks/convert_memory.py --layers 2 --workdir /tmp/convert_memory

Writes a random bf16 Hugging Face directory of the "8b" model cut to --layers layers (every tensor has its
8B shape: vocabulary 128,256, d_model 4,096, d_ff 14,336, 32 heads, 8 kv heads), then runs from-hf and
to-hf (bf16) each in a process of its own on the CPU and prints its peak resident memory (the process's
own getrusage ru_maxrss), next to a process that only imports fp4jax and starts jax's CPU backend, and to
the float32 bytes of the params. On the CPU the params' device memory is host memory, so from-hf's peak
holds the placed float32 params themselves; what the host holds on top of them (peak - baseline - params)
is what it holds beside the devices' params on a GPU host. Run it at two depths: the difference is what
one more layer costs. The workdir's directories are removed at the end unless --keep.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

# The measured processes print their own peak RSS last, after the command ran (its exit code too): Linux's
# VmHWM, the high-water mark of this program's memory (getrusage's ru_maxrss would include the parent's
# memory at the fork).
PEAK = "[int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]"
CHILD = (
    "import runpy, sys; sys.argv = ['fp4jax.convert', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('fp4jax.convert', run_name='__main__', alter_sys=True); code = 0\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    f"print('peak_rss_kb', {PEAK}, 'exit', code)"
)
BASELINE = (
    "import jax, fp4jax.convert; jax.numpy.zeros(1).block_until_ready(); "
    f"print('peak_rss_kb', {PEAK}, 'exit', 0)"
)


def write_random_hf(directory: str, layers: int) -> tuple[int, int]:
    """A random bf16 Hugging Face directory of 8b with `layers` layers; (float32 bytes of all params, of
    the largest tensor)."""
    from fp4jax.interop import hf_llama
    from fp4jax.models.llama import llama_config

    cfg = llama_config("8b", n_layers=layers)
    rng = np.random.default_rng(0)
    sizes = []

    def tensors():
        for leaf in hf_llama.leaves(cfg):
            for name in leaf.names:
                shape = hf_llama.hf_shape(leaf.layer_shape, leaf.n_in)
                sizes.append(4 * int(np.prod(shape)))
                yield name, (rng.standard_normal(shape, dtype=np.float32) * 0.02)

    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_llama.hf_config(cfg, "bfloat16"), f)
    hf_llama.write_safetensors(directory, tensors(), "bfloat16", int(5e9))
    return sum(sizes), max(sizes)


def peak_rss_gb(code: str, *args: str) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or [""])[-1].split()
    if len(last) != 4 or last[0] != "peak_rss_kb" or last[3] != "0":
        raise SystemExit(f"the measured process failed:\n{done.stdout}\n{done.stderr}")
    print(
        done.stdout.strip().splitlines()[-2] if len(done.stdout.strip().splitlines()) > 1 else "", flush=True
    )
    return int(last[1]) * 1024 / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    root = os.path.abspath(args.workdir)
    hf, ckpt, back = (os.path.join(root, n) for n in ("hf", "ckpt", "back"))
    for path in (hf, ckpt, back):
        shutil.rmtree(path, ignore_errors=True)
    params, largest = (n / 1e9 for n in write_random_hf(hf, args.layers))
    baseline = peak_rss_gb(BASELINE)
    imported = peak_rss_gb(CHILD, "from-hf", "--hf", hf, "--out", ckpt)
    exported = peak_rss_gb(CHILD, "to-hf", "--ckpt", ckpt, "--out", back)
    print(
        f"8b shapes, {args.layers} layers: float32 params {params:.2f} GB, largest tensor "
        f"{largest:.2f} GB; peak RSS: baseline {baseline:.2f} GB, from-hf {imported:.2f} GB "
        f"(beside the params {imported - baseline - params:.2f} GB), to-hf {exported:.2f} GB"
    )
    if not args.keep:
        for path in (hf, ckpt, back):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
