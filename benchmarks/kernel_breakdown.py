"""Where a profiled train step spends its GPU time: kernel time by category, from a Perfetto trace.

    python -m fp4jax.train --config configs/llama1b_pg_bf16.py --config.profile.start_step=8 \
        --config.profile.num_steps=3 ...            # writes <workdir>/profile/.../*.trace.json.gz
    python benchmarks/kernel_breakdown.py <workdir>/profile [--steps 3] [--top 15] [--out FILE.md]

Reads every `*.trace.json.gz` under the folder (jax.profiler's Perfetto export), keeps the complete events
("ph": "X") on the GPU device processes, and sums their durations by kernel category. Kernels of one
stream run back to back, so the sum over a stream is its busy time; summed over streams it can exceed
the wall time when streams overlap (collectives beside compute). Categories are matched on the kernel
name, case-insensitively, first rule that matches wins (see CATEGORIES). The last line says how much of
the profiled span no kernel covered (host dispatch between steps, launch latency) and its longest gaps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

import harness  # benchmarks/harness.py (this folder is on sys.path when run as a script)

# (category, pattern searched in the lower-cased kernel name). Order matters: the first rule that matches
# wins. cuBLAS's nvjet kernels spell the operand types as letters after the architecture, A's first:
# q = E4M3, r = E5M2 (t = bf16, s = f32, h = f16), so nvjet_sm90_qrsss_... is an FP8 GEMM and
# nvjet_sm90_tss_... is not.
CATEGORIES = tuple(
    (cat, re.compile(pattern))
    for cat, pattern in (
        ("quantizer (Pallas)", r"fused_rotate_quantize|fused_fold"),  # fused_quantize_pallas's kernels
        ("attention", r"cudnn|flash|fmha|attention"),
        ("fp8 gemm", r"e4m3|e5m2|fp8|f8f8|nvjet_sm\d+a?_[qr]"),
        ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|triton_dot"),
        ("collective", r"nccl|all_reduce|all-gather|reduce_scatter|allreduce"),
        ("memcpy/memset", r"memcpy|memset"),
        ("reduction", r"reduce|reduction"),
        ("elementwise fusion", r"fusion|loop_|input_|convert|wrapped_|triton"),
    )
)


def category(name: str) -> str:
    lower = name.lower()
    return next((cat for cat, pattern in CATEGORIES if pattern.search(lower)), "other")


def load_events(folder: str) -> list[dict]:
    """Complete events of GPU processes from every Perfetto trace under `folder`."""
    paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"error: no *.trace.json.gz under {folder}; profile with create_perfetto_trace")
    events = []
    for path in paths:
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        raw = trace["traceEvents"] if isinstance(trace, dict) else trace
        gpu_pids = {
            e["pid"]
            for e in raw
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and "gpu" in str(e.get("args", {}).get("name", "")).lower()
        }
        events += [e for e in raw if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    return events


def breakdown(events: list[dict]) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """(milliseconds per category, [(kernel, milliseconds, launches)] sorted by time)."""
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_kernel: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        ms = e["dur"] / 1e3  # trace durations are microseconds
        by_cat[category(e["name"])] += ms
        by_kernel[e["name"]][0] += ms
        by_kernel[e["name"]][1] += 1
    kernels = sorted(((k, v[0], v[1]) for k, v in by_kernel.items()), key=lambda r: -r[1])
    return dict(by_cat), kernels


def idle_time(events: list[dict], min_gap_us: float = 100.0) -> tuple[float, float, list[float]]:
    """(wall ms from the first kernel's start to the last one's end, ms with no kernel running on any
    GPU stream, [gaps of at least min_gap_us, in ms, longest first]).

    The idle time is what no kernel covers: host dispatch between steps, waits on the host, launch
    latency. Events without a start time ("ts") are left out.
    """
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if "ts" in e)
    if not spans:
        return 0.0, 0.0, []
    gaps, reach = [], spans[0][1]
    for start, end in spans[1:]:
        if start > reach:
            gaps.append(start - reach)
        reach = max(reach, end)
    wall = reach - spans[0][0]
    long_gaps = sorted((g / 1e3 for g in gaps if g >= min_gap_us), reverse=True)
    return wall / 1e3, sum(gaps) / 1e3, long_gaps


def to_markdown(by_cat, kernels, steps: int, top: int) -> str:
    total = sum(by_cat.values())
    lines = ["| category | ms per step | share |", "|---|---:|---:|"]
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {ms / steps:.2f} | {ms / total:.1%} |")
    lines += ["", "| kernel (top by time) | category | ms per step | launches per step |"]
    lines.append("|---|---|---:|---:|")
    for name, ms, count in kernels[:top]:
        short = name if len(name) <= 80 else name[:77] + "..."
        lines.append(f"| `{short}` | {category(name)} | {ms / steps:.2f} | {count / steps:.0f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps, to report per step")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    events = load_events(args.folder)
    by_cat, kernels = breakdown(events)
    wall, idle, gaps = idle_time(events)
    text = to_markdown(by_cat, kernels, args.steps, args.top)
    text += (
        f"\nGPU timeline: {wall / args.steps:.2f} ms per step from the first kernel to the last, "
        f"{idle / args.steps:.2f} ms of it with no kernel running; gaps of 0.1 ms or more: "
        f"{len(gaps)}, longest {', '.join(f'{g:.2f}' for g in gaps[:8]) or '-'} ms\n"
    )
    harness.emit(text, args.out)


if __name__ == "__main__":
    main()
