#!/usr/bin/env bash
# mpi_launch.sh RANKS GPU_COUNT_BIN TEST_BIN [args...]
# Runs TEST_BIN under mpirun with RANKS processes (a number, or "all" for one per local GPU,
# "multi" for one per local GPU where there are two or more (an EP mesh), or "same-gpu" for two
# that both see only the first GPU, to test the mesh's refusal).
# Exits 77 (ctest: skipped) when there is no GPU, or fewer GPUs than RANKS asks for.
set -u
ranks=$1 count_bin=$2 test_bin=$3
shift 3
gpus=$("$count_bin" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -eq 0 ]; then
  echo "SKIPPED: no CUDA GPU visible; mpi tests need at least one."
  exit 77
fi
[ "$ranks" = all ] && ranks=$gpus
if [ "$ranks" = multi ]; then
  [ "$gpus" -ge 2 ] || { echo "SKIPPED: an EP mesh needs 2 GPUs, $gpus visible."; exit 77; }
  ranks=$gpus
fi
if [ "$ranks" = same-gpu ]; then
  ranks=2 gpus=2
  export CUDA_VISIBLE_DEVICES=0
fi
if [ "$ranks" -gt "$gpus" ]; then
  echo "SKIPPED: $ranks ranks asked for, $gpus GPUs visible."
  exit 77
fi
export NCCL_NVLS_ENABLE=0  # never NVLink multicast: it can take a shared host's GPUs down
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
exec mpirun -np "$ranks" --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE ${CUDA_VISIBLE_DEVICES+-x CUDA_VISIBLE_DEVICES} "$test_bin" "$@"
