#!/usr/bin/env bash
# moe_train_check.sh GPU_COUNT_BIN MOE_TRAIN_BIN: moe_train over all local GPUs learns (the loss
# falls by more than a quarter) and a run resumed from a checkpoint continues with the
# same losses as one that never stopped. Exits 77 (ctest: skipped) without a GPU.
set -euo pipefail
count_bin=$1 moe_train=$2
source "$(dirname "$0")/gpu_script.sh"
require_gpus "$count_bin" "moe_train"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
train() { mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$moe_train" --tokens 512 --log-every 1 "$@"; }

train --steps 60 | tee "$dir/straight.txt"
train --steps 30 --save "$dir/ckpt.safetensors" >"$dir/first.txt"
train --steps 30 --load "$dir/ckpt.safetensors" | tee "$dir/resumed.txt"

python3 - "$dir" <<'PY'
import sys
d = sys.argv[1]
def losses(name):
    out = {}
    for line in open(f"{d}/{name}"):
        parts = line.split()
        if parts and parts[0] == "step":
            out[int(parts[1])] = float(parts[3])
    return out
straight, resumed = losses("straight.txt"), losses("resumed.txt")
first, last = straight[1], straight[60]
print(f"loss {first:.6f} -> {last:.6f}")
assert last < 0.75 * first, "the loss did not fall by a quarter"
for step in range(31, 61):
    a, b = straight[step], resumed[step]
    assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: resumed {b} vs straight {a}"
print("resumed run matches the straight run over steps 31-60")
PY
