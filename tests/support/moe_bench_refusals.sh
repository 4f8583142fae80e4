#!/usr/bin/env bash
# moe_bench_refusals.sh MOE_BENCH: settings that cannot run are refused with a message naming
# them, before any GPU is looked for (so on a machine without one too). The refusals come after
# MPI starts, where the sanitizers may turn the exit status 1 into an abort: any failure counts,
# with the message.
set -uo pipefail
bench=$1 failed=0
expect() {  # TEXT ARGS...: moe_bench ARGS fails and prints TEXT
  local text=$1 output status
  shift
  output=$("$bench" "$@" 2>&1)
  status=$?
  # A sanitizer's own report (not LeakSanitizer's of MPI's allocations at the abort) fails too.
  if [ $status -eq 0 ] || [[ "$output" != *"$text"* ]] ||
    [[ "$output" == *"ERROR: AddressSanitizer"* || "$output" == *"runtime error:"* ]]; then
    echo "FAIL: moe_bench $* exited $status, without '$text':"
    echo "$output" | tail -5
    failed=1
  else
    echo "ok: moe_bench $* -> $text"
  fi
}
expect "--graph needs static shapes" --graph
# A flag takes no value: CLI11 alone would read --fp8=2 as given and --graph=0 as not.
expect "moe_bench: --fp8=2: --fp8 is a flag and takes no value" --fp8=2
# A repeated option is CLI11's error, named after the program like the others.
expect "moe_bench: --tokens: " --tokens 64 --tokens 128
expect "--graph=0: --graph is a flag and takes no value" --graph=0
expect "--pad-to-capacity needs capacity mode (--capacity-factor, or the config's)" \
  --pad-to-capacity
expect "--fp8-dispatch needs FP8 experts (--fp8, or the config's fp8: true)" --fp8-dispatch
expect "--fp8 needs align_size a multiple of 16 (--align-size 16), --align-size is 0" --fp8 \
  --align-size 0
expect "--fp8 needs align_size a multiple of 16 (--align-size 16), the config's is 0" --fp8 \
  --config "$(dirname "$0")/../../configs/mixtral-8x7b.yaml"
fp32_config=$(mktemp)
printf 'hidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\ndtype: fp32\nalign_size: 16\n' \
  > "$fp32_config"
expect "--fp8 needs a bf16 layer; the config's dtype is fp32" --fp8 --tokens 64 \
  --config "$fp32_config"
rm -f "$fp32_config"
expect "--drop-policy position needs capacity mode" --drop-policy position
expect "--micro-batches 4: without fp8 (--fp8) a step quantizes no weights" --micro-batches 4
expect "--iters 10 is not a whole number of --micro-batches 4" --fp8 --micro-batches 4 --iters 10
expect "--micro-batches 2 times the eager step alone" --fp8 --micro-batches 2 \
  --split-phase-products 1
expect "--micro-batches 2 times the eager step alone" --fp8 --micro-batches 2 \
  --capacity-factor 1 --pad-to-capacity --graph
expect "--micro-batches: 0 is not in [1, 1024]" --micro-batches 0
# Ranks started with different settings would wait on each other's collectives: both refuse.
if command -v mpirun >/dev/null; then
  output=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 60 mpirun \
    --oversubscribe -np 1 "$bench" --iters 5 : -np 1 "$bench" --iters 7 2>&1)
  count=$(grep -c "the ranks were started with different settings: the command line or config of rank(s) 1" \
    <<<"$output")
  if [ "$count" -ne 2 ]; then
    echo "FAIL: two ranks of different --iters were not both refused:"
    echo "$output" | tail -5
    failed=1
  else
    echo "ok: mpirun moe_bench --iters 5 : --iters 7 -> refused on both ranks"
  fi
fi
exit $failed
