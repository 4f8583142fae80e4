// A file an app is writing, removed when a signal ends the process (mpirun's SIGTERM to the ranks
// once one has failed, Ctrl-C, a closed terminal): such an end runs no destructor, so the file,
// as large as the results, would stay behind under its hidden temporary name.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "moe/error.h"

namespace moe::cli {

namespace detail {

inline constexpr int kRemovalSignals[] = {SIGTERM, SIGINT, SIGHUP};
inline char removal_path[4096];
inline volatile std::sig_atomic_t removal_armed = 0;

// Async-signal-safe: unlink, then the signal's default action, taken again.
extern "C" inline void remove_then_end(int signal_number) {
  if (removal_armed != 0) ::unlink(removal_path);
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

}  // namespace detail

// While it lives, SIGTERM, SIGINT and SIGHUP remove `path`, then end the process as they would
// have. One at a time; the handlers before it come back when it goes.
class RemoveOnSignal {
 public:
  explicit RemoveOnSignal(const std::filesystem::path& path) {
    const std::string text = path.string();
    if (detail::removal_armed != 0) fail("RemoveOnSignal: one file at a time ({})", text);
    if (text.empty() || text.size() >= sizeof(detail::removal_path))
      fail("RemoveOnSignal: a path of {} bytes", text.size());
    std::memcpy(detail::removal_path, text.c_str(), text.size() + 1);
    detail::removal_armed = 1;
    struct sigaction action {};
    action.sa_handler = detail::remove_then_end;
    sigemptyset(&action.sa_mask);
    for (; installed_ < std::size(detail::kRemovalSignals); ++installed_) {
      const int signal_number = detail::kRemovalSignals[installed_];
      if (::sigaction(signal_number, &action, &before_[installed_]) != 0) {
        const int error = errno;
        restore();
        fail("RemoveOnSignal: sigaction({}) failed: {}", signal_number, std::strerror(error));
      }
    }
  }
  ~RemoveOnSignal() { restore(); }
  RemoveOnSignal(const RemoveOnSignal&) = delete;
  RemoveOnSignal& operator=(const RemoveOnSignal&) = delete;

 private:
  // The handlers before, back (best effort: a destructor has no one to tell), and disarmed.
  void restore() noexcept {
    for (std::size_t i = 0; i < installed_; ++i)
      ::sigaction(detail::kRemovalSignals[i], &before_[i], nullptr);
    installed_ = 0;
    detail::removal_armed = 0;
  }

  struct sigaction before_[std::size(detail::kRemovalSignals)]{};
  std::size_t installed_ = 0;
};

}  // namespace moe::cli
