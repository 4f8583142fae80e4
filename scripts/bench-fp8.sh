#!/usr/bin/env bash
# The layer's step with FP8 expert products against bf16 at the model shapes, dropless, at one
# alignment (FP8 needs multiples of 16); on an EP mesh (--ranks R) also FP8 with the rows toward
# the experts sent as E4M3 records (fp8_dispatch), all over the NCCL exchange. Writes one moe_bench
# JSON per run to OUTDIR and prints a table last.
#   scripts/bench-fp8.sh [--configs "a b"] [--tokens "1024 8192"] [--ranks R]
#                        [--modes "bf16 fp8 fp8-mb dispatch"] [--micro-batches N] [--repeat K]
#                        OUTDIR
# Mode fp8-mb is fp8 with the weights quantized on one step in N (moe_bench --micro-batches N,
# default 4), as a trainer's micro-batches between two optimizer updates. The table's steps are
# every run's mean step (moe_bench's total_ms_mean), the statistic an fp8-mb run needs.
# --ranks 1 (the default) runs on one GPU, where modes bf16, fp8 and fp8-mb apply; from 2 on,
# mpirun launches an EP mesh of R ranks on this host and the modes default to "fp8 dispatch".
# --repeat runs every mode K times, alternating, and the table takes the means.
set -uo pipefail
source "$(dirname "$0")/common.sh"

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--configs C] [--tokens T] [--ranks R] [--modes M] [--micro-batches N]" \
    "[--repeat K] OUTDIR" >&"$to"
  exit "${1:-2}"
}
configs="mixtral-8x7b qwen3-30b-a3b deepseek-v3" tokens="8192" ranks=1 modes="" repeat=1 out=""
micro_batches=4 micro_batches_given=0
while [ $# -gt 0 ]; do
  case $1 in
    --configs | --tokens | --ranks | --modes | --micro-batches | --repeat)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
      case $1 in
        --configs) configs=$2 ;;
        --tokens) tokens=$2 ;;
        --ranks) ranks=$2 ;;
        --modes) modes=$2 ;;
        --micro-batches) micro_batches=$2 micro_batches_given=1 ;;
        --repeat) repeat=$2 ;;
      esac
      shift 2 ;;
    -h | --help) usage 0 ;;
    -*) echo "error: unknown option '$1'" >&2; usage ;;
    *) [ -z "$out" ] || { echo "error: one OUTDIR, got '$out' and '$1'" >&2; usage; }
       out=$1; shift ;;
  esac
done
[ -n "$out" ] || { echo "error: no OUTDIR" >&2; usage; }
moe_require_configs_and_tokens "$configs" "$tokens"
[[ "$ranks" =~ ^[1-9][0-9]?$ ]] || { echo "error: --ranks '$ranks' is not 1 to 99" >&2; exit 2; }
[[ "$repeat" =~ ^[1-9][0-9]?$ ]] || { echo "error: --repeat '$repeat' is not 1 to 99" >&2; exit 2; }
[[ "$micro_batches" =~ ^[2-9]$|^[1-9][0-9]{1,2}$ ]] ||
  { echo "error: --micro-batches '$micro_batches' is not 2 to 999 (decimal, no leading zero;" \
      "one step an update is mode fp8)" >&2; exit 2; }
if [ -z "$modes" ]; then
  if [ "$ranks" -eq 1 ]; then modes="bf16 fp8"; else modes="fp8 dispatch"; fi
fi
[ -n "${modes// /}" ] || { echo "error: --modes '$modes' names no mode" >&2; exit 2; }
moe_refuse_repeats --modes "$modes"
set -f
for mode in $modes; do
  case $mode in
    bf16 | fp8 | fp8-mb) ;;
    dispatch)
      [ "$ranks" -ge 2 ] ||
        { echo "error: --modes dispatch sends rows over an EP mesh: it needs --ranks 2 or more" >&2
          exit 2; } ;;
    *) echo "error: --modes '$mode' is none of bf16, fp8, fp8-mb, dispatch" >&2; exit 2 ;;
  esac
