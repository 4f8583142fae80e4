#!/usr/bin/env bash
# Runs one test binary again and again, plainly or under a compute-sanitizer tool, each run with a
# fresh seed, and records the seed and outcome of every run: the way to find a failure that shows
# once in many runs, and to replay it (MOE_TEST_SEED=<seed>).
#   scripts/repeat-test.sh [--tool memcheck|racecheck|initcheck|synccheck] [--runs N]
#                          [--seconds S] [--timeout S] [--logs DIR] BINARY [test-spec...]
# Stops after N runs (default 20) or once S seconds have passed (default 0: no limit), whichever
# comes first; a run still going after --timeout seconds (default 900) is stopped and reported
# as timed out, never as a failed check. One line per run on stdout; each run's whole output in DIR (default: a temp dir).
# Under a tool the suites run their quick sizes (MOE_TEST_QUICK=1, unless set otherwise).
# Exit status: 0 when every run passed, 1 otherwise.
set -uo pipefail

usage() {  # to stderr with status 2, or (usage 0: --help) to stdout
  local to=2
  [ "${1:-2}" = 0 ] && to=1
  echo "usage: $0 [--tool T] [--runs N] [--seconds S] [--timeout S] [--logs DIR] BINARY" \
    "[test-spec...]" >&"$to"
  exit "${1:-2}"
}
# A whole number in [low, high] for option $1, or an error naming it and the value.
count() {  # count OPTION VALUE LOW HIGH
  [[ "$2" =~ ^(0|[1-9][0-9]{0,8})$ ]] && [ "$2" -ge "$3" ] && [ "$2" -le "$4" ] ||
    { echo "error: $1 '$2' is not a whole number in [$3, $4]" >&2; exit 2; }
}
tool="" runs=20 seconds=0 logs="" per_run=900
while [ $# -gt 0 ]; do
  case $1 in
    --tool | --runs | --seconds | --logs | --timeout)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
      case $1 in
        --tool) tool=$2 ;;
        --runs) count --runs "$2" 1 1000000; runs=$2 ;;
        --seconds) count --seconds "$2" 0 100000000; seconds=$2 ;;
        --logs) logs=$2 ;;
        --timeout) count --timeout "$2" 1 100000000; per_run=$2 ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    -h | --help) usage 0 ;;
    -*) echo "error: unknown option '$1'" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
binary=$1
shift
[ -f "$binary" ] && [ -x "$binary" ] || { echo "error: '$binary' is not an executable file" >&2; exit 2; }
case $tool in
  "" | memcheck | racecheck | initcheck | synccheck) ;;
  *) echo "error: --tool '$tool' must be memcheck, racecheck, initcheck or synccheck" >&2; exit 2 ;;
esac
if [ -n "$tool" ] && ! command -v compute-sanitizer >/dev/null 2>&1; then
  [ -x /usr/local/cuda/bin/compute-sanitizer ] && export PATH=/usr/local/cuda/bin:$PATH
  command -v compute-sanitizer >/dev/null 2>&1 || {
    echo "error: --tool $tool runs under compute-sanitizer, found neither on PATH nor in" \
      "/usr/local/cuda/bin" >&2
    exit 2
  }
fi
[ -n "$logs" ] || logs=$(mktemp -d)
mkdir -p "$logs" 2>/dev/null && [ -w "$logs" ] ||
  { echo "error: --logs '$logs' is not a directory this user can write" >&2; exit 2; }

name=$(basename "$binary")-${tool:-plain}
launcher=()
# --error-exitcode: a hazard the tool reports fails the run even when every check passed.
if [ -n "$tool" ]; then
  launcher=(compute-sanitizer --tool "$tool" --error-exitcode 99)
  export MOE_TEST_QUICK=${MOE_TEST_QUICK:-1}
fi

start=$SECONDS failed=0 done_runs=0
for ((i = 1; i <= runs; ++i)); do
  if [ "$seconds" -gt 0 ] && [ $((SECONDS - start)) -ge "$seconds" ]; then break; fi
  log=$logs/$name-$$-$i.log  # the PID: several loops may share DIR
  run_start=$SECONDS
  timeout "$per_run" "${launcher[@]}" "$binary" "$@" >"$log" 2>&1
  rc=$?
  done_runs=$i
  seed=$(grep -m1 -oE "test seed: [0-9]+" "$log" | grep -oE "[0-9]+$")
  assertions=$(grep -E "^(test cases|assertions|All tests passed)" "$log" | tr -s '\n ' ' ')
  if [ $rc -eq 124 ]; then
    failed=$((failed + 1))
    echo "$name run $i: TIMED OUT after $per_run s, seed ${seed:-?}, log $log"
  elif [ $rc -eq 0 ]; then
    echo "$name run $i: pass, seed ${seed:-?}, $((SECONDS - run_start)) s (${assertions:-no summary})"
  else
    failed=$((failed + 1))
    echo "$name run $i: FAIL (exit $rc), seed ${seed:-?}, $((SECONDS - run_start)) s (${assertions:-no summary}), log $log"
    # The failed checks with the context Catch printed for them (file:line, INFO lines, values).
    grep -B3 -A12 -E "FAILED|ERROR SUMMARY: [1-9]|Race reported|Hazard" "$log" | head -60 | sed 's/^/    /'
  fi
done
echo "$name: $((done_runs - failed)) of $done_runs runs passed"
[ $failed -eq 0 ]
