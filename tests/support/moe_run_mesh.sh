#!/usr/bin/env bash
# moe_run_mesh.sh GPU_COUNT_BIN TOOL_BIN MOE_RUN_BIN: moe_run over all local GPUs (EP = GPUs)
# equals moe_run --reference on the same files. Exits 77 (ctest: skipped) without a GPU.
set -euo pipefail
count_bin=$1 tool=$2 moe_run=$3
gpus=$("$count_bin" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -eq 0 ]; then
  echo "SKIPPED: no CUDA GPU visible; moe_run on GPUs needs at least one."
  exit 77
fi
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$tool" make "$dir" "$RANDOM$RANDOM"
files=(--config "$dir/config.yaml" --weights "$dir/weights.safetensors" --inputs "$dir/inputs.safetensors")
"$moe_run" --reference "${files[@]}" --out "$dir/reference.safetensors"
mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" --out "$dir/gpu.safetensors" --ep "$gpus"
"$tool" compare "$dir/gpu.safetensors" "$dir/reference.safetensors" 1e-5
