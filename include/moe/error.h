// moe::Error and the checks that turn every failed CUDA, cuBLASLt, NCCL or MPI call into one.
//
// Library code never exits or aborts: a failure becomes a moe::Error whose message names the call,
// the file and the line, so the trainer decides what to do.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe {

// A message as it may reach a terminal or a log: control characters other than newline and tab
// written as \xNN (a NUL would end the C string what() gives, an escape sequence would drive the
// terminal), and at most kMaxErrorBytes, the rest counted (a message quoting a file's text must not
// grow with the file).
inline constexpr std::size_t kMaxErrorBytes = 4096;
inline std::string readable_message(std::string_view message) {
  std::string out;
  out.reserve(std::min(message.size(), kMaxErrorBytes));
  std::size_t used = 0;
  for (; used < message.size(); ++used) {
    const auto c = static_cast<unsigned char>(message[used]);
    const bool control = (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f;
    const std::size_t width = control ? 4 : 1;
    // Cut before a character that would pass the bound, and never inside a UTF-8 sequence.
    if (out.size() + width > kMaxErrorBytes) {
      while (used > 0 && out.size() > 0 &&
             (static_cast<unsigned char>(message[used]) & 0xC0) == 0x80) {
        --used;
        out.pop_back();
      }
      break;
    }
    if (control) {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (used < message.size())
    out += " ... (" + std::to_string(message.size() - used) + " more bytes)";
  return out;
}

// A value a user gave (a config's text, say), as an error quotes it: its first `limit` bytes
// (never cut inside a UTF-8 sequence), then how many more there were. A message names the value
// without growing with it.
inline std::string excerpt(std::string_view text, std::size_t limit = 64) {
  if (text.size() <= limit) return std::string(text);
  std::size_t cut = limit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return std::string(text.substr(0, cut)) + " ... (" + std::to_string(text.size() - cut) +
         " more bytes)";
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(readable_message(message)) {}
};

[[noreturn]] inline void fail(const std::string& message) {
  throw Error(message);
}

}  // namespace moe

// fmt does not compile under nvcc (its constexpr machinery trips the CUDA front end), so .cu files
// get the plain-string fail() above and build their messages by hand; host code formats.
#if !defined(__CUDACC__)
#include <fmt/format.h>

namespace moe {
// Throws moe::Error with a formatted message; the format string is checked at compile time.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}
}  // namespace moe
#endif

namespace moe {

namespace detail {
void check_cuda(cudaError_t status, std::string_view call, const char* file, int line);
void check_cublas(cublasStatus_t status, std::string_view call, const char* file, int line);
void check_nccl(ncclResult_t status, std::string_view call, const char* file, int line);
// MPI calls return an int; taking it as such keeps mpi.h out of this header.
void check_mpi(int status, std::string_view call, const char* file, int line);
}  // namespace detail

}  // namespace moe

#define MOE_CHECK_CUDA(call) ::moe::detail::check_cuda((call), #call, __FILE__, __LINE__)
#define MOE_CHECK_CUBLAS(call) ::moe::detail::check_cublas((call), #call, __FILE__, __LINE__)
#define MOE_CHECK_NCCL(call) ::moe::detail::check_nccl((call), #call, __FILE__, __LINE__)
#define MOE_CHECK_MPI(call) ::moe::detail::check_mpi((call), #call, __FILE__, __LINE__)
// After a kernel launch: catches bad launch configurations at the launch site.
#define MOE_CHECK_LAUNCH() \
  ::moe::detail::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
