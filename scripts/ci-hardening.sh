#!/usr/bin/env bash
# Hardening checks of the code that reads untrusted input (tensor files, configs):
#   (a) the CPU tests and moe_run built with AddressSanitizer + UndefinedBehaviorSanitizer (gcc,
#       host code only: the .cu files are built as usual), `ctest -L cpu` there, and
#       `moe_run --reference` on small files, good and bad;
#   (b) the libFuzzer targets of fuzz/ (clang), each for MOE_FUZZ_SECONDS seconds.
# Installs what is missing (as root, through apt-get), prints a pass/fail summary, and exits
# non-zero when any step fails.
#
# Environment: MOE_ASAN_BUILD_DIR (default build-asan), MOE_FUZZ_BUILD_DIR (default build-fuzz),
# MOE_FUZZ_SECONDS (default 60). Extra arguments go to ctest.
set -uo pipefail
source "$(dirname "$0")/common.sh"

ASAN_DIR=${MOE_ASAN_BUILD_DIR:-$MOE_ROOT/build-asan}
FUZZ_DIR=${MOE_FUZZ_BUILD_DIR:-$MOE_ROOT/build-fuzz}
FUZZ_SECONDS=${MOE_FUZZ_SECONDS:-60}
# Stop at the first finding, with its stack; leaks are findings too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

results=()
failed=0
script_start=$SECONDS
record() {  # record NAME STATUS DETAIL
  local verdict=PASS
  if [ "$2" -ne 0 ]; then verdict=FAIL; failed=1; fi
  results+=("$(printf '%-4s  %-34s %s' "$verdict" "$1" "$3")")
  echo "== $verdict: $1 $3"
}
log_tail() {  # the end of a failed step's log, so that CI shows why
  echo "---- last lines of $1 ----"
  tail -n "${2:-40}" "$1"
  echo "----"
}

# --- Tools: the project's packages, clang, and clang's libFuzzer runtime. --------------------
MOE_PACKAGES+=(clang)
moe_install_deps
fuzzer_probe() {  # whether clang++ links a libFuzzer target
  local dir
  dir=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
    >"$dir/probe.cpp"
  clang++ -fsanitize=fuzzer "$dir/probe.cpp" -o "$dir/probe" >/dev/null 2>&1
  local status=$?
  rm -rf "$dir"
  return $status
}
if command -v clang++ >/dev/null 2>&1 && ! fuzzer_probe; then
  # Debian and Ubuntu ship libFuzzer in the compiler-rt package of clang's major version.
  major=$(clang++ -dumpversion | cut -d. -f1)
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing: libclang-rt-$major-dev (libFuzzer)"
    { apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "libclang-rt-$major-dev"; } \
      >/dev/null 2>&1 || echo "warning: could not install libclang-rt-$major-dev"
  fi
fi
moe_find_cuda || exit 1

# --- (a) ASan + UBSan build of the CPU tests and moe_run. ---------------------------------------
asan_build() {
  local start=$SECONDS log=$ASAN_DIR.build.log
  mkdir -p "$ASAN_DIR"
  # RelWithDebInfo: optimised enough that the reference tests stay within their time-outs, with
  # line numbers in every report. Sanitizers go to host C++ only (CUDA's flags are left alone).
  # The asan preset of CMakePresets.json holds the flags.
  if ! cmake -S "$MOE_ROOT" --preset asan -B "$ASAN_DIR" >"$log" 2>&1; then
    log_tail "$log"
    record "asan: configure" 1 "(log: $log)"
    return 1
  fi
  # The executables of the tests labelled cpu (test "cpu.NAME" runs target NAME), and what they
  # call: moe_run, and layer_files_tool for the run below. Nothing else of the tree is built.
  local targets=(moe_run layer_files_tool) name
  while read -r name; do
    ninja -C "$ASAN_DIR" -t query "$name" >/dev/null 2>&1 && targets+=("$name")
  done < <(ctest --test-dir "$ASAN_DIR" -N -L cpu | sed -n 's/^ *Test *#[0-9]*: cpu\.//p')
  if ! cmake --build "$ASAN_DIR" -j "$(nproc)" --target "${targets[@]}" >>"$log" 2>&1; then
    log_tail "$log"
    record "asan: build" 1 "(log: $log)"
    return 1
  fi
  record "asan: build" 0 "(${#targets[@]} targets, $((SECONDS - start)) s)"
}

asan_ctest() {
  local start=$SECONDS log=$ASAN_DIR/ctest.log
  # install_consumer installs the whole tree and builds an uninstrumented project against it: the
  # regular build runs it.
  ctest --test-dir "$ASAN_DIR" -L cpu -E '^cpu\.install_consumer$' --output-on-failure "$@" \
    >"$log" 2>&1
  local status=$?
  [ $status -ne 0 ] && log_tail "$log" 80
  record "asan: ctest -L cpu" $status "($(grep -Eo '[0-9]+% tests passed.*' "$log" | head -1), \
$((SECONDS - start)) s)"
}

