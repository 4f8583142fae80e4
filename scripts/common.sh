# Shared by run.sh, test.sh, gpu-check.sh and the bench-*.sh scripts (sourced, not run): install
# what is missing, configure, build, check the benchmarks' lists and that a GPU is there.
MOE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOE_BUILD_DIR=${MOE_BUILD_DIR:-$MOE_ROOT/build}
MOE_PACKAGES=(g++ libfmt-dev catch2 nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
              libopenmpi-dev openmpi-bin)
# Tools that may come from elsewhere (pip, a toolchain): installed only when the command is absent.
MOE_TOOL_PACKAGES=(cmake:cmake ninja:ninja-build python3:python3)

# Installs the Debian/Ubuntu packages that are missing, when root and apt-get exist. A failed
# install (no network, say) is reported and left to cmake to judge.
moe_install_deps() {
  command -v dpkg-query >/dev/null 2>&1 || return 0
  local missing=()
  for package in "${MOE_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$package")
  done
  for entry in "${MOE_TOOL_PACKAGES[@]}"; do
    command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing: ${missing[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
      >/dev/null 2>&1 || echo "warning: could not install ${missing[*]}; trying to build anyway"
  else
    echo "warning: missing packages (install them as root): ${missing[*]}"
  fi
}

moe_find_cuda() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  if ! command -v nvcc >/dev/null 2>&1; then
    echo "error: the CUDA toolkit (nvcc) was not found; install CUDA 12.9 or newer" >&2
    return 1
  fi
}

# Configures with a preset of CMakePresets.json (MOE_PRESET, default release; warnings as errors
# under CI) into MOE_BUILD_DIR and builds on all cores. Extra arguments go to the configure step.
MOE_PRESET=${MOE_PRESET:-release}
moe_build() {
  moe_find_cuda || return 1
  local werror=()
  [ "${CI:-}" = true ] && werror=(-DMOE_WERROR=ON)
  if [ ! -f "$MOE_BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S "$MOE_ROOT" --preset "$MOE_PRESET" -B "$MOE_BUILD_DIR" "${werror[@]}" "$@" || return 1
  else
    cmake "$MOE_BUILD_DIR" "${werror[@]}" "$@" >/dev/null || return 1
  fi
  cmake --build "$MOE_BUILD_DIR" -j "$(nproc)"
}

moe_require_gpu() {  # moe_require_gpu PROGRAM: refuses, naming PROGRAM, where no NVIDIA GPU is
  # The whole listing is read first: grep -q would stop at the first line, and nvidia-smi, still
  # writing, would then fail on the closed pipe.
  local listing
  listing=$(nvidia-smi -L 2>/dev/null) || listing=""
  if ! grep -q '^GPU ' <<<"$listing"; then
    echo "error: $1: no NVIDIA GPU here (nvidia-smi lists none)" >&2
    return 2
  fi
}

# Refuses a word of LIST given twice: each names a run, whose files the second would overwrite
# (and a summary would count twice).
moe_refuse_repeats() {  # moe_refuse_repeats OPTION "LIST"
  local option=$1 word seen=" "
  local -
  set -f
  for word in $2; do
    [[ "$seen" != *" $word "* ]] ||
      { echo "error: $option '$word' is given twice: each is one run" >&2; exit 2; }
    seen+="$word "
  done
}

# The benchmark scripts' --configs and --tokens lists: some config named, each one of configs/,
# every token count a positive integer, none twice; exits 2 with the offending value otherwise.
moe_require_configs_and_tokens() {  # moe_require_configs_and_tokens "CONFIGS" "TOKENS"
  local configs=$1 tokens=$2 t c
  local -  # the option below stays inside this function
  set -f    # the lists split on spaces alone: a '*' is no file name pattern
  [ -n "${configs// /}" ] || { echo "error: --configs names no config" >&2; exit 2; }
  for c in $configs; do
    # A name, not a path: it also names the results' files under OUTDIR.
    [[ "$c" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
      { echo "error: --configs '$c' is not a config name (a file of configs/, without .yaml)" >&2; exit 2; }
    [ -f "$MOE_ROOT/configs/$c.yaml" ] ||
      { echo "error: --configs '$c' is not one of $MOE_ROOT/configs/*.yaml" >&2; exit 2; }
  done
  for t in $tokens; do
    [[ "$t" =~ ^[1-9][0-9]{0,9}$ ]] && [ "$t" -le $((1 << 30)) ] ||
      { echo "error: --tokens '$t' is not a token count in [1, 2^30]" >&2; exit 2; }
  done
  [ -n "${tokens// /}" ] || { echo "error: --tokens names no token count" >&2; exit 2; }
  moe_refuse_repeats --configs "$configs"
  moe_refuse_repeats --tokens "$tokens"
}

# One benchmark run named NAME: COMMAND (a launcher, moe_bench and its flags) with --json
# OUTDIR/NAME.json, its output in OUTDIR/NAME.txt. The JSON joins the caller's `written` array
# where the run succeeds; else it prints FAILED with the run's last lines and sets `status=1`.
moe_bench_run() {  # moe_bench_run OUTDIR NAME COMMAND...
  local out=$1 name=$2
  shift 2
  if "$@" --json "$out/$name.json" >"$out/$name.txt" 2>&1; then
    written+=("$out/$name.json")
  else
    status=1
    echo "FAILED: $name"
    # moe_bench's own message where it gave one (under mpirun the last lines are mpirun's).
    grep -m 3 '^moe_bench: ' "$out/$name.txt" || tail -3 "$out/$name.txt"
  fi
}
