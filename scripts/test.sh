#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test. Tests labelled gpu and mpi report
# "Skipped" on a machine without a GPU. Extra arguments go to ctest (e.g. -L cpu).
set -euo pipefail
source "$(dirname "$0")/common.sh"
moe_install_deps
moe_build
cd "$MOE_BUILD_DIR"
ctest --output-on-failure "$@"
