# Sourced by the test scripts that launch apps under mpirun: `require_gpus COUNT_BIN WHAT` sets
# $gpus to the visible GPU count, or exits 77 (ctest: skipped) when there is none; it also sets
# what mpirun and NCCL need here.
require_gpus() {
  gpus=$("$1" 2>/dev/null || echo 0)
  if [ "${gpus:-0}" -eq 0 ]; then
    echo "SKIPPED: no CUDA GPU visible; $2 needs at least one."
    exit 77
  fi
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
  if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
}
