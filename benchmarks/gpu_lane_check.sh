#!/usr/bin/env bash
# The GPU lane's most GPU-sensitive tests and the two GPU probes, each under a hard timeout (< 7 min).
#
#   bash benchmarks/gpu_lane_check.sh        (one NVIDIA GPU; logs under $OUT if set, else ./gpu_lane_logs)
#
# 1. pytest: test_backends (auto = fp8 on Hopper, FP8 accumulation promoted to float32), test_fold,
#    the rotation-spelling test, the configs subprocess, shellcheck, test_mx_dot's preset references
#    (the FP8 accumulation bound), the three diagnostics tests that compile the operand capture, the
#    Pallas flash attention (the deterministic runs' kernel), the 6-bit packing, and NVFP4's quantizer
#    and GEMMs against their references (XLA:GPU folded a float32 -> E4M3 -> float32 rounding away there,
#    which no CPU run shows: docs/numerics.md, "Widening a rounded value on GPUs"), and the compiled
#    fused quantizer kernels (every MX element, both outputs) in the GEMMs' wiring.
# 2. benchmarks/gpu_repro_diagnostics.py: which construct trips XLA when compiling the capture.
# 3. benchmarks/gpu_probe_fp8.sh (short steps): compile time of the fp8 back end, Triton GEMM on / off.
set -u
cd "$(dirname "$0")/.." || exit 1
logs="${OUT:-gpu_lane_logs}"
mkdir -p "$logs"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0

echo "=== pytest (timeout 260 s)"
timeout -k 5 260 python -m pytest -p no:cacheprovider -rs -q \
  tests/test_backends.py tests/test_fold.py \
  tests/test_fused_quantize.py::test_rotation_spellings_give_the_same_bits \
  tests/test_configs.py::test_configs_import_from_anywhere_without_sys_path_edits \
  tests/test_launch.py::test_shellcheck_clean \
  "tests/test_mx_dot.py::test_preset_matches_reference" \
  tests/test_diagnostics.py::test_capture_matches_the_models_own_gradients \
  tests/test_diagnostics.py::test_probe_runs_under_jit_and_returns_finite_scalars \
  tests/test_diagnostics.py::test_cli_writes_table_json_and_plot \
  tests/test_llama.py::test_pallas_attention_matches_naive_and_xla_gradients \
  tests/test_packing.py tests/test_nvfp4.py tests/test_exact_division.py \
  tests/test_formats_nvfp4_gemm.py::test_presets_forward_and_gradients_match_the_reference \
  tests/test_fused_quantize.py::test_compiled_pallas_matches_reference_on_hard_inputs \
  tests/test_gemm_operands.py::test_pallas_wiring_gives_the_reference_products \
  >"$logs/pytest.log" 2>&1
rc=$?; echo "pytest rc=$rc"; [ "$rc" = 0 ] || status=1
grep -E "passed|failed|error|^FAILED|^ERROR|^SKIPPED" "$logs/pytest.log" | tail -40

echo "=== gpu_repro_diagnostics (timeout 85 s)"
timeout -k 5 85 python benchmarks/gpu_repro_diagnostics.py >"$logs/gpu_repro_diagnostics.log" 2>&1
rc=$?; echo "repro rc=$rc"
grep -vE "^\s" "$logs/gpu_repro_diagnostics.log" | head -30

echo "=== gpu_probe_fp8 (steps of 40 s, selfcheck 35 s)"
OUT="$logs/probe" STEP_TIMEOUT=40 SELFCHECK_TIMEOUT=35 SHAPE=8192x4096x8192 bash benchmarks/gpu_probe_fp8.sh \
  2>&1 | tee "$logs/gpu_probe_fp8.log"

echo "logs in $logs; overall pytest status $status"
exit "$status"
