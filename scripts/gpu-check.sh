#!/usr/bin/env bash
# One call on the GPU machine: configure, build on all cores, run every gpu and mpi test (mpirun
# over all local GPUs) and the quick benchmarks, then print a short summary last.
#   scripts/gpu-check.sh [--sanitize] [--no-tests] [--no-bench] [--repeat N] [--only gpu|mpi]
#                        [--tests REGEX] [--exclude REGEX] OUTDIR
# --only L       runs the tests of label L alone.
# --tests REGEX  runs only the tests whose names it matches (ctest -R); --exclude REGEX leaves out
#                those it matches (ctest -E). At 4 ranks the mpi tests take about 440 s and the
#                fault tests 220 s more: where each command's time is bounded, two runs split them,
#                `--no-bench --exclude fault_injection`, then `--no-bench --only mpi --tests
#                fault_injection`.
# With several GPUs the gpu tests run on the last GPU beside the mpi tests (which take them all)
# but for the fault tests, whose waits are timed: those run alone afterwards. The gpu tests'
# output is printed once both are done; the mpi tests' as it happens.
# --sanitize  runs every gpu test binary under compute-sanitizer's memcheck, racecheck, initcheck
#             and synccheck (the four tools side by side, each over the binaries in turn).
# --repeat N  runs the router and MoEBlock suites N times under racecheck and N times plainly,
#             each run with a fresh seed (scripts/repeat-test.sh).
# Every test binary prints its run's seed first; the summary names the seed of any failure, and
# MOE_TEST_SEED=<seed> replays it. A run stopped by its time limit is reported as timed out: Catch2
# itself would count the SIGTERM as one failed assertion.
# OUTDIR receives the console output as it happens (gpu-check.txt), the logs packed as
# gpu-check-logs.tgz, and the benchmark results as *.json.
set -uo pipefail
source "$(dirname "$0")/common.sh"

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--sanitize] [--no-tests] [--no-bench] [--repeat N] [--only gpu|mpi]" \
    "[--tests REGEX] [--exclude REGEX] OUTDIR" >&"$to"
  exit "${1:-2}"
}
sanitize=0 tests=1 bench=1 repeat=0 out="" labels="gpu mpi" select=() exclude=()
while [ $# -gt 0 ]; do
  case $1 in
    --sanitize) sanitize=1 ;;
    --no-tests) tests=0 ;;
    --no-bench) bench=0 ;;
    --repeat) [ $# -ge 2 ] || { echo "error: --repeat needs a count" >&2; usage; }
      repeat=$2; shift ;;
    --only)
      [ $# -ge 2 ] || { echo "error: --only needs gpu or mpi" >&2; usage; }
      [ "$2" = gpu ] || [ "$2" = mpi ] || { echo "error: --only '$2' is neither gpu nor mpi" >&2; exit 2; }
      labels=$2; shift ;;
    --tests) [ $# -ge 2 ] || { echo "error: --tests needs a REGEX" >&2; usage; }
      select=(-R "$2"); shift ;;
    --exclude) [ $# -ge 2 ] || { echo "error: --exclude needs a REGEX" >&2; usage; }
      exclude=(-E "$2"); shift ;;
    -h | --help) usage 0 ;;
    -*) echo "error: unknown option '$1'" >&2; usage ;;
    *) [ -z "$out" ] || { echo "error: one OUTDIR, got '$out' and '$1'" >&2; usage; }
       out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "error: no OUTDIR" >&2; usage; }
[[ "$repeat" =~ ^(0|[1-9][0-9]{0,5})$ ]] ||
  { echo "error: --repeat '$repeat' is not a count in [0, 999999]" >&2; exit 2; }
# The tests and benchmarks need a GPU: refused here before anything is installed or built (with
# --no-tests --no-bench the script only builds, which any machine can).
if [ "$tests" -eq 1 ] || [ "$bench" -eq 1 ]; then
  moe_require_gpu gpu-check.sh ||
    { echo "(scripts/test.sh builds and runs the CPU tests; --no-tests --no-bench only builds)" >&2
      exit 2; }
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
logs=$MOE_BUILD_DIR/gpu-check
rm -rf "$logs"
mkdir -p "$logs"
# Everything printed also goes to OUTDIR as it happens, so a call that is stopped at a time limit
# still leaves how far it got.
exec > >(tee "$out/gpu-check.txt") 2>&1
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
summary=()
status=0
note() { summary+=("$1"); }
# The logs are packed into OUTDIR however the script ends, a time limit's SIGTERM included.
pack_logs() { tar -czf "$out/gpu-check-logs.tgz" -C "$MOE_BUILD_DIR" gpu-check 2>/dev/null; }
trap pack_logs EXIT
trap 'echo "gpu-check: stopped by a signal"; exit 143' TERM INT

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