done
if [ "$micro_batches_given" -eq 1 ] && [[ " $modes " != *" fp8-mb "* ]]; then
  echo "error: --micro-batches applies to mode fp8-mb, which --modes '$modes' leaves out" >&2
  exit 2
fi
set +f
moe_require_gpu "$(basename "$0")" || exit 2
mkdir -p "$out" || exit 2
bench=$MOE_BUILD_DIR/apps/moe_bench
[ -x "$bench" ] || { echo "error: $bench is not built" >&2; exit 2; }
launch=()
mesh=()
if [ "$ranks" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
  if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
  launch=(mpirun -np "$ranks" --bind-to none -x NCCL_NVLS_ENABLE)
  mesh=(--ep "$ranks" --ep-transport nccl)
fi
status=0
written=()
for config in $configs; do
  for t in $tokens; do
    for ((round = 1; round <= repeat; round++)); do
      for mode in $modes; do
        name=$config-T$t-EP$ranks-$mode-$round
        [ "$mode" = fp8-mb ] && name=$config-T$t-EP$ranks-$mode$micro_batches-$round
        iters=10
        [ "$mode" = fp8-mb ] && iters=$(((10 + micro_batches - 1) / micro_batches * micro_batches))
        flags=(--config "$MOE_ROOT/configs/$config.yaml" --tokens "$t" --iters "$iters"
               --stage-lead-ms 0 --align-size 16 "${mesh[@]}")
        [ "$mode" != bf16 ] && flags+=(--fp8)
        [ "$mode" = fp8-mb ] && flags+=(--micro-batches "$micro_batches")
        [ "$mode" = dispatch ] && flags+=(--fp8-dispatch)
        moe_bench_run "$out" "$name" "${launch[@]}" "$bench" "${flags[@]}"
      done
    done
  done
done
[ ${#written[@]} -gt 0 ] || exit 1
python3 - "${written[@]}" <<'PY'
import json, pathlib, statistics, sys
EXCHANGE = ("moe dispatch", "moe combine", "moe combine backward", "moe dispatch backward")
runs = {}  # (config, T, EP, mode) -> every run's figures
for path in sys.argv[1:]:
    r = json.loads(pathlib.Path(path).read_text())
    mode = ("dispatch" if r.get("fp8_dispatch") else
            "fp8-mb" if r.get("micro_batches", 1) > 1 else "fp8" if r["fp8"] else "bf16")
    s = r["stages_ms"]
    runs.setdefault((r["config_file"].removesuffix(".yaml"), r["tokens_per_gpu"], r["ep"], mode),
                    []).append((r.get("total_ms_mean", r["total_ms"]), r["step_floor_ms"],
                                sum(v for k, v in s.items() if "experts" in k),
                                sum(s.get(k, 0.0) for k in EXCHANGE),
                                r["memory_bytes"] / 2**30))
print(f"{'config':<16} {'T':>5} {'EP':>3} {'mode':<9} {'runs':>4} {'step ms':>9} {'floor ms':>9} "
      f"{'experts ms':>10} {'exchange ms':>11} {'GiB':>6} {'vs first':>8}")
first = {}
MODES = ("bf16", "fp8", "fp8-mb", "dispatch")
for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], MODES.index(k[3]))):
    step, floor, experts, exchange, gib = (statistics.mean(v[i] for v in runs[key]) for i in range(5))
    group = key[:3]
    first.setdefault(group, step)
    print(f"{key[0]:<16} {key[1]:>5} {key[2]:>3} {key[3]:<9} {len(runs[key]):>4} {step:>9.3f} "
          f"{floor:>9.3f} {experts:>10.3f} {exchange:>11.3f} {gib:>6.2f} {first[group] / step:>7.3f}x")
PY
exit $status
