#include "bench/streaming_pass.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "moe/error.h"

namespace moe::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte words in flight per thread

// Word i < words of `out` is word i of `first` xor word i of `second` (each where it exists). Words
// read but not written fold into `kept`, and a store that no real data triggers keeps those reads
// from being optimised away.
__global__ void __launch_bounds__(kThreads)
    streaming_pass_kernel(const uint4* __restrict__ first, std::size_t first_words,
                          const uint4* __restrict__ second, std::size_t second_words,
                          uint4* __restrict__ out, std::size_t out_words, std::size_t words) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  unsigned kept = 0;
  for (std::size_t base = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x;
       base < words; base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      v[u] = i < first_words ? first[i] : make_uint4(0, 0, 0, 0);
      if (i < second_words) {
        const uint4 w = second[i];
        v[u] = make_uint4(v[u].x ^ w.x, v[u].y ^ w.y, v[u].z ^ w.z, v[u].w ^ w.w);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      if (i < out_words) {
        out[i] = v[u];
      } else {
        kept ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      }
    }
  }
  if (kept == 0x9e3779b9u && out_words > 0) out[0] = make_uint4(kept, 0, 0, 0);
}

std::size_t words_of(std::size_t bytes) {
  return (bytes + 15) / 16;
}

}  // namespace

void launch_streaming_pass(const StreamingPass& pass, cudaStream_t stream) {
  auto check = [](const void* buffer, std::size_t bytes, const char* name) {
    if (bytes > 0 && (buffer == nullptr || reinterpret_cast<std::uintptr_t>(buffer) % 16 != 0)) {
      throw Error(std::string("launch_streaming_pass: ") + name + " = " +
                  std::to_string(reinterpret_cast<std::uintptr_t>(buffer)) +
                  " must be a 16-byte aligned buffer for " + std::to_string(bytes) + " bytes");
    }
  };
  check(pass.first, pass.first_bytes, "first");
  check(pass.second, pass.second_bytes, "second");
  check(pass.out, pass.out_bytes, "out");
  // Every SM full (the occupancy query is remembered: it costs microseconds of host time).
  static const int max_blocks = [] {
    int device = 0, sms = 0, per_sm = 0;
    MOE_CHECK_CUDA(cudaGetDevice(&device));
    MOE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MOE_CHECK_CUDA(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, streaming_pass_kernel, kThreads, 0));
    return sms * per_sm;
  }();
  const std::size_t words = std::max(
      words_of(pass.first_bytes), std::max(words_of(pass.second_bytes), words_of(pass.out_bytes)));
  if (words == 0) return;
  const auto needed = (words + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const int blocks = static_cast<int>(std::min<std::size_t>(needed, max_blocks));
  streaming_pass_kernel<<<blocks, kThreads, 0, stream>>>(
      static_cast<const uint4*>(pass.first), words_of(pass.first_bytes),
      static_cast<const uint4*>(pass.second), words_of(pass.second_bytes),
      static_cast<uint4*>(pass.out), words_of(pass.out_bytes), words);
  MOE_CHECK_LAUNCH();
}

}  // namespace moe::bench
