#!/usr/bin/env bash
# rank_exit.sh GPU_COUNT_BIN TEST_BIN
# A rank that exits in the middle of a step (test_fault_injection's "[.rank-exits]" case) ends the
# job within a bound: mpirun returns non-zero well before the limit below, never hangs.
# Exits 77 (ctest: skipped) with fewer than two GPUs.
set -u
count_bin=$1 test_bin=$2
gpus=$("$count_bin" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "SKIPPED: a rank that exits needs two ranks, one GPU each; $gpus GPU(s) visible."
  exit 77
fi
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
limit=90
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
timeout "$limit" mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE "$test_bin" "[.rank-exits]" \
  >"$log" 2>&1
rc=$?
elapsed=$((SECONDS - start))
cat "$log"
if [ $rc -eq 124 ]; then
  echo "FAIL: the job still ran $limit s after rank 1 exited"
  exit 1
fi
if [ $rc -eq 0 ]; then
  echo "FAIL: mpirun reported success though rank 1 exited with status 3"
  exit 1
fi
if ! grep -q "\[rank 1\] exits at 'moe dispatch'" "$log"; then
  echo "FAIL: rank 1 never reached the dispatch (exit $rc)"
  exit 1
fi
echo "PASS: the job ended ${elapsed} s after it started (mpirun exit $rc)"
