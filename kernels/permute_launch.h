// The host side that the permute kernels share: their block geometry, the padding of an
// expert-major buffer (zeroed by a row kernel's extra blocks), the checks of the row tensors, and
// the choice of element type and pack width for a row kernel.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "moe/tensor.h"

namespace moe::permute_detail {

constexpr int kWarpSize = 32;
constexpr int kRowWarps = 4;  // warps per block of the row kernels: one token (or row) each
constexpr int kScanThreads = 1024;

// The alignment padding of an expert-major buffer: rows [offsets[g] + counts[g], offsets[g + 1])
// of every group g, zeroed by `groups` extra blocks at the end of a row kernel's grid (a separate
// launch costs more than the zeroing: 5-7 µs per stage at T = 8192, H = 2048).
struct Padding {
  const std::int32_t* offsets = nullptr;
  const std::int32_t* counts = nullptr;
  int groups = 0;
  float* scalars = nullptr;  // the floats beside the rows, zeroed with them (may be null)
};

// Blocks of a row kernel over `rows` rows (one warp each) followed by the padding blocks.
unsigned row_grid(std::int64_t rows, const Padding& pad);

void check_activation(const Tensor& t, const char* what);
void check_same_width(const Tensor& a, const Tensor& b, const char* what);
void check_topk(int topk, const char* what);
// The floats that travel beside the rows come in pairs: a source and a destination, or neither.
void check_scalar_pair(const void* from, const void* to, const char* what, const char* from_name,
                       const char* to_name);

// Calls launch.operator()<T, kElems>() with 16-byte packs when every row allows them.
template <typename Launch>
void dispatch_rows(const Tensor& reference, std::initializer_list<const void*> pointers,
                   Launch&& launch) {
  const auto hidden = reference.dim(1);
  const bool bf16 = reference.dtype == DType::kBF16;
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(reference.dtype);
  bool vector = row_bytes % 16 == 0;
  for (const void* p : pointers) vector = vector && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  if (bf16) {
    if (vector) return launch.template operator()<__nv_bfloat16, 8>();
    return launch.template operator()<__nv_bfloat16, 1>();
  }
  if (vector) return launch.template operator()<float, 4>();
  launch.template operator()<float, 1>();
}

// Calls launch.operator()<kSlots>() with the smallest slot bucket that holds topk: a top-2
// layer's kernel must not pay a top-16 layer's registers.
template <typename Launch>
void dispatch_slots(int topk, Launch&& launch) {
  if (topk <= 2) return launch.template operator()<2>();
  if (topk <= 4) return launch.template operator()<4>();
  if (topk <= 8) return launch.template operator()<8>();
  launch.template operator()<16>();
}

}  // namespace moe::permute_detail
