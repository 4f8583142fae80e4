// The apps' output files (moe_run --out, moe_bench --json, moe_train --save), checked before
// anything runs: a results file is written after the whole run, and a run that ends in an error
// its first second could have found wastes the run.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"

namespace moe::cli {

// Refuses `path`, the value of `option`, where writing it at the end of a run would fail or harm:
// empty; a value that looks like the next option (`--out --no-check-finite` gives --out that
// text, and the flag is lost); what check_output_path refuses; or one of `inputs`
// ({option, path}), as a path after resolving `.`, `..` and links, or as the same file (a hard
// link).
inline void check_output_file(const std::string& option, const std::string& path,
                              const std::vector<std::pair<std::string, std::string>>& inputs) {
  namespace fs = std::filesystem;
  if (path.empty()) fail("{} is empty; name the file to write", option);
  if (path.front() == '-') {
    fail(
        "{} '{}' looks like an option, not a file name: {} needs its value (write ./{} for a file "
        "whose name starts with '-')",
        option, path, option, path);
  }
  const fs::path file(path);
  check_output_path(file, fmt::format("{} '{}'", option, path));
  std::error_code error;
  const fs::path resolved = fs::weakly_canonical(file, error);
  const bool resolved_ok = !error;
  for (const auto& [input_option, input] : inputs) {
    std::error_code same_error, input_error;
    const bool same_file = fs::equivalent(file, input, same_error) && !same_error;
    const fs::path input_resolved = fs::weakly_canonical(input, input_error);
    const bool same_path = resolved_ok && !input_error && input_resolved == resolved;
    if (same_file || same_path) {
      fail("{} '{}' is the {} file '{}': refusing to overwrite an input", option, path,
           input_option, input);
    }
  }
}

}  // namespace moe::cli
