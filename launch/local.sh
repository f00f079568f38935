#!/usr/bin/env bash
# Several processes on this machine, as several hosts would run: the command of one process, N copies,
# each with its share of the devices (its GPUs, or fake CPU devices) and its own log file.
#
#   NPROC=2 launch/local.sh [--dry-run] CONFIG [--config.KEY=VALUE ...]
#   NPROC=2 DEVICES_PER_PROCESS=4 WORKDIR=runs/two launch/local.sh configs/tiny_c4_h16.py
#
# Each process runs `python -m fp4jax.train --config CONFIG --workdir WORKDIR ...` with the variables
# jax.distributed reads (a free coordinator port on 127.0.0.1); logs: WORKDIR/logs/process_<i>.log.
# --dry-run prints each process's environment and command and starts nothing. The launcher is
# fp4jax/launch_local.py (python -m fp4jax.launch_local --help); docs/training.md, Several hosts.
set -euo pipefail

dry_run=()
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=(--dry-run)
  shift
fi
config=${1:?usage: NPROC=N launch/local.sh [--dry-run] CONFIG [--config.KEY=VALUE ...]}
shift
workdir=${WORKDIR:-runs/$(basename "$config" .py)}
python=${PYTHON:-python}

exec "$python" -m fp4jax.launch_local "${dry_run[@]}" --processes "${NPROC:-2}" \
  --devices-per-process "${DEVICES_PER_PROCESS:-4}" \
  -- "$python" -m fp4jax.train --config "$config" --workdir "$workdir" "$@"
