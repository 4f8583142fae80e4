#!/usr/bin/env bash
# What the pipelined exchange hides: the layer's step over the NCCL exchange (or, with --transports,
# the copy exchange too) on N ranks (EP = N) with the exchange in 1 chunk and in each chunk count
# asked, optionally under several NCCL channel counts (NCCL_MAX_NCHANNELS, which sets how many SMs
# NCCL's transfers take from the expert products). hidden = (step in 1 chunk − step in c chunks) / the exchange stages of the
# 1-chunk step, the share of the exchange time the pipeline covers (docs/design.md, "Cost model",
# calls it s). Writes one moe_bench JSON per run to OUTDIR and prints a table last.
# --repeat R runs the chunk counts R times in turn and takes each one's median step.
# A transport `copy:nccl` is the copy exchange with its barriers run by NCCL (MOE_STREAM_BARRIER=
# nccl) instead of by the GPUs' front ends on flags: `--transports "copy copy:nccl"` compares them.
#   scripts/bench-pipeline.sh [--configs "a b"] [--tokens "8192"] [--ranks N] [--chunks "4 8"]
#                             [--transports "nccl copy"] [--nccl-channels "default 4 8"]
#                             [--repeat R] OUTDIR
set -uo pipefail
source "$(dirname "$0")/common.sh"

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--configs C] [--tokens T] [--ranks N] [--chunks C] [--transports T]" \
    "[--nccl-channels N] [--repeat R] OUTDIR" >&"$to"
  exit "${1:-2}"
}
configs="deepseek-v3 qwen3-30b-a3b mixtral-8x7b" tokens="8192" ranks=2 chunk_counts="4"
channel_counts="default" transports="nccl" repeat=1 out=""
while [ $# -gt 0 ]; do
  case $1 in
    --configs | --tokens | --ranks | --chunks | --transports | --nccl-channels | --repeat)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
      case $1 in
        --configs) configs=$2 ;;
        --tokens) tokens=$2 ;;
        --ranks) ranks=$2 ;;
        --chunks) chunk_counts=$2 ;;
        --transports) transports=$2 ;;
        --nccl-channels) channel_counts=$2 ;;
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
if ! [[ "$ranks" =~ ^[1-9][0-9]{0,3}$ && "$ranks" -ge 2 ]]; then
  echo "error: --ranks '$ranks' is not a rank count in [2, 9999] (an EP mesh)" >&2
  exit 2
