#!/usr/bin/env bash
# The run scripts (gpu-check.sh, bench-*.sh, repeat-test.sh) refuse bad options with exit status 2 and a message
# naming the option and its value, before they install, build or run anything; on a machine
# without a GPU they refuse valid options too, before building.
#   script_refusals.sh SOURCE_DIR BUILD_DIR
set -u
scripts=$1/scripts
export MOE_BUILD_DIR=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0

# expect MESSAGE SCRIPT ARGS...: the script exits 2 and says MESSAGE.
expect() {
  local want=$1 said status
  shift
  said=$(bash "$scripts/$1" "${@:2}" 2>&1)
  status=$?
  if [ "$status" -ne 2 ] || [[ "$said" != *"$want"* ]]; then
    echo "FAIL: $* exited $status, wanted 2 and \"$want\"; said:"
    echo "$said" | head -5
    failed=1
  fi
}

for script in gpu-check.sh bench-fp8.sh bench-pipeline.sh bench-shared-overlap.sh \
  bench-static-shapes.sh; do
  expect "unknown option '--bogus'" "$script" --bogus "$out/a"
done
for script in bench-fp8.sh bench-pipeline.sh bench-shared-overlap.sh bench-static-shapes.sh; do
  expect "--configs 'nope' is not one of" "$script" --configs nope "$out/a"
  # A path is no config name, though configs/../configs/small.yaml exists: the name also names
  # the results' files under OUTDIR.
  expect "--configs '../configs/small' is not a config name" "$script" --configs ../configs/small \
    "$out/a"
  expect "--tokens '0' is not a token count in [1, 2^30]" "$script" --tokens 0 "$out/a"
done
# --help: the usage on standard output, status 0, nothing run.
for script in gpu-check.sh bench-fp8.sh bench-pipeline.sh bench-shared-overlap.sh \
  bench-static-shapes.sh repeat-test.sh; do
  for flag in --help -h; do
    said=$(bash "$scripts/$script" "$flag" 2>/dev/null)
    status=$?
    if [ "$status" -ne 0 ] || [[ "$said" != "usage: "* ]]; then
      echo "FAIL: $script $flag exited $status, wanted 0 and the usage on stdout; said: $said"
      failed=1
    fi
  done
done
expect "'$out' is not an executable file" repeat-test.sh "$out"
expect "--repeat needs a count" gpu-check.sh --repeat
expect "--repeat 'x' is not a count in [0, 999999]" gpu-check.sh --repeat x "$out/a"
expect "--only 'cpu' is neither gpu nor mpi" gpu-check.sh --only cpu "$out/a"
expect "one OUTDIR, got 'a' and 'b'" gpu-check.sh a b
expect "no OUTDIR" gpu-check.sh
expect "--factors '0' is not a capacity factor in (0, 10000]" bench-static-shapes.sh --factors 0 \
  "$out/a"
expect "--iters '0' is not a count of steps" bench-static-shapes.sh --iters 0 "$out/a"
expect "--micro-batches applies to mode fp8-mb" bench-fp8.sh --micro-batches 4 "$out/a"
expect "--ranks '0' is not a rank count in [2, 9999]" bench-pipeline.sh --ranks 0 "$out/a"
expect "--chunks '1025' is not a chunk count in [0, 1024]" bench-shared-overlap.sh --chunks 1025 \
  "$out/a"
# Counts past bash's arithmetic are refused by their digits, not wrapped into range.
expect "--chunks '18446744073709551617' is not a chunk count in [1, 1024]" bench-pipeline.sh \
  --chunks 18446744073709551617 "$out/a"
expect "--nccl-channels '99999' is neither 'default' nor a channel count in [1, 256]" \
  bench-pipeline.sh --nccl-channels 99999 "$out/a"
expect "--chunks 1: one chunk runs anyway" bench-pipeline.sh --chunks "1 4" "$out/a"
# A run named twice would write its files twice and count twice in the table.
expect "--configs 'small' is given twice: each is one run" bench-pipeline.sh \
  --configs "small small" "$out/a"
expect "--tokens '1024' is given twice" bench-static-shapes.sh --tokens "1024 1024" "$out/a"
expect "--factors '1.0' is given twice" bench-static-shapes.sh --factors "1.0 1.0" "$out/a"
expect "--modes 'fp8' is given twice" bench-fp8.sh --modes "fp8 fp8" "$out/a"
expect "--transports 'copy' is given twice" bench-pipeline.sh --transports "copy copy" "$out/a"
expect "--configs 'small' has no shared experts" bench-shared-overlap.sh --configs small "$out/a"
expect "the peer exchange does not pipeline" bench-shared-overlap.sh --transport peer --chunks 4 \
  "$out/a"

# Without a GPU, valid options are refused before anything is built or OUTDIR is made.
if ! nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null; then
  expect "gpu-check.sh: no NVIDIA GPU here" gpu-check.sh "$out/gpu-check"
  if [ -x "$MOE_BUILD_DIR/apps/moe_bench" ]; then
    expect "bench-static-shapes.sh: no NVIDIA GPU here" bench-static-shapes.sh --configs small \
      "$out/static"
    expect "bench-fp8.sh: no NVIDIA GPU here" bench-fp8.sh --configs small "$out/fp8"
  fi
  for made in gpu-check static fp8; do
    [ ! -e "$out/$made" ] || { echo "FAIL: a refused run made $out/$made"; failed=1; }
  done
fi
[ "$failed" -eq 0 ] && echo "every refusal as expected"
exit "$failed"
