// A file an app is writing, removed when a signal ends the process (mpirun's SIGTERM to the ranks
// once one has failed, Ctrl-C, a closed terminal): such an end runs no destructor, so the file,
// as large as the results, would stay behind under its hidden temporary name.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
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

// While it lives, SIGTERM, SIGINT and SIGHUP remove `path`, then end the process as their default
// action does; a signal the process ignores (SIGHUP under nohup, SIGINT in a background job) ends
// nothing and stays ignored. One at a time; the handlers before it come back when it goes.
class RemoveOnSignal {
 public:
  explicit RemoveOnSignal(const std::filesystem::path& path) {
    const std::string text = path.string();
    if (detail::removal_armed != 0) fail("RemoveOnSignal: one file at a time ({})", text);
    if (text.empty() || text.size() >= sizeof(detail::removal_path))
      fail("RemoveOnSignal: a path of {} bytes", text.size());
    std::memcpy(detail::removal_path, text.c_str(), text.size() + 1);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the path before the flag
    detail::removal_armed = 1;
    struct sigaction action {};
    action.sa_handler = detail::remove_then_end;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < std::size(detail::kRemovalSignals); ++i) {
      const int signal_number = detail::kRemovalSignals[i];
      struct sigaction current {};
      bool ok = ::sigaction(signal_number, nullptr, &current) == 0;
      if (ok && current.sa_handler == SIG_IGN) continue;
      ok = ok && ::sigaction(signal_number, &action, &before_[i]) == 0;
      if (!ok) {
        const int error = errno;
        restore();
        fail("RemoveOnSignal: sigaction({}) failed: {}", signal_number, std::strerror(error));
      }
      installed_[i] = true;
    }
  }
  ~RemoveOnSignal() { restore(); }
  RemoveOnSignal(const RemoveOnSignal&) = delete;
  RemoveOnSignal& operator=(const RemoveOnSignal&) = delete;

 private:
  // The handlers before, back (best effort: a destructor has no one to tell), and disarmed.
  void restore() noexcept {
    for (std::size_t i = 0; i < std::size(detail::kRemovalSignals); ++i) {
      if (installed_[i]) ::sigaction(detail::kRemovalSignals[i], &before_[i], nullptr);
      installed_[i] = false;
    }
    detail::removal_armed = 0;
  }

  struct sigaction before_[std::size(detail::kRemovalSignals)] = {};
  bool installed_[std::size(detail::kRemovalSignals)] = {};
};

}  // namespace moe::cli
