#!/usr/bin/env bash
# check_layers.sh SOURCE_DIR: the dependency arrows point only downward (docs/design.md,
# "Repository layout"): apps → MoEBlock → stages → kernels → core, comm below the exchange.
# Fails naming every project include that points up or sideways.
set -uo pipefail
root=$1
cd "$root" || exit 2
status=0

# allowed FOLDER REGEX: the project headers that FOLDER's files may include ("x.h" of the same
# folder always may).
allowed() {
  local folder=$1 pattern=$2 file line target
  while IFS= read -r line; do
    file=${line%%:*}
    target=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"${line#*:}")
    [[ "$target" == */* ]] || continue  # a header beside the file
    if ! [[ "$target" =~ $pattern ]]; then
      echo "layering: $file includes \"$target\", which $folder/ must not depend on"
      status=1
    fi
  done < <(grep -rnH --include='*.h' --include='*.cuh' --include='*.cpp' --include='*.cu' \
             '^#include "' "$folder" | sed -E 's/^([^:]+):[0-9]+:/\1:/')
}

core='moe/(error|device|tensor|types|config)\.h'
allowed include/moe "^moe/"
allowed core "^(($core)|core/(input_file|printable)\.h)$"
# core/driver_entry.h: the driver's calls found at run time, for the tensor maps and the stream
# barrier.
allowed kernels "^(moe/(error|device|tensor|types)\.h|core/driver_entry\.h|kernels/.*)$"
allowed comm "^(($core)|core/driver_entry\.h|moe/mesh\.h|comm/.*)$"
allowed reference "^(($core)|reference/.*)$"
allowed io "^(($core)|core/input_file\.h|moe/safetensors\.h|io/.*|reference/.*)$"
allowed src "^(moe/.*|kernels/.*|comm/.*|src/.*)$"

# The installed headers name nothing outside include/.
if grep -rn '#include "' include/moe | grep -vE '#include "moe/'; then status=1; fi
[ $status -eq 0 ] && echo "layering: every include points downward"
exit $status