fi
for list in "--chunks:$chunk_counts" "--transports:$transports" "--nccl-channels:$channel_counts"; do
  words=${list#*:}
  [ -n "${words// /}" ] || { echo "error: ${list%%:*} names nothing" >&2; exit 2; }
done
for c in $chunk_counts; do
  # At most four digits before the comparison: bash's arithmetic wraps longer numbers around.
  if ! [[ "$c" =~ ^[1-9][0-9]{0,3}$ && "$c" -le 1024 ]]; then
    echo "error: --chunks '$c' is not a chunk count in [1, 1024]" >&2
    exit 2
  fi
done
for x in $transports; do
  [ "$x" = nccl ] || [ "$x" = copy ] || [ "$x" = copy:nccl ] ||
    { echo "error: --transports '$x' is none of 'nccl', 'copy' and 'copy:nccl'" >&2; exit 2; }
done
for n in $channel_counts; do
  [ "$n" = default ] || [[ "$n" =~ ^[1-9][0-9]{0,2}$ && "$n" -le 256 ]] ||
    { echo "error: --nccl-channels '$n' is neither 'default' nor a channel count in [1, 256]" >&2
      exit 2; }
done
[[ " $chunk_counts " != *" 1 "* ]] ||
  { echo "error: --chunks 1: one chunk runs anyway, as the baseline of the others" >&2; exit 2; }
moe_refuse_repeats --chunks "$chunk_counts"
moe_refuse_repeats --transports "$transports"
moe_refuse_repeats --nccl-channels "$channel_counts"
[[ "$repeat" =~ ^[1-9][0-9]?$ ]] || { echo "error: --repeat '$repeat' is not 1 to 99" >&2; exit 2; }
moe_require_gpu "$(basename "$0")" || exit 2
mkdir -p "$out" || exit 2
bench=$MOE_BUILD_DIR/apps/moe_bench
[ -x "$bench" ] || { echo "error: $bench is not built" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

status=0
written=()  # "transport,channels,chunks=path" of this run's files only
for config in $configs; do
  file=$MOE_ROOT/configs/$config.yaml
  [ -f "$file" ] || { echo "error: no config $file" >&2; status=1; continue; }
  for t in $tokens; do
    for channels in $channel_counts; do
      environment=(-x NCCL_NVLS_ENABLE)
      if [ "$channels" != default ]; then
        export NCCL_MAX_NCHANNELS=$channels
        environment+=(-x NCCL_MAX_NCHANNELS)
      else
        unset NCCL_MAX_NCHANNELS
      fi
      for ((round = 1; round <= repeat; round++)); do
        for transport in $transports; do
          barrier=()
          if [ "$transport" = copy:nccl ]; then barrier=(-x MOE_STREAM_BARRIER=nccl); fi
          for chunks in 1 $chunk_counts; do
            name=$config-T$t-EP$ranks-${transport/:/-barrier-}-ch$channels-c$chunks
            [ "$repeat" -gt 1 ] && name+=-$round
            if mpirun -np "$ranks" --bind-to none "${environment[@]}" "${barrier[@]}" "$bench" \
              --config "$file" --tokens "$t" --ep "$ranks" --ep-transport "${transport%%:*}" \
              --exchange-chunks "$chunks" \
              --iters 20 --json "$out/$name.json" >"$out/$name.txt" 2>&1; then
              written+=("$transport,$channels,$chunks=$out/$name.json")
            else
              status=1
              echo "FAILED: $name"
              tail -3 "$out/$name.txt"
            fi
          done
        done
      done
    done
  done
done
[ ${#written[@]} -gt 0 ] || exit 1
python3 - "${written[@]}" <<'PY'
import json, pathlib, statistics, sys
EXCHANGE = ("moe dispatch", "moe combine", "moe combine backward", "moe dispatch backward")
runs = {}  # (config, T, EP, transport, channels, chunks) -> every run's (step, exchange, experts)
for argument in sys.argv[1:]:
    asked, path = argument.split("=", 1)
    transport, channels, chunks = asked.split(",")
    r = json.loads(pathlib.Path(path).read_text())
    stages = r["stages_ms"]
    # The chunks asked (the run's own are at most its local experts).
    key = (r["config_file"].removesuffix(".yaml"), r["tokens_per_gpu"], r["ep"], transport,
           channels, int(chunks))
    runs.setdefault(key, []).append((r["total_ms"], sum(stages.get(s, 0.0) for s in EXCHANGE),
                                     stages.get("moe experts", 0.0) +
                                     stages.get("moe experts backward", 0.0)))
median = {key: tuple(statistics.median(v[i] for v in values) for i in range(3))
          for key, values in runs.items()}
print(f"{'config':<16} {'T':>5} {'EP':>3} {'exchange':>8} {'channels':>8} {'chunks':>6} "
      f"{'step ms':>8} {'stages':>9} {'experts':>8} {'hidden':>7} {'runs':>5}")
for key in sorted(median):
    config, t, ep, transport, channels, chunks = key
    step, exchange, experts = median[key]
    serial = median.get((config, t, ep, transport, channels, 1))
    hidden = ""
    if serial is not None and chunks > 1 and serial[1] > 0:
        hidden = f"{100 * (serial[0] - step) / serial[1]:.0f}%"
    print(f"{config:<16} {t:>5} {ep:>3} {transport:>8} {channels:>8} {chunks:>6} {step:>8.3f} "
          f"{exchange:>9.3f} {experts:>8.3f} {hidden:>7} {len(runs[key]):>5}")
PY
exit $status