# run_ctest LABEL LOG [live] [CTEST ARGS...]: ctest over one label into ctest-LOG.log, its exit
# status in ctest-LOG.rc; with live, its test lines also on the console as they end.
run_ctest() {
  local label=$1 log=$2 live=$3
  shift 3
  # Each test has a TIMEOUT (240 s unless tests/CMakeLists.txt gives it more): a hang costs one
  # test, not the run.
  (cd "$MOE_BUILD_DIR" && ctest -L "^$label\$" "$@" --output-on-failure) 2>&1 |
    tee "$logs/ctest-$log.log" | { if [ "$live" = live ]; then grep --line-buffered -E "Test +#"; else cat >/dev/null; fi; }
  echo "${PIPESTATUS[0]}" >"$logs/ctest-$log.rc"
}
report_label() {  # report_label LOG: one summary line and any failure's details
  local label=$1
  grep -E "tests passed|tests failed|No tests were found" "$logs/ctest-$label.log"
  local rc
  rc=$(cat "$logs/ctest-$label.rc")
  local line
  line=$(grep -E "tests passed|tests failed" "$logs/ctest-$label.log" | tail -1)
  local skipped
  skipped=$(grep -c "(Skipped)" "$logs/ctest-$label.log")
  if [ $rc -ne 0 ]; then
    status=1
    # Each failed check with what Catch printed around it: the test seed, the INFO context, the
    # expression and its values.
    grep -E "^test seed:|FAILED|\*\*\*Failed|Timeout" "$logs/ctest-$label.log" | head -20
    grep -B2 -A16 -E "^[^ ].*: FAILED:" "$logs/ctest-$label.log" | head -120
    for seed in $(grep -B200 -E ": FAILED:" "$logs/ctest-$label.log" | grep -oE "^test seed: [0-9]+" |
                  grep -oE "[0-9]+$" | sort -u); do
      note "$label: a failure replays with MOE_TEST_SEED=$seed"
    done
  fi
  note "$label tests: ${line:-no ctest summary} (skipped: $skipped)"
}
if [ $tests -eq 1 ]; then
  if [ "$labels" = "gpu mpi" ] && [ "$gpus" -ge 2 ] && [ ${#select[@]} -eq 0 ]; then
    echo "== gpu tests on GPU $((gpus - 1)), beside the mpi tests but the fault tests on all $gpus"
    CUDA_VISIBLE_DEVICES=$((gpus - 1)) run_ctest gpu gpu quiet "${exclude[@]}" &
    gpu_tests=$!
    beside=(-E "fault_injection")
    [ ${#exclude[@]} -gt 0 ] && beside=(-E "fault_injection|${exclude[1]}")
    run_ctest mpi mpi live "${beside[@]}"
    wait "$gpu_tests"  # (a bare wait would also wait for the console's tee)
    echo "== gpu tests"
    grep -E "Test +#" "$logs/ctest-gpu.log"
    report_label gpu
    echo "== mpi tests"
    report_label mpi
    echo "== mpi fault tests, alone"
    run_ctest mpi mpi-fault live -R fault_injection "${exclude[@]}"
    report_label mpi-fault
  else
    for label in $labels; do
      echo "== $label tests"
      run_ctest "$label" "$label" live "${select[@]}" "${exclude[@]}"
      report_label "$label"
    done
  fi
fi

# The sanitizer tools over every gpu test binary, at the suites' quick sizes. Every kernel is
# checked, cuBLASLt's too: with a kernel-name filter (either way) racecheck stopped with "Internal
# Sanitizer Error: The Sanitizer failed to handle a hardware exception" at the first GEMM
# (compute-sanitizer 2025.3.1, H100).
sanitize_tool() {  # sanitize_tool TOOL: every gpu test binary under TOOL, one line per binary
  local tool=$1 binary name log rc seed
  for binary in "$MOE_BUILD_DIR"/tests/test_gpu_*; do
    name=$(basename "$binary")
    log=$logs/sanitize-$tool-$name.log
    MOE_TEST_QUICK=1 timeout 900 compute-sanitizer --tool "$tool" --error-exitcode 99 "$binary" \
      >"$log" 2>&1
    rc=$?
    seed=$(grep -m1 -oE "test seed: [0-9]+" "$log" | grep -oE "[0-9]+$")
    case $rc in
      0) echo "sanitizer $tool $name: clean (seed ${seed:-?})" ;;
      124) echo "sanitizer $tool $name: TIMED OUT after 900 s (seed ${seed:-?}, log $(basename "$log"))" ;;
      99) echo "sanitizer $tool $name: ERRORS $(grep -m1 -E "(ERROR|RACECHECK) SUMMARY" "$log") (seed ${seed:-?}, log $(basename "$log"))" ;;
      *) echo "sanitizer $tool $name: FAILED, exit $rc (seed ${seed:-?}, log $(basename "$log"))" ;;
    esac
  done
}
if [ $sanitize -eq 1 ]; then
  echo "== compute-sanitizer"
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    status=1
    note "sanitizer: compute-sanitizer not found"
  else
    for tool in memcheck racecheck initcheck synccheck; do
      sanitize_tool $tool >"$logs/sanitize-$tool.txt" 2>&1 &
    done
    wait
    for tool in memcheck racecheck initcheck synccheck; do
      while IFS= read -r line; do
        echo "$line"
        note "$line"
        [[ "$line" == *": clean "* ]] || status=1
      done <"$logs/sanitize-$tool.txt"
    done
    # The machine's runtime may refuse the device to the sanitizer (seen on gVisor).
    if grep -qs "Device not supported" "$logs"/sanitize-*.log; then
      note "sanitizer: the device was refused on this machine's runtime"
    fi
  fi
