#!/usr/bin/env bash
# Where does the fp8 back end's compile time go on a GPU? Each step has a hard timeout; whole probe < 4 min.
#
#   bash benchmarks/gpu_probe_fp8.sh            (logs under $OUT if set, else ./gpu_probe_fp8_logs)
#
# 1. benchmarks/bench_fold.py at one shape with XLA's default flags: compile seconds and TFLOP/s of the
#    plain FP8 dots (precise and fast accumulation), the pre-folded fp8 GEMMs and the fp8 back end's layer.
# 2. The same with XLA_FLAGS+=--xla_gpu_enable_triton_gemm=false (no Triton GEMM autotuning: cuBLASLt).
# 3. python -m fp4jax.selfcheck (fp8 and emulate, no training) with whichever flags compiled the fp8
#    layer faster (a step that timed out counts as slowest).
# STEP_TIMEOUT (seconds, default 75) bounds steps 1 and 2; SELFCHECK_TIMEOUT (default 70) step 3.
set -u
cd "$(dirname "$0")/.." || exit 1
logs="${OUT:-gpu_probe_fp8_logs}"
mkdir -p "$logs"
step_timeout="${STEP_TIMEOUT:-75}"
selfcheck_timeout="${SELFCHECK_TIMEOUT:-70}"
shape="${SHAPE:-16384x4096x14336}"
base_flags="${XLA_FLAGS:-}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

with_flags() {  # extra XLA flags, then the command: runs it with XLA_FLAGS = base + extra (unset if empty)
  local flags="${base_flags:+$base_flags }$1"
  shift
  if [ -n "$flags" ]; then XLA_FLAGS="$flags" "$@"; else env -u XLA_FLAGS "$@"; fi
}

bench() {  # name, extra XLA flags
  local name="$1" extra="$2" log="$logs/bench_fold_$1.log"
  echo "=== bench_fold ($name: extra XLA flags '$extra'), timeout ${step_timeout} s"
  with_flags "$extra" timeout -k 5 "$step_timeout" python benchmarks/bench_fold.py \
    --shapes "$shape" --recipes mxfp4_full_h16 --iters 5 --skip-checks \
    --only "xla fp8 dot,pre-folded,fp8 fwd+bwd" >"$log" 2>&1
  local rc=$?
  grep -E "compile |TFLOP/s" "$log" | grep -v '^|' || true
  echo "rc=$rc"
  # compile seconds of the fp8 back end's layer, or 9999 if it never got there
  local secs
  secs=$(grep -E "^[0-9x]+ +mx_dot .* fp8 fwd\+bwd" "$log" | sed -E 's/.*compile +([0-9.]+) s.*/\1/' | head -1)
  echo "${secs:-9999}" >"$logs/fp8_layer_compile_$name.txt"
}

bench default ""
bench triton_gemm_off "--xla_gpu_enable_triton_gemm=false"

default_s=$(cat "$logs/fp8_layer_compile_default.txt")
off_s=$(cat "$logs/fp8_layer_compile_triton_gemm_off.txt")
if awk -v a="$off_s" -v b="$default_s" 'BEGIN { exit !(a < b) }'; then
  better="--xla_gpu_enable_triton_gemm=false"
else
  better=""
fi
echo "fp8 layer compile: default ${default_s} s, triton GEMM off ${off_s} s -> selfcheck with extra flags '$better'"

echo "=== selfcheck (fp8, emulate; --small, no training), timeout ${selfcheck_timeout} s"
with_flags "$better" timeout -k 5 "$selfcheck_timeout" python -m fp4jax.selfcheck \
  --backends fp8,emulate --train-steps 0 --small >"$logs/selfcheck.log" 2>&1
rc=$?
cat "$logs/selfcheck.log"
echo "selfcheck rc=$rc"
