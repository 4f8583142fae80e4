#!/usr/bin/env bash
# install_consumer.sh BUILD_DIR SOURCE_DIR: installs the build into a scratch prefix, then builds
# and runs tests/consumer against it with find_package(moe_runtime).
set -euo pipefail
build=$1 source=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
# The fp64 reference is a development tool: the installed library defines none of its symbols.
library=$(find "$scratch/prefix" -name "libmoe_runtime.*" | head -1)
if nm -C --defined-only "$library" | grep -q "moe::reference::"; then
  echo "error: $library defines moe::reference symbols" >&2
  exit 1
fi
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S "$source/tests/consumer" -B "$scratch/build" "${generator[@]}" -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/build" >/dev/null
"$scratch/build/consumer"