# expect_refusal LOG TEXT ARGS...: `moe_run --reference ARGS` exits with 1 and says TEXT (a
# sanitizer report aborts instead, which fails here).
expect_refusal() {
  local log=$1 text=$2
  shift 2
  "$ASAN_DIR/apps/moe_run" --reference "$@" >>"$log" 2>&1
  local code=$?
  if [ $code -ne 1 ] || ! tail -n 3 "$log" | grep -qF -- "$text"; then
    echo "expected exit 1 and '$text', got exit $code" >>"$log"
    return 1
  fi
}

# moe_run --reference on small files (written by layer_files_tool, fresh random values): a good
# run whose results file is read back, then bad input refused with a message.
asan_moe_run() {
  local dir status=0 log=$ASAN_DIR/moe_run.log
  dir=$(mktemp -d)
  local tool=$ASAN_DIR/tests/layer_files_tool moe_run=$ASAN_DIR/apps/moe_run
  # The results file read back (compared with itself: every tensor read and converted).
  local files=(--config "$dir/config.yaml" --weights "$dir/weights.safetensors"
               --inputs "$dir/inputs.safetensors")
  {
    "$tool" make "$dir" "$RANDOM$RANDOM" &&
      "$moe_run" --reference "${files[@]}" --out "$dir/out.safetensors" &&
      "$tool" compare "$dir/out.safetensors" "$dir/out.safetensors" 0
  } >"$log" 2>&1 || status=1
  expect_refusal "$log" "refusing to overwrite an input" "${files[@]}" \
    --out "$dir/weights.safetensors" || status=1
  printf '\x10\x00\x00\x00\x00\x00\x00\x00{"x":[1,2,3]}   ' >"$dir/bad.safetensors"
  expect_refusal "$log" "tensor 'x' has the entry" --config "$dir/config.yaml" \
    --weights "$dir/weights.safetensors" --inputs "$dir/bad.safetensors" \
    --out "$dir/o.safetensors" || status=1
  sed 's/^align_size:.*/align_size: 2000000000/' "$dir/config.yaml" >"$dir/align.yaml"
  expect_refusal "$log" "align_size = 2000000000 must be in" --config "$dir/align.yaml" \
    --weights "$dir/weights.safetensors" --inputs "$dir/inputs.safetensors" \
    --out "$dir/o.safetensors" || status=1
  rm -rf "$dir"
  [ $status -ne 0 ] && log_tail "$log"
  record "asan: moe_run --reference" $status "(a run and 3 refusals)"
}

# --- (b) libFuzzer targets. --------------------------------------------------------------------
fuzz_build() {
  local start=$SECONDS log=$FUZZ_DIR.build.log
  mkdir -p "$FUZZ_DIR"
  if ! { CXX=clang++ cmake -S "$MOE_ROOT/fuzz" -B "$FUZZ_DIR" -G Ninja &&
         cmake --build "$FUZZ_DIR" -j "$(nproc)"; } >"$log" 2>&1; then
    log_tail "$log"
    record "fuzz: build" 1 "(log: $log)"
    return 1
  fi
  record "fuzz: build" 0 "($((SECONDS - start)) s)"
}

# Both targets at once (one core each). New inputs go to a scratch corpus, not to the committed
# seeds; a crash, leak, sanitizer report or time-out leaves its input in $FUZZ_DIR/artifacts.
fuzz_run() {
  local target pids=() names=()
  mkdir -p "$FUZZ_DIR/artifacts"
  for target in safetensors config; do
    rm -rf "$FUZZ_DIR/corpus-$target"
    mkdir -p "$FUZZ_DIR/corpus-$target"
    "$FUZZ_DIR/fuzz_$target" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$FUZZ_DIR/artifacts/$target-" \
      "$FUZZ_DIR/corpus-$target" "$MOE_ROOT/fuzz/corpus/$target" >"$FUZZ_DIR/$target.log" 2>&1 &
    pids+=($!)
    names+=("$target")
  done
  local i status runs
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    status=$?
    target=${names[$i]}
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$FUZZ_DIR/$target.log")
    [ $status -ne 0 ] && log_tail "$FUZZ_DIR/$target.log" 60
    record "fuzz: fuzz_$target" $status "(${runs:-?} executions in ${FUZZ_SECONDS} s)"
  done
}

if asan_build; then
  asan_ctest "$@"
  asan_moe_run
fi
if ! command -v clang++ >/dev/null 2>&1 || ! fuzzer_probe; then
  record "fuzz: toolchain" 1 "(clang++ with libFuzzer is missing)"
elif fuzz_build; then
  fuzz_run
fi

echo
echo "== ci-hardening summary ($((SECONDS - script_start)) s)"
printf '%s\n' "${results[@]}"
if [ $failed -ne 0 ]; then
  echo "== ci-hardening: FAILED"
  exit 1
fi
echo "== ci-hardening: all passed"
