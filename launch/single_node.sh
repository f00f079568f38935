#!/usr/bin/env bash
# One node, all of its GPUs, one process: `python -m fp4jax.train` with XLA settings for multi-GPU FSDP.
#
#   launch/single_node.sh [--dry-run] CONFIG [--config.KEY=VALUE ...]
#   WORKDIR=runs/h16_try2 launch/single_node.sh configs/llama8b_c4_h16.py
#   FP4JAX_GEMM_BACKEND=emulate launch/single_node.sh ...   # override the GEMM back end `auto` picks
#
# --dry-run prints the environment and the command that would run, and runs nothing (not even python).
# Also the per-node command under SLURM (launch/slurm.sbatch). Each XLA flag is checked at run time: XLA
# aborts on a flag it does not know, so a flag the installed jaxlib rejects is dropped with a warning.
# NOT RUN on MI355X by the developers; the ROCm settings are AMD's documented defaults for JAX training.
set -euo pipefail

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
config=${1:?usage: launch/single_node.sh [--dry-run] CONFIG [--config.KEY=VALUE ...]}
shift
workdir=${WORKDIR:-runs/$(basename "$config" .py)}
python=${PYTHON:-python}

# Overlap FSDP all-gathers / reduce-scatters with compute.
wanted=(--xla_gpu_enable_latency_hiding_scheduler=true)
if [ -e /dev/kfd ] || [ "${FP4JAX_ASSUME_ROCM:-0}" = 1 ]; then  # ROCm
  export HIP_FORCE_DEV_KERNARG=1          # kernel arguments in device memory: lower launch latency
  export NCCL_MIN_NCHANNELS=${NCCL_MIN_NCHANNELS:-112}  # RCCL reads NCCL_*: more channels on MI300/MI355 xGMI
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

flags="${XLA_FLAGS:-}"
for flag in "${wanted[@]}"; do
  if [ "$dry_run" = 1 ]; then
    flags="$flags $flag"  # not probed in a dry run
  elif XLA_FLAGS="$flags $flag" "$python" -c "import jax; jax.devices()" >/dev/null 2>&1; then
    flags="$flags $flag"
  else
    echo "single_node.sh: this jaxlib rejects XLA flag $flag; running without it" >&2
  fi
done
export XLA_FLAGS="${flags# }"

cmd=("$python" -m fp4jax.train --config "$config" --workdir "$workdir" "$@")
if [ "$dry_run" = 1 ]; then
  echo "single_node.sh: dry run on $(hostname), nothing started"
  for var in XLA_FLAGS XLA_PYTHON_CLIENT_MEM_FRACTION TF_CPP_MIN_LOG_LEVEL HIP_FORCE_DEV_KERNARG \
    NCCL_MIN_NCHANNELS FP4JAX_GEMM_BACKEND SLURM_NTASKS SLURM_PROCID SLURM_JOB_NUM_NODES; do
    if [ -n "${!var:-}" ]; then
      echo "  $var=${!var}"
    fi
  done
  printf 'would run:'
  printf ' %q' "${cmd[@]}"
  printf '\n'
  exit 0
fi
echo "single_node.sh: XLA_FLAGS='$XLA_FLAGS' workdir=$workdir" >&2
exec "${cmd[@]}"
