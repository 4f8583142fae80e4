// A non-owning view of a contiguous row-major tensor, its element types, and host bf16 conversion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

enum class DType { kBF16, kFP32, kInt32, kInt64 };

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
// Parses "bf16" / "fp32" / "int32" (case-sensitive); throws moe::Error naming `what` otherwise.
DType parse_dtype(std::string_view text, std::string_view what = "dtype");

// Host-side bfloat16: the top 16 bits of an IEEE fp32. Same size and bits as __nv_bfloat16.
struct BF16 {
  std::uint16_t bits = 0;
};
static_assert(sizeof(BF16) == 2);

// Round to nearest even; NaN stays NaN (quiet), infinities and signed zeros are kept.
BF16 to_bf16(float value);
float from_bf16(BF16 value);
void to_bf16(std::span<const float> in, std::span<BF16> out);
void from_bf16(std::span<const BF16> in, std::span<float> out);

// Pointer, dtype and shape of a contiguous row-major tensor in device (or host) memory.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  std::vector<std::int64_t> shape;

  Tensor() = default;
  Tensor(void* data, DType dtype, std::initializer_list<std::int64_t> shape)
      : data(data), dtype(dtype), shape(shape) {}
  Tensor(void* data, DType dtype, std::vector<std::int64_t> shape)
      : data(data), dtype(dtype), shape(std::move(shape)) {}

  int rank() const { return static_cast<int>(shape.size()); }
  std::int64_t dim(int i) const { return shape.at(static_cast<std::size_t>(i)); }
  std::int64_t numel() const;
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // "bf16[4096, 7168]"
  std::string describe() const;
};

// Throws moe::Error naming `what` unless `tensor` has exactly this dtype and shape.
void expect_tensor(const Tensor& tensor, std::string_view what, DType dtype,
                   std::initializer_list<std::int64_t> shape);
// Throws moe::Error naming `what` and its address unless tensor.data is a multiple of `bytes`:
// the layer's GEMMs and row kernels read activations and weights 16 bytes at a time.
void expect_aligned(const Tensor& tensor, std::string_view what, std::size_t bytes = 16);

}  // namespace moe
