// The apps' output files (moe_run --out, moe_bench --json, moe_train --save), checked before
// anything runs: a results file is written after the whole run, and a run that ends in an error
// its first second could have found wastes the run.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"

namespace moe::cli {

// Whether a file can be created in `directory`: a file of a name of its own (mkstemp) is created
// there and removed at once. errno's text where it cannot.
inline std::string cannot_create_in(const std::filesystem::path& directory) {
  std::string probe =
      ((directory.empty() ? std::filesystem::path(".") : directory) / ".moe_output_probe.XXXXXX")
          .string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return {};
}

// Whether a file renamed over `file` would replace it: always where it does not exist; in a
// directory with the sticky bit (/tmp), only for the file's owner, the directory's, or root
// (rename(2) fails with EPERM otherwise, at the end of the run).
inline bool may_replace(const std::filesystem::path& file) {
  struct stat file_status {};
  struct stat directory_status {};
  const std::filesystem::path directory = file.parent_path().empty() ? "." : file.parent_path();
  if (::lstat(file.c_str(), &file_status) != 0 || ::stat(directory.c_str(), &directory_status) != 0)
    return true;  // nothing there to replace, or nothing known: the run's own error stands
  if ((directory_status.st_mode & S_ISVTX) == 0) return true;
  const uid_t me = ::geteuid();
  return me == 0 || file_status.st_uid == me || directory_status.st_uid == me;
}

// How an app writes its output file.
enum class Written {
  kBesideThenRenamed,  // to a temporary file beside it, renamed over it (the results, checkpoints)
  kInPlace,            // opened and written where it is (the JSON reports)
};

// Whether two paths name one file: the same path after resolving `.`, `..` and links (the file
// need not exist yet: both are made absolute first, since weakly_canonical leaves a relative path
// to a missing file relative, and `x` would not match `./x`), or the same existing file (a hard
// link).
inline bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  namespace fs = std::filesystem;
  std::error_code equivalent_error, a_error, b_error;
  if (fs::equivalent(a, b, equivalent_error) && !equivalent_error) return true;
  const fs::path a_absolute = fs::absolute(a, a_error), b_absolute = fs::absolute(b, b_error);
  if (a_error || b_error) return false;
  const fs::path a_resolved = fs::weakly_canonical(a_absolute, a_error);
  const fs::path b_resolved = fs::weakly_canonical(b_absolute, b_error);
  return !a_error && !b_error && a_resolved == b_resolved;
}

// Refuses `path`, the value of `option`, where writing it at the end of a run would fail or harm:
// empty; a value that looks like the next option (`--out --no-check-finite` gives --out that
// text, and the flag is lost); what check_output_path refuses; a directory that takes no new
// file (or, written in place, an existing file that does not open for writing); or one of
// `inputs` ({option, path}), as a path after resolving `.`, `..` and links, or as the same file
// (a hard link).
inline void check_output_file(const std::string& option, const std::string& path,
                              const std::vector<std::pair<std::string, std::string>>& inputs,
                              Written written = Written::kBesideThenRenamed) {
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
  // The directory the file lands in, links resolved, must take a new file; a file written in
  // place that exists needs only to open for writing.
  std::error_code resolve_error;
  fs::path target = fs::weakly_canonical(file, resolve_error);
  if (resolve_error) target = file;
  if (written == Written::kInPlace && fs::exists(target, resolve_error)) {
    if (::access(target.c_str(), W_OK) != 0)
      fail("{} '{}' cannot be written ({})", option, path, std::strerror(errno));
  } else if (const std::string why = cannot_create_in(target.parent_path()); !why.empty()) {
    fail("{} '{}': no file can be created in its directory '{}' ({})", option, path,
         target.parent_path().empty() ? "." : target.parent_path().string(), why);
  } else if (written == Written::kBesideThenRenamed && !may_replace(target)) {
    fail(
        "{} '{}' belongs to another user in a directory that only a file's owner may replace "
        "files in (its sticky bit): the results could not be renamed over it",
        option, path);
  }
  for (const auto& [input_option, input] : inputs) {
    if (same_file(path, input)) {
      fail("{} '{}' is the {} file '{}': refusing to overwrite an input", option, path,
           input_option, input);
    }
  }
}

}  // namespace moe::cli
