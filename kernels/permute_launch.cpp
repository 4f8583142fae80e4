#include "permute_launch.h"

#include <string>

#include "moe/error.h"
#include "moe/types.h"

namespace moe::permute_detail {

void check_activation(const Tensor& t, const char* what) {
  if (t.dtype != DType::kBF16 && t.dtype != DType::kFP32) {
    fail(std::string(what) + ": dtype " + std::string(dtype_name(t.dtype)) +
         " must be bf16 or fp32");
  }
  if (t.rank() != 2) fail(std::string(what) + ": expected a [rows, H] matrix, got " + t.describe());
}

void check_same_width(const Tensor& a, const Tensor& b, const char* what) {
  if (a.dtype != b.dtype || a.dim(1) != b.dim(1)) {
    fail(std::string(what) + ": " + a.describe() + " and " + b.describe() +
         " differ in dtype or H");
  }
}

void check_topk(int topk, const char* what) {
  if (topk < 1 || topk > kMaxTopK) {
    fail(std::string(what) + ": topk = " + std::to_string(topk) + " must be in [1, " +
         std::to_string(kMaxTopK) + "]");
  }
}

void check_scalar_pair(const void* from, const void* to, const char* what, const char* from_name,
                       const char* to_name) {
  if ((from == nullptr) != (to == nullptr)) {
    fail(std::string(what) + ": " + from_name + " and " + to_name +
         " must be given together (got " + (from ? "" : "no ") + from_name + ", " +
         (to ? "" : "no ") + to_name + ")");
  }
}

unsigned row_grid(std::int64_t rows, const Padding& pad) {
  return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps + pad.groups);
}

}  // namespace moe::permute_detail
