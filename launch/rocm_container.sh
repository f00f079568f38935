#!/usr/bin/env bash
# Runs a command in a ROCm JAX container on an AMD Instinct (MI355X, gfx950) node, with this repository
# mounted at /workspace/fp4jax and the data directory at /data.
#
#   launch/rocm_container.sh python -m fp4jax.selfcheck            # the first thing to run on a new node
#   DATA_DIR=/mnt/c4 launch/rocm_container.sh launch/single_node.sh configs/llama8b_c4_h16.py \
#       --config.data.path=/data/en
#   launch/rocm_container.sh --dry-run python -m fp4jax.selfcheck  # print the docker command only
#
# NOT RUN by the developers (no AMD GPU was available): the flags follow AMD's "Running ROCm Docker
# containers" guide. IMAGE must carry jax >= 0.10 with the ROCm 7 PJRT plugin (what `pip install
# "jax[rocm7-local]"` installs; docs/rocm.md); pin a tag you have tested, `latest` moves. fp4jax is
# installed with --no-deps so that the image's ROCm jaxlib is kept.
set -euo pipefail

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
image=${IMAGE:-rocm/jax:latest}
data_dir=${DATA_DIR:-/data}
cmd=${*:-bash}

docker_cmd=(docker run --rm -it
  --device=/dev/kfd --device=/dev/dri --group-add video
  --security-opt seccomp=unconfined --cap-add=SYS_PTRACE
  --ipc=host --network=host --shm-size=64g --ulimit memlock=-1 --ulimit stack=67108864
  -v "$repo":/workspace/fp4jax -v "$data_dir":/data
  -e FP4JAX_CACHE=/data/fp4jax_cache -e XLA_FLAGS="${XLA_FLAGS:-}"
  -e FP4JAX_GEMM_BACKEND="${FP4JAX_GEMM_BACKEND:-}"
  -w /workspace/fp4jax
  "$image"
  bash -lc "pip install -q --no-deps -e . && pip install -q ml_collections optax flax orbax-checkpoint tiktoken tqdm tensorboardX && $cmd")
if [ "$dry_run" = 1 ]; then
  printf 'would run:'
  printf ' %q' "${docker_cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${docker_cmd[@]}"