fi

if [ "$repeat" -gt 0 ]; then
  echo "== repeated runs ($repeat each, fresh seeds)"
  for suite in test_gpu_router test_gpu_moe_block; do
    for tool in racecheck plain; do
      args=(--runs "$repeat" --logs "$logs/repeat")
      [ $tool = racecheck ] && args+=(--tool racecheck)
      bash "$MOE_ROOT/scripts/repeat-test.sh" "${args[@]}" "$MOE_BUILD_DIR/tests/$suite" \
        >"$logs/repeat-$suite-$tool.txt" 2>&1 &
    done
  done
  wait
  for file in "$logs"/repeat-*.txt; do
    cat "$file"
    line=$(tail -1 "$file")
    note "repeat: $line"
    # A run that failed, or repeat-test.sh refusing to start (no compute-sanitizer, say).
    grep -q "FAIL\|TIMED OUT\|^error:" "$file" &&
      { status=1; note "$(grep -m3 "FAIL\|TIMED OUT\|^error:" "$file")"; }
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
  # Capacity mode on one GPU, beside the dropless run's numbers.
  if "$MOE_BUILD_DIR/apps/moe_bench" --capacity-factor 1.25 --json "$logs/moe_bench_capacity.json" \
       >"$logs/moe_bench_capacity.txt" 2>&1; then
    note "moe_bench capacity 1.25 (one GPU): $(grep -m1 "^throughput" "$logs/moe_bench_capacity.txt"); $(grep -m1 "^capacity mode" "$logs/moe_bench_capacity.txt")"
  else
    status=1
    note "moe_bench --capacity-factor 1.25: FAILED"
  fi
  cat "$logs/moe_bench_capacity.txt"
  # Static shapes: the eager step with no host wait, then captured in a CUDA graph and replayed.
  if "$MOE_BUILD_DIR/apps/moe_bench" --capacity-factor 1.25 --pad-to-capacity --graph \
       --json "$logs/moe_bench_padded.json" >"$logs/moe_bench_padded.txt" 2>&1; then
    note "moe_bench capacity 1.25 padded (one GPU): $(grep -m1 "^throughput" "$logs/moe_bench_padded.txt")"
    note "moe_bench $(grep -m1 "^CUDA graph" "$logs/moe_bench_padded.txt")"
  else
    status=1
    note "moe_bench --capacity-factor 1.25 --pad-to-capacity --graph: FAILED"
  fi
  cat "$logs/moe_bench_padded.txt"
fi

cp "$logs"/*.json "$out"/ 2>/dev/null
echo
echo "SUMMARY ($(date -u +%Y-%m-%dT%H:%MZ), $(hostname))"
for line in "${summary[@]}"; do echo "  $line"; done
[ $status -eq 0 ] && echo "  result: PASS" || echo "  result: FAIL"
exit $status
