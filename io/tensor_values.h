// The values of BF16 and F32 file tensors: as doubles for the fp64 reference, converted to the
// layer's dtype for a GPU, and checked for NaN and Inf. Large tensors are read in pieces, so no
// more than one piece of a file is held beside what the caller keeps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/safetensors.h"
#include "moe/tensor.h"

namespace moe {

// Elements per piece of a tensor read in pieces: 64 MB of F32.
inline constexpr std::int64_t kPieceElements = std::int64_t{1} << 24;

// Element values of a BF16 or F32 file tensor, as doubles; `name` names it in errors (another
// dtype, or bytes that do not match the shape). `held`: the dtype a layer holds the tensor in;
// kBF16 rounds F32 values to bf16 first, as the GPU's upload does (read_as).
std::vector<double> file_values(const FileTensor& tensor, std::string_view name = "?",
                                DType held = DType::kFP32);

// Throws moe::Error naming the file, the tensor, the first NaN or Inf (its index in every
// dimension and its value) and how many there are, when a BF16 or F32 tensor of `file` is not
// finite everywhere as the layer holds it (`held`, or fp32 for the tensors named in held_in_fp32:
// under kBF16 a finite F32 value beyond bf16's range counts, named as such). Reads every tensor
// in pieces.
void check_finite(const TensorSource& file, DType held = DType::kFP32,
                  std::span<const std::string_view> held_in_fp32 = {});

// Elements [first, first + count) of BF16 or F32 tensor `name`, converted to `dtype` (kBF16 or
// kFP32) as a GPU tensor of the layer holds them: the bytes to upload. With check_finite, a NaN
// or Inf among them (or, read as kBF16, a value beyond bf16's range) is an error naming the file,
// the tensor, the first one's index in the whole tensor and how many of the elements read are
// not finite.
std::vector<std::byte> read_as(const TensorSource& file, const std::string& name,
                               std::int64_t first, std::int64_t count, DType dtype,
                               bool check_finite);

}  // namespace moe
