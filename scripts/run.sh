#!/usr/bin/env bash
# Installs what is missing, builds, and runs moe_bench on all local GPUs (one MPI rank per GPU).
# Arguments go to moe_bench (e.g. --config configs/deepseek-v3.yaml). Needs at least one GPU.
set -euo pipefail
source "$(dirname "$0")/common.sh"
moe_install_deps
moe_build
gpus=$("$MOE_BUILD_DIR/tests/moe_gpu_count")
if [ "$gpus" -eq 0 ]; then
  echo "No CUDA GPU on this machine: moe_bench needs at least one. (scripts/test.sh runs the CPU tests.)" >&2
  exit 1
fi
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
exec mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$MOE_BUILD_DIR/apps/moe_bench" "$@"
