#include "moe/tensor.h"

#include <bit>
#include <cmath>
#include <cstdint>

#include <fmt/ranges.h>

#include "core/printable.h"
#include "moe/error.h"

namespace moe {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kFP32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  fail("unknown DType {}", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP32:
      return "fp32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

DType parse_dtype(std::string_view text, std::string_view what) {
  if (text == "bf16") return DType::kBF16;
  if (text == "fp32") return DType::kFP32;
  if (text == "int32") return DType::kInt32;
  fail("{} = '{}' is not a dtype: expected bf16, fp32 or int32", what, printable(text));
}

BF16 to_bf16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return BF16{static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return BF16{static_cast<std::uint16_t>((bits + rounding) >> 16)};
}

float from_bf16(BF16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

void to_bf16(std::span<const float> in, std::span<BF16> out) {
  if (in.size() != out.size()) fail("to_bf16: {} inputs but {} outputs", in.size(), out.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = to_bf16(in[i]);
}

void from_bf16(std::span<const BF16> in, std::span<float> out) {
  if (in.size() != out.size()) fail("from_bf16: {} inputs but {} outputs", in.size(), out.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = from_bf16(in[i]);
}

std::int64_t Tensor::numel() const {
  std::int64_t count = 1;
  for (const auto extent : shape) count *= extent;
  return count;
}

std::string Tensor::describe() const {
  return fmt::format("{}[{}]", dtype_name(dtype), fmt::join(shape, ", "));
}

void expect_tensor(const Tensor& tensor, std::string_view what, DType dtype,
                   std::initializer_list<std::int64_t> shape) {
  const Tensor expected(nullptr, dtype, shape);
  if (tensor.dtype != dtype || tensor.shape != expected.shape) {
    fail("{}: expected {}, got {}", what, expected.describe(), tensor.describe());
  }
  if (tensor.data == nullptr && tensor.numel() > 0) fail("{}: null data pointer", what);
}

void expect_aligned(const Tensor& tensor, std::string_view what, std::size_t bytes) {
  const auto address = reinterpret_cast<std::uintptr_t>(tensor.data);
  if (bytes > 0 && address % bytes != 0) {
    fail("{}: data = {:#x} must be {}-byte aligned (the layer reads it {} bytes at a time)", what,
         address, bytes, bytes);
  }
}

}  // namespace moe
