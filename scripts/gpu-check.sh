#!/usr/bin/env bash
# One call on the GPU machine: configure, build on all cores, run every gpu and mpi test (mpirun
# over all local GPUs) and the quick benchmarks, then print a short summary last.
#   scripts/gpu-check.sh [--sanitize] [--no-bench]
# --sanitize also runs the gpu test binaries under compute-sanitizer (memcheck, racecheck).
# Logs go to build/gpu-check/; when $OUT is set (the device tool's folder) they are also packed
# into $OUT/gpu-check-logs.tgz, with the benchmark results as $OUT/*.json.
set -uo pipefail
source "$(dirname "$0")/common.sh"

sanitize=0 bench=1
for arg in "$@"; do
  case $arg in
    --sanitize) sanitize=1 ;;
    --no-bench) bench=0 ;;
    *) echo "usage: $0 [--sanitize] [--no-bench]" >&2; exit 2 ;;
  esac
done
logs=$MOE_BUILD_DIR/gpu-check
rm -rf "$logs"
mkdir -p "$logs"
# On the device machine everything printed also goes to $OUT as it happens, so a call that is
# killed at its time limit still brings back how far it got.
if [ -n "${OUT:-}" ]; then exec > >(tee "$OUT/gpu-check.txt") 2>&1; fi
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
summary=()
status=0
note() { summary+=("$1"); }

echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$logs/gpus.txt"
moe_find_cuda && nvcc --version | tail -1

echo "== build"
start=$SECONDS
moe_install_deps
mkdir -p "$MOE_BUILD_DIR"
if ! moe_build -DCMAKE_BUILD_TYPE=Release >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "SUMMARY: build FAILED (log: $logs/build.log)"
  exit 1
fi
# Warnings are errors only under CI (another compiler); here they are counted, so that the GPU
# machine's newer compiler (gcc 13 on Ubuntu 24.04) shows what it flags.
warnings=$(grep -cE "warning( #[0-9]+-D)?:" "$logs/build.log")
note "build: ok in $((SECONDS - start)) s, $warnings compiler warning(s)"
[ "$warnings" -gt 0 ] && grep -m5 -E "warning( #[0-9]+-D)?:" "$logs/build.log"
gpus=$("$MOE_BUILD_DIR/tests/moe_gpu_count")
note "gpus: $gpus ($(head -1 "$logs/gpus.txt" | cut -d, -f2 | xargs))"

run_label() {  # run_label LABEL: ctest over one label, one summary line
  local label=$1
  # Each test has a 240 s TIMEOUT (tests/CMakeLists.txt): a hang costs one test, not the run.
  (cd "$MOE_BUILD_DIR" && ctest -L "^$label\$" --output-on-failure) 2>&1 | tee "$logs/ctest-$label.log" |
    grep -E "Test +#|tests passed|tests failed"
  local rc=${PIPESTATUS[0]}
  local line
  line=$(grep -E "tests passed|tests failed" "$logs/ctest-$label.log" | tail -1)
  local skipped
  skipped=$(grep -c "(Skipped)" "$logs/ctest-$label.log")
  [ $rc -ne 0 ] && { status=1; grep -E "Failed|FAILED|\*\*\*" "$logs/ctest-$label.log" | head -20; }
  note "$label tests: ${line:-no ctest summary} (skipped: $skipped)"
}
echo "== gpu tests"
run_label gpu
echo "== mpi tests"
run_label mpi

if [ $sanitize -eq 1 ]; then
  echo "== compute-sanitizer"
  for tool in memcheck racecheck; do
    for binary in "$MOE_BUILD_DIR"/tests/test_gpu_*; do
      name=$(basename "$binary")
      if compute-sanitizer --tool $tool --error-exitcode 99 "$binary" >"$logs/sanitize-$tool-$name.log" 2>&1; then
        note "sanitizer $tool $name: clean"
      else
        status=1
        tail -20 "$logs/sanitize-$tool-$name.log"
        note "sanitizer $tool $name: ERRORS (log sanitize-$tool-$name.log)"
      fi
    done
  done
fi

if [ $bench -eq 1 ]; then
  echo "== quick benchmarks"
  for binary in "$MOE_BUILD_DIR"/bench/bench_*; do
    [ -x "$binary" ] || continue
    name=$(basename "$binary")
    launcher=()
    # The exchange needs a rank per GPU; with one GPU it says so and skips.
    [ "$name" = bench_exchange ] && launcher=(mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE)
    if "${launcher[@]}" "$binary" --quick --json "$logs/$name.json" >"$logs/$name.txt" 2>&1; then
      cat "$logs/$name.txt"
      stage=${name#bench_}
      # The PyTorch peer on the same shapes, in the same run, where python3 has torch.
      if [ "$stage" = exchange ]; then
        note "$name: $(grep -m1 "^dispatch + combine:" "$logs/$name.txt")"
      elif python3 -c "import torch" 2>/dev/null &&
         python3 "$MOE_ROOT/bench/peers.py" "$stage" --quick --json "$logs/peer_$stage.json" >"$logs/peer_$stage.txt" 2>&1; then
        python3 "$MOE_ROOT/bench/compare.py" "$logs/$name.json" "$logs/peer_$stage.json" | tee "$logs/compare_$stage.txt"
        note "$name: ok, vs PyTorch: $(python3 "$MOE_ROOT/bench/compare.py" --summary "$logs/$name.json" "$logs/peer_$stage.json")"
      else
        note "$name: ok (no PyTorch peer)"
      fi
    else
      status=1
      tail -20 "$logs/$name.txt"
      note "$name: FAILED"
    fi
  done
  if mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE "$MOE_BUILD_DIR/apps/moe_bench" --json "$logs/moe_bench.json" \
       >"$logs/moe_bench.txt" 2>&1; then
    note "moe_bench (all GPUs, small config): $(grep -m1 "^throughput" "$logs/moe_bench.txt")"
  else
    status=1
    note "moe_bench: FAILED"
  fi
  cat "$logs/moe_bench.txt"
fi

if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu-check-logs.tgz" -C "$MOE_BUILD_DIR" gpu-check
  cp "$logs"/*.json "$OUT"/ 2>/dev/null
fi
echo
echo "SUMMARY ($(date -u +%Y-%m-%dT%H:%MZ), $(hostname))"
for line in "${summary[@]}"; do echo "  $line"; done
[ $status -eq 0 ] && echo "  result: PASS" || echo "  result: FAIL"
exit $status
