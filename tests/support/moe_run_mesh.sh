#!/usr/bin/env bash
# moe_run_mesh.sh GPU_COUNT_BIN TOOL_BIN MOE_RUN_BIN: moe_run over all local GPUs (EP = GPUs)
# equals moe_run --reference on the same files: the plain layer, a replayed routing with an uneven
# tokens_per_rank, and shared experts. Each rank reads its share of the files and rank 0 writes
# the one results file. The plain layer's routing, recorded on the mesh (--record-routing), then
# replayed there (--replay-routing) gives the mesh's results again bit for bit, and the reference
# replaying it equals them; on an even count of GPUs the same again on an EP × DP 2 mesh. Exits 77
# (ctest: skipped) without a GPU.
set -euo pipefail
count_bin=$1 tool=$2 moe_run=$3
source "$(dirname "$0")/gpu_script.sh"
require_gpus "$count_bin" "moe_run on GPUs"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for variant in plain replay shared; do
  echo "== $variant"
  "$tool" make "$dir" "$RANDOM$RANDOM" "$variant" "$gpus"
  files=(--config "$dir/config.yaml" --weights "$dir/weights.safetensors" --inputs "$dir/inputs.safetensors")
  "$moe_run" --reference "${files[@]}" --out "$dir/reference.safetensors"
  record=()
  [ "$variant" = plain ] && record=(--record-routing "$dir/routing.safetensors")
  if ! mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" \
      --out "$dir/gpu.safetensors" --ep "$gpus" "${record[@]}" 2>"$dir/stderr.txt"; then
    cat "$dir/stderr.txt" >&2
    exit 1
  fi
  cat "$dir/stderr.txt" >&2
  "$tool" compare "$dir/gpu.safetensors" "$dir/reference.safetensors" 1e-5
  if [ "$variant" = plain ]; then
    echo "== plain, its recorded routing replayed"
    mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" \
      --out "$dir/replayed.safetensors" --ep "$gpus" --replay-routing "$dir/routing.safetensors"
    "$tool" compare "$dir/replayed.safetensors" "$dir/gpu.safetensors" 0
    "$moe_run" --reference "${files[@]}" --out "$dir/reference_replayed.safetensors" \
      --replay-routing "$dir/routing.safetensors"
    "$tool" compare "$dir/replayed.safetensors" "$dir/reference_replayed.safetensors" 1e-5
    if [ $((gpus % 2)) -eq 0 ]; then
      ep=$((gpus / 2))
      echo "== plain on EP $ep x DP 2: recorded, then replayed"
      mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" \
        --out "$dir/dp.safetensors" --ep "$ep" --dp 2 \
        --record-routing "$dir/routing_dp.safetensors"
      "$tool" compare "$dir/dp.safetensors" "$dir/reference.safetensors" 1e-5
      mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_run" "${files[@]}" \
        --out "$dir/dp_replayed.safetensors" --ep "$ep" --dp 2 \
        --replay-routing "$dir/routing_dp.safetensors"
      "$tool" compare "$dir/dp_replayed.safetensors" "$dir/dp.safetensors" 0
      "$moe_run" --reference "${files[@]}" --out "$dir/reference_replayed_dp.safetensors" \
        --replay-routing "$dir/routing_dp.safetensors"
      "$tool" compare "$dir/dp_replayed.safetensors" "$dir/reference_replayed_dp.safetensors" 1e-5
    fi
  fi
done
