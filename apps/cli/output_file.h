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

namespace moe::cli {

// The longest name of one file that the file systems in use take.
inline constexpr std::size_t kMaxFileNameBytes = 255;

// Refuses `path`, the value of `option`, where writing it at the end of a run would fail or harm:
// empty; a value that looks like the next option (`--out --no-check-finite` gives --out that
// text, and the flag is lost); a link that leads nowhere; anything but a regular file where it
// exists (a directory, a FIFO, a device); a directory that does not exist; a file name longer than
// the file system takes; or one of `inputs` ({option, path}), as a path after resolving `.`, `..`
// and links, or as the same file (a hard link).
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
  std::error_code error;
  if (fs::is_symlink(fs::symlink_status(file, error)) && !fs::exists(file, error)) {
    fail(
        "{} '{}' is a symbolic link that leads nowhere (a missing target or a loop); name the "
        "file itself",
        option, path);
  }
  const fs::file_status status = fs::status(file, error);
  if (fs::is_directory(status)) fail("{} '{}' is a directory; name a file", option, path);
  if (fs::exists(status) && !fs::is_regular_file(status))
    fail("{} '{}' is not a regular file; results are written to regular files only", option, path);
  const fs::path directory = file.parent_path();
  if (!directory.empty() && !fs::is_directory(directory, error))
    fail("{} '{}': the directory '{}' does not exist", option, path, directory.string());
  const std::string name = file.filename().string();
  if (name.size() > kMaxFileNameBytes) {
    fail("{}: the file name '{}...' has {} bytes; file systems take at most {}", option,
         name.substr(0, 40), name.size(), kMaxFileNameBytes);
  }
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
