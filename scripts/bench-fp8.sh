#!/usr/bin/env bash
# The layer's step with FP8 expert products against bf16 at the model shapes on one GPU, both at
# one alignment (FP8 needs multiples of 16), dropless. Writes one moe_bench JSON per run to
# OUTDIR and prints a table last.
#   scripts/bench-fp8.sh [--configs "a b"] [--tokens "1024 8192"] OUTDIR
set -uo pipefail
source "$(dirname "$0")/common.sh"

configs="mixtral-8x7b qwen3-30b-a3b deepseek-v3" tokens="8192" out=""
while [ $# -gt 0 ]; do
  case $1 in
    --configs) configs=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    -*) echo "usage: $0 [--configs C] [--tokens T] OUTDIR" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
[ -n "$out" ] || { echo "usage: $0 [options] OUTDIR" >&2; exit 2; }
mkdir -p "$out" || exit 2
bench=$MOE_BUILD_DIR/apps/moe_bench
[ -x "$bench" ] || { echo "error: $bench is not built" >&2; exit 2; }
status=0
for config in $configs; do
  for t in $tokens; do
    for mode in bf16 fp8; do
      name=$config-T$t-$mode
      flags=(--config "$MOE_ROOT/configs/$config.yaml" --tokens "$t" --iters 10 --stage-lead-ms 0
             --align-size 16)
      [ "$mode" = fp8 ] && flags+=(--fp8)
      "$bench" "${flags[@]}" --json "$out/$name.json" >"$out/$name.txt" 2>&1 ||
        { status=1; echo "FAILED: $name"; tail -3 "$out/$name.txt"; }
    done
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    runs[(r["config_file"].removesuffix(".yaml"), r["tokens_per_gpu"], r["fp8"])] = r
print(f"{'config':<16} {'T':>5} {'bf16 ms':>9} {'fp8 ms':>9} {'speedup':>8} {'bf16 experts':>12} "
      f"{'fp8 experts':>11} {'bf16 GiB':>9} {'fp8 GiB':>8}")
for (config, t, fp8), r in sorted(runs.items()):
    if fp8 or (config, t, True) not in runs:
        continue
    f = runs[(config, t, True)]
    experts = lambda run: sum(v for k, v in run["stages_ms"].items() if "experts" in k)
    print(f"{config:<16} {t:>5} {r['total_ms']:>9.3f} {f['total_ms']:>9.3f} "
          f"{r['total_ms'] / f['total_ms']:>7.2f}x {experts(r):>12.3f} {experts(f):>11.3f} "
          f"{r['memory_bytes'] / 2**30:>9.2f} {f['memory_bytes'] / 2**30:>8.2f}")
PY
exit $status
