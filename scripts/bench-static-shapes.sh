#!/usr/bin/env bash
# Dropless against capacity mode with fixed blocks (pad_to_capacity) at the model shapes on one
# GPU: each padded run also captures its step in a CUDA graph and times the replay. Writes one
# moe_bench JSON per run to OUTDIR and prints a table last. Each replay is timed beside an eager
# step, the two alternating (moe_bench --graph): "graph/paired" compares them; "host graph us" is
# the median launch, then the fastest.
#   scripts/bench-static-shapes.sh [--configs "a b"] [--tokens "1024 2048 8192"]
#                                  [--factors "1.0 1.25"] [--grad-dtype bf16|fp32] [--iters N] OUTDIR
# deepseek-v3 (--configs deepseek-v3) holds all 256 experts on the one GPU: at T = 8192 its
# larger capacity factors need an H200's memory, or --grad-dtype bf16.
set -uo pipefail
source "$(dirname "$0")/common.sh"

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--configs C] [--tokens T] [--factors F] [--grad-dtype bf16|fp32] [--iters N] OUTDIR" >&"$to"
  exit "${1:-2}"
}
configs="mixtral-8x7b qwen3-30b-a3b" tokens="1024 2048 8192" factors="1.0 1.25 2.0" grad="" iters=10 out=""
while [ $# -gt 0 ]; do
  case $1 in
    --configs | --tokens | --factors | --grad-dtype | --iters)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
      case $1 in
        --configs) configs=$2 ;;
        --tokens) tokens=$2 ;;
        --factors) factors=$2 ;;
        --grad-dtype) grad=$2 ;;
        --iters) iters=$2 ;;
      esac
      shift 2 ;;
    -h | --help) usage 0 ;;
    -*) echo "error: unknown option '$1'" >&2; usage ;;
    *) [ -z "$out" ] || { echo "error: one OUTDIR, got '$out' and '$1'" >&2; usage; }
       out=$1; shift ;;
  esac
done
[ -n "$out" ] || usage
moe_require_configs_and_tokens "$configs" "$tokens"
set -f  # the lists below split on spaces alone: a '*' is no file name pattern
[ -n "${factors// /}" ] || { echo "error: --factors names no capacity factor" >&2; exit 2; }
for f in $factors; do
  # A decimal number in (0, 10000], moe_bench's range for --capacity-factor.
  [[ "$f" =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] &&
    awk -v f="$f" 'BEGIN { exit !(f + 0 > 0 && f + 0 <= 10000) }' ||
    { echo "error: --factors '$f' is not a capacity factor in (0, 10000]" >&2; exit 2; }
done
moe_refuse_repeats --factors "$factors"
[ -z "$grad" ] || [ "$grad" = bf16 ] || [ "$grad" = fp32 ] ||
  { echo "error: --grad-dtype '$grad' is neither bf16 nor fp32" >&2; exit 2; }
[[ "$iters" =~ ^[1-9][0-9]{0,4}$ ]] || { echo "error: --iters '$iters' is not a count of steps" >&2; exit 2; }
bench=$MOE_BUILD_DIR/apps/moe_bench
[ -x "$bench" ] || { echo "error: $bench is not built" >&2; exit 2; }
moe_require_gpu "$(basename "$0")" || exit 2
mkdir -p "$out" || exit 2
common=(--iters "$iters" --stage-lead-ms 0)
[ -n "$grad" ] && common+=(--grad-dtype "$grad")
status=0
written=()  # this run's files only: OUTDIR may hold others
for config in $configs; do
  for t in $tokens; do
    name=$config-T$t
    flags=(--config "$MOE_ROOT/configs/$config.yaml" --tokens "$t" "${common[@]}")
    moe_bench_run "$out" "$name-dropless" "$bench" "${flags[@]}"
    for f in $factors; do
      moe_bench_run "$out" "$name-padded-$f" "$bench" "${flags[@]}" --capacity-factor "$f" \
        --pad-to-capacity --graph
    done
  done
done
[ ${#written[@]} -gt 0 ] || { echo "error: no run succeeded; each one's output is in $out" >&2; exit 1; }
python3 - "${written[@]}" <<'PY'
import json, pathlib, sys
rows = [json.loads(pathlib.Path(path).read_text()) for path in sys.argv[1:]]
rows.sort(key=lambda r: (r["config_file"], r["tokens_per_gpu"], r["capacity_factor"]))
# "paired": the eager steps timed alternating with the replays, which the graph is held against.
print(f"{'config':<22} {'T':>5} {'mode':<14} {'eager ms':>9} {'paired ms':>9} {'graph ms':>9} "
      f"{'graph/paired':>12} {'vs dropless':>11} {'host eager us':>13} {'host graph us':>13} "
      f"{'nodes':>6} {'dropped':>8} {'memory GiB':>10}")
base = {}
for r in rows:
    key = (r["config_file"], r["tokens_per_gpu"])
    if r["capacity_factor"] == 0:
        base[key] = r["total_ms"]
for r in rows:
    key = (r["config_file"], r["tokens_per_gpu"])
    mode = "dropless" if r["capacity_factor"] == 0 else f"padded {r['capacity_factor']:g}"
    graph = r.get("graph_ms")
    # Against the eager steps timed beside the replays, where there are some.
    best = min(r.get("graph_paired_eager_ms", r["total_ms"]), graph) if graph else r["total_ms"]
    ratio = f"{best / base[key]:.2f}x" if key in base else "-"
    host_eager = 1e3 * (r["host_forward_ms"] + r["host_backward_ms"])
    host_graph = f"{1e3 * r['graph_host_launch_ms']:.1f}" if graph else "-"
    if graph and "graph_host_launch_min_ms" in r:  # the median, then the fastest launch
        host_graph += f"/{1e3 * r['graph_host_launch_min_ms']:.1f}"
    paired = r.get("graph_paired_eager_ms", float("nan"))
    versus = f"{graph / paired:.3f}" if graph else "-"
    print(f"{r['config_file'].removesuffix('.yaml'):<22} {r['tokens_per_gpu']:>5} {mode:<14} "
          f"{r['total_ms']:>9.3f} {paired:>9.3f} {graph if graph else float('nan'):>9.3f} "
          f"{versus:>12} {ratio:>11} "
          f"{host_eager:>13.1f} {host_graph:>13} {r.get('graph_nodes', '-'):>6} "
          f"{100 * r['dropped_fraction']:>7.2f}% "
          f"{r['memory_bytes'] / 2**30:>10.2f}")
PY
exit $status
