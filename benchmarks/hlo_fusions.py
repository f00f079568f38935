"""What a profiled kernel computes: its fusion in the optimized HLO that XLA dumped for the same program.

    XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text" python -m fp4jax.train ...   (same config and
        flags as the profiled run: the dump flags do not change what XLA compiles)
    python benchmarks/hlo_fusions.py DUMP loop_convert_fusion_31 wrapped_convert_1 [--module train_step]

A kernel name from kernel_breakdown.py is an HLO instruction name, the last `.N` written `_N`. The tool
reads the largest `*after_optimizations.txt` whose name contains `--module` (the train step, by default
the largest of all) and prints, for each name, the instruction (its output types and operands) and the
body of every computation it calls, cut at `--chars`.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import harness  # benchmarks/harness.py (this folder is on sys.path when run as a script)


def optimized_module(folder: str, module: str = "") -> str:
    """The path of the largest after-optimizations HLO text under `folder` whose name holds `module`."""
    paths = [p for p in glob.glob(os.path.join(folder, "*after_optimizations.txt")) if module in p]
    if not paths:
        which = f" with {module!r} in its name" if module else ""
        raise SystemExit(f"error: no *after_optimizations.txt{which} in {folder}; dump with --xla_dump_to")
    return max(paths, key=os.path.getsize)


def computations(text: str) -> dict[str, str]:
    """{computation name: its body} of an HLO module's text."""
    pattern = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", re.S | re.M)
    return {m.group(1): m.group(2) for m in pattern.finditer(text)}


def find_instruction(text: str, kernel: str) -> str | None:
    """The line defining `kernel`'s instruction: named as given, or with its last `_N` as `.N`."""
    names = {kernel, re.sub(r"_(\d+)$", r".\1", kernel)}
    alternatives = "|".join(re.escape(n) for n in names)
    match = re.search(rf"^\s*(?:ROOT )?%?(?:{alternatives}) = [^\n]*", text, re.M)
    return match.group(0).strip() if match else None


def describe(text: str, kernels: list[str], chars: int) -> str:
    bodies = computations(text)
    out = []
    for kernel in kernels:
        line = find_instruction(text, kernel)
        out.append(f"## {kernel}\n")
        if line is None:
            out.append("not in this module\n")
            continue
        out.append(f"```\n{line[:chars]}\n```\n")
        for called in re.findall(r"calls=%?([\w.\-]+)", line):
            body = bodies.get(called, "(not found)")
            out.append(f"`{called}`:\n```\n{body[:chars].rstrip()}\n```\n")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the --xla_dump_to folder")
    parser.add_argument("kernels", nargs="+", help="kernel names as the profile shows them")
    parser.add_argument("--module", default="", help="part of the module's file name, e.g. train_step")
    parser.add_argument("--chars", type=int, default=4000, help="cut each instruction and body here")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    path = optimized_module(args.folder, args.module)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    report = f"Module `{os.path.basename(path)}`\n\n" + describe(text, args.kernels, args.chars)
    harness.emit(report, args.out)


if __name__ == "__main__":
    main()
