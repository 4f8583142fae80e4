#!/usr/bin/env bash
# moe_run_mesh.sh GPU_COUNT_BIN TOOL_BIN MOE_RUN_BIN: moe_run over all local GPUs (EP = GPUs)
# equals moe_run --reference on the same files. Exits 77 (ctest: skipped) without a GPU.
set -euo pipefail
count_bin=$1 tool=$2 moe_run=$3
source "$(dirname "$0")/gpu_script.sh"
require_gpus "$count_bin" "moe_run on GPUs"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$tool" make "$dir" "$RANDOM$RANDOM"
files=(--config "$dir/config.yaml" --weights "$dir/weights.safetensors" --inputs "$dir/inputs.safetensors")
"$moe_run" --reference "${files[@]}" --out "$dir/reference.safetensors"
mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" --out "$dir/gpu.safetensors" --ep "$gpus"
"$tool" compare "$dir/gpu.safetensors" "$dir/reference.safetensors" 1e-5
