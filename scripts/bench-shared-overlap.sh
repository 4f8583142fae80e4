#!/usr/bin/env bash
# What the shared experts' overlap hides: the layer's step with the config's shared experts on
# their own stream, in series on the block's stream, and without them, on one GPU or, with
# --ranks N, on N ranks under mpirun (EP = N). hidden = (in series − overlapped) / (in series −
# without), the share of the shared experts' time that the routed path covers. Writes one
# moe_bench JSON per run to OUTDIR and prints a table last.
# --transport peer|nccl|copy picks the EP exchange (moe_bench --ep-transport; default: the
# layer's own choice), --chunks N the NCCL or copy exchange's pipeline chunks (moe_bench
# --exchange-chunks; 0: automatic, 1: one piece; default: the config's). --repeat R runs the three
# modes R times in turn (overlapped, series, without, then again), so that a drift of the GPU's
# clocks reaches all three alike, and takes each mode's median: one run's step moves by about
# ±0.3 ms, ±10 points of the hidden share at deepseek-v3.
#   scripts/bench-shared-overlap.sh [--configs "a b"] [--tokens "1024 8192"] [--ranks N]
#                                   [--transport T] [--chunks N] [--repeat R] OUTDIR
set -uo pipefail
source "$(dirname "$0")/common.sh"

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--configs C] [--tokens T] [--ranks N] [--transport peer|nccl|copy] [--chunks N]" \
    "[--repeat R] OUTDIR" >&"$to"
  exit "${1:-2}"
}
configs="deepseek-v3 qwen1.5-moe-a2.7b" tokens="8192" ranks=1 transport="" chunks="" repeat=1 out=""
while [ $# -gt 0 ]; do
  case $1 in
    --configs | --tokens | --ranks | --transport | --chunks | --repeat)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
      case $1 in
        --configs) configs=$2 ;;
        --tokens) tokens=$2 ;;
        --ranks) ranks=$2 ;;
        --transport) transport=$2 ;;
        --chunks) chunks=$2 ;;
        --repeat) repeat=$2 ;;
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
[[ "$ranks" =~ ^[1-9][0-9]{0,3}$ ]] ||
  { echo "error: --ranks '$ranks' is not a rank count in [1, 9999]" >&2; exit 2; }
[[ "$repeat" =~ ^[1-9][0-9]?$ ]] || { echo "error: --repeat '$repeat' is not 1 to 99" >&2; exit 2; }
[[ -z "$chunks" || "$chunks" =~ ^(0|[1-9][0-9]{0,2}|10[01][0-9]|102[0-4])$ ]] ||
  { echo "error: --chunks '$chunks' is not a chunk count in [0, 1024]" >&2; exit 2; }
case $transport in
  "" | peer | nccl | copy) ;;
  *) echo "error: --transport '$transport' is not peer, nccl or copy" >&2; exit 2 ;;
esac
[[ "$transport" != peer || -z "$chunks" || "$chunks" -le 1 ]] ||
  { echo "error: --chunks $chunks with --transport peer: the peer exchange does not pipeline" >&2
    exit 2; }
# Every config names its shared experts: the three modes compare them with and without.
for config in $configs; do
  grep -qE "^shared_ffn_hidden: *[1-9]" "$MOE_ROOT/configs/$config.yaml" ||
    { echo "error: --configs '$config' has no shared experts (shared_ffn_hidden)" >&2; exit 2; }
done
moe_require_gpu "$(basename "$0")" || exit 2
mkdir -p "$out" || exit 2
bench=$MOE_BUILD_DIR/apps/moe_bench
[ -x "$bench" ] || { echo "error: $bench is not built" >&2; exit 2; }
launcher=()
if [ "$ranks" -gt 1 ]; then
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
  if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
  launcher=(mpirun -np "$ranks" --bind-to none -x NCCL_NVLS_ENABLE)
fi
status=0
written=()  # the table reads this run's files only
for config in $configs; do
  file=$MOE_ROOT/configs/$config.yaml
  [ -f "$file" ] || { echo "error: no config $file" >&2; status=1; continue; }
  for t in $tokens; do
    for ((round = 1; round <= repeat; round++)); do
    for mode in overlapped series without; do
      name=$config-T$t-EP$ranks${transport:+-$transport}${chunks:+-c$chunks}-$mode
      [ "$repeat" -gt 1 ] && name+=-$round
      flags=(--config "$file" --tokens "$t" --iters 20 --stage-lead-ms 0)
      [ -n "$chunks" ] && flags+=(--exchange-chunks "$chunks")
      [ -n "$transport" ] && flags+=(--ep-transport "$transport")
      [ "$mode" = series ] && flags+=(--shared-in-series)
      [ "$mode" = without ] && flags+=(--shared-ffn-hidden 0)
      moe_bench_run "$out" "$name" "${launcher[@]}" "$bench" "${flags[@]}"
    done
    done
  done
done
[ ${#written[@]} -gt 0 ] || exit 1
python3 - "${written[@]}" <<'PY'
import json, pathlib, statistics, sys
steps = {}  # every run's step of one (config, T, EP, exchange, mode)
for path in map(pathlib.Path, sys.argv[1:]):
    r = json.loads(path.read_text())
    mode = ("without" if r["shared_ffn_hidden"] == 0 else
            "overlapped" if r["shared_expert_overlap"] else "series")
    exchange = r["ep_transport"] if r["ep"] > 1 else "-"
    chunks = r.get("exchange_chunks", 1) if r["ep"] > 1 else 1
    key = (r["config_file"].removesuffix(".yaml"), r["tokens_per_gpu"], r["ep"], exchange, chunks,
           mode)
    steps.setdefault(key, []).append(r["total_ms"])
runs = {key: {"total_ms": statistics.median(ms), "runs": len(ms)} for key, ms in steps.items()}
print(f"{'config':<22} {'T':>5} {'EP':>3} {'exchange':>8} {'chunks':>6} {'overlapped':>10} "
      f"{'series':>8} {'without':>8} {'shared ms':>9} {'hidden':>7} {'runs':>5}")
for (config, t, ep, exchange, chunks, mode), r in sorted(runs.items()):
    if mode != "overlapped":
        continue
    s = runs.get((config, t, ep, exchange, chunks, "series"))
    w = runs.get((config, t, ep, exchange, chunks, "without"))
    if s is None or w is None:
        continue
    shared = s["total_ms"] - w["total_ms"]
    hidden = (s["total_ms"] - r["total_ms"]) / shared if shared > 0 else float("nan")
    print(f"{config:<22} {t:>5} {ep:>3} {exchange:>8} {chunks:>6} {r['total_ms']:>10.3f} "
          f"{s['total_ms']:>8.3f} {w['total_ms']:>8.3f} {shared:>9.3f} {100 * hidden:>6.0f}% "
          f"{min(r['runs'], s['runs'], w['runs']):>5}")
PY
exit $status
