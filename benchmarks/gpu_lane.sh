#!/usr/bin/env bash
# The GPU lane in shards: the whole suite (-m "", both CPU-side lanes) on one NVIDIA GPU, the K-th of N
# shards per call, each test's name printed as it ends and each test under a timeout of its own.
#
#   bash benchmarks/gpu_lane.sh --shard K/N [--dry-run] [-- extra pytest arguments]
#
# The N shards together run every collected test exactly once (tests/shards.py, checked by
# tests/test_gpu_lane.py). Log: $OUT/gpu_lane_shard_K_of_N.log if OUT is set, else under ./gpu_lane_logs;
# beside it, gpu_lane_shard_K_of_N.seconds holds each test phase's seconds as it ends (--seconds-log, so a
# shard cut short keeps them), from which `python tests/shards.py seconds` writes the file that balances
# the shards. --dry-run only collects the shard and lists it (any machine: the CPU
# there where no NVIDIA GPU is). Settings: WORKERS (pytest-xdist workers, default 12), TEST_TIMEOUT
# (seconds per test, default 300, pytest-timeout's --timeout), SHARD_TIMEOUT (seconds for the whole
# shard, default 470, so that a cut shard still leaves its log within a 10-minute call), SESSION_TIMEOUT
# (seconds after which no new test starts, default SHARD_TIMEOUT - 90, with pytest-timeout >= 2.3).
set -u
cd "$(dirname "$0")/.." || exit 1

shard="" dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --shard) shard="${2:-}"; shift 2 || { echo "gpu_lane.sh: --shard needs K/N" >&2; exit 2; } ;;
    --shard=*) shard="${1#--shard=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    *) echo "gpu_lane.sh: unknown argument $1 (use --shard K/N [--dry-run] [-- pytest args])" >&2; exit 2 ;;
  esac
done
[ -n "$shard" ] || { echo "gpu_lane.sh: --shard K/N is required, e.g. --shard 1/3" >&2; exit 2; }

has_gpu=0
compgen -G "/dev/nvidia[0-9]*" >/dev/null && has_gpu=1
if [ "$has_gpu" = 1 ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
elif [ "$dry_run" = 1 ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
else
  echo "gpu_lane.sh: no NVIDIA GPU here (no /dev/nvidia0): run it on a GPU machine, or add --dry-run" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's fp4jax, installed or not
export PYTHONUNBUFFERED=1
logs="${OUT:-gpu_lane_logs}"
mkdir -p "$logs"
log="$logs/gpu_lane_shard_${shard/\//_of_}.log"
seconds_log="${log%.log}.seconds"  # each phase's seconds as it ends: a shard cut short keeps its figures
common=(-m "" -p no:cacheprovider -o addopts= --shard "$shard")

if [ "$dry_run" = 1 ]; then
  python -m pytest --collect-only -q "${common[@]}" "$@" tests 2>&1 | tee "$log"
  exit "${PIPESTATUS[0]}"
fi

if ! python -c "import pytest_timeout, xdist" 2>/dev/null; then
  echo "gpu_lane.sh: needs pytest-timeout and pytest-xdist: pip install pytest-timeout pytest-xdist" >&2
  exit 2
fi
# pytest-timeout >= 2.3 ends the session between tests at SESSION_TIMEOUT, so that a shard that would run
# past its limit still prints its failures' tracebacks and counts; the hard limit then stops what is left.
session=()
if python -c 'import importlib.metadata as m, sys; v = m.version("pytest-timeout").split(".")
sys.exit(0 if (int(v[0]), int(v[1])) >= (2, 3) else 1)' 2>/dev/null; then
  session=(--session-timeout "${SESSION_TIMEOUT:-$(( ${SHARD_TIMEOUT:-470} - 90 ))}")
fi
echo "gpu_lane.sh: shard $shard, JAX_PLATFORMS=$JAX_PLATFORMS, ${WORKERS:-12} workers, log $log"
rm -f "$seconds_log"
timeout -k 10 "${SHARD_TIMEOUT:-470}" python -m pytest "${common[@]}" -n "${WORKERS:-12}" --dist worksteal \
  -v -rfEs --timeout "${TEST_TIMEOUT:-300}" "${session[@]}" --seconds-log "$seconds_log" "$@" tests \
  >"$log" 2>&1
rc=$?
[ "$rc" = 124 ] && echo "gpu_lane.sh: shard $shard cut after ${SHARD_TIMEOUT:-470} s (SHARD_TIMEOUT)"
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)|Timeout" "$log" | tail -60
echo "gpu_lane.sh: shard $shard exit $rc; log $log"
exit "$rc"
