#!/usr/bin/env bash
# moe_train_check.sh GPU_COUNT_BIN MOE_TRAIN_BIN: moe_train over all local GPUs learns (the loss
# falls by more than a quarter) and a run resumed from a checkpoint continues with the
# same losses as one that never stopped; in capacity mode it learns too and its JSON reports each
# logged interval's share of dropped slots; with a gated shared expert it learns, its checkpoint
# holds the shared weights' AdamW moments (nonzero: they were trained), and a resumed run again
# continues the straight one. Exits 77 (ctest: skipped) without a GPU.
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
train --steps 30 --capacity-factor 1.0 --json "$dir/capacity.json" | tee "$dir/capacity.txt"
shared=(--config "$(dirname "$0")/../../configs/small-shared.yaml")
train "${shared[@]}" --steps 60 | tee "$dir/shared_straight.txt"
train "${shared[@]}" --steps 30 --save "$dir/shared.safetensors" >"$dir/shared_first.txt"
train "${shared[@]}" --steps 30 --load "$dir/shared.safetensors" | tee "$dir/shared_resumed.txt"

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

import json
report = json.load(open(f"{d}/capacity.json"))
assert report["capacity_factor"] == 1.0, report["capacity_factor"]
log = report["log"]
fractions = [entry["dropped_fraction"] for entry in log]
assert all(0.0 <= f < 0.5 for f in fractions), fractions
assert any(f > 0.0 for f in fractions), f"capacity 1.0 dropped nothing: {fractions}"
assert log[-1]["mse"] < log[0]["mse"], "capacity mode did not learn"
print(f"capacity 1.0: dropped {min(fractions):.2%}-{max(fractions):.2%} of the slots per interval")

straight, resumed = losses("shared_straight.txt"), losses("shared_resumed.txt")
assert straight[60] < 0.75 * straight[1], f"shared experts: loss {straight[1]} -> {straight[60]}"
for step in range(31, 61):
    a, b = straight[step], resumed[step]
    assert abs(a - b) <= 1e-4 * abs(a), f"shared experts, step {step}: resumed {b} vs straight {a}"
import array
import struct
with open(f"{d}/shared.safetensors", "rb") as f:
    header_bytes, = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_bytes))
    data = f.read()
for name in ("shared_w13", "shared_w2", "shared_gate_weight"):
    entry = header[f"layers.0.{name}.exp_avg"]
    assert entry["dtype"] == "F32", entry
    begin, end = entry["data_offsets"]
    moments = array.array("f", data[begin:end])
    nonzero = sum(1 for m in moments if m != 0.0)
    assert nonzero > len(moments) // 2, f"{name}: {nonzero} of {len(moments)} moments nonzero"
print("shared experts: learn, resume the straight run, and their AdamW moments are nonzero")
PY
