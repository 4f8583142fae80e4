#include "io/tensor_values.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "moe/error.h"

namespace moe {
namespace {

bool floating(FileDType dtype) {
  return dtype == FileDType::kBF16 || dtype == FileDType::kF32;
}

// The values of a BF16 or F32 tensor's bytes as floats (every BF16 and F32 value is a float
// exactly), read element by element with memcpy: no alignment assumed.
std::vector<float> float_values(const FileTensor& t) {
  const std::size_t element = file_dtype_size(t.dtype);
  std::vector<float> values(t.data.size() / element);
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (t.dtype == FileDType::kBF16) {
      BF16 raw;
      std::memcpy(&raw, t.data.data() + i * 2, 2);
      values[i] = from_bf16(raw);
    } else {
      std::memcpy(&values[i], t.data.data() + i * 4, 4);
    }
  }
  return values;
}

// A file's value as the layer holds it: bf16 rounds, and a finite F32 value beyond bf16's range
// becomes an infinity there.
float as_held(float value, DType held) {
  return held == DType::kBF16 ? from_bf16(to_bf16(value)) : value;
}

// The values met while scanning elements [first, first + count) of one tensor that are NaN or Inf
// as the layer holds them (`held`): NaN or Inf in the file, or finite there and beyond bf16's
// range.
class NonFiniteScan {
 public:
  explicit NonFiniteScan(DType held) : held_(held) {}
  void scan(std::span<const float> values, std::int64_t first_index) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(as_held(values[i], held_)) && count_++ == 0) {
        first_ = first_index + static_cast<std::int64_t>(i);
        value_ = values[i];
      }
    }
  }

  // Throws unless every element scanned was finite. The first bad element is named by its index
  // in every dimension of the whole tensor, as a framework would print it.
  void check(const TensorSource& file, const std::string& name, const TensorInfo& info,
             std::int64_t first, std::int64_t count) const {
    if (count_ == 0) return;
    std::vector<std::int64_t> index(info.shape.size());
    std::int64_t rest = first_;
    for (std::size_t d = info.shape.size(); d-- > 0;) {
      index[d] = rest % info.shape[d];
      rest /= info.shape[d];
    }
    const std::string among =
        first == 0 && count == info.numel
            ? fmt::format("of its {} elements", info.numel)
            : fmt::format("of its elements [{}, {}) read here", first, first + count);
    const char* counted = held_ == DType::kBF16 ? "are NaN, Inf or beyond bf16" : "are NaN or Inf";
    if (std::isfinite(value_)) {
      fail(
          "{}: tensor '{}' holds {} at [{}], beyond the range of bf16, the dtype the layer holds "
          "it in ({} {} {})",
          file.source(), name, value_, fmt::join(index, ", "), count_, among, counted);
    }
    fail("{}: tensor '{}' holds {} at [{}] ({} {} {})", file.source(), name,
         static_cast<double>(value_), fmt::join(index, ", "), count_, among, counted);
  }

 private:
  DType held_;
  std::int64_t count_ = 0;
  std::int64_t first_ = 0;
  float value_ = 0.0f;
};

// Elements [first, first + count) of `name` (a range already checked) read piece by piece, each
// piece handed to `use` as floats with the index of its first element.
template <typename Use>
void for_each_piece(const TensorSource& file, const std::string& name, std::int64_t first,
                    std::int64_t count, Use&& use) {
  for (std::int64_t done = 0; done < count; done += kPieceElements) {
    const std::int64_t n = std::min(kPieceElements, count - done);
    const std::vector<float> values = float_values(file.read_range(name, first + done, n));
    use(std::span<const float>(values), first + done);
  }
}

}  // namespace

std::vector<double> file_values(const FileTensor& t, std::string_view name, DType held) {
  if (!floating(t.dtype))
    fail("tensor '{}' is {}, not a floating-point type", name, file_dtype_name(t.dtype));
  // FileTensor's fields are public: the bytes are checked against the shape before being read.
  const auto n = static_cast<std::size_t>(t.numel());
  const std::size_t element = file_dtype_size(t.dtype);
  if (t.data.size() % element != 0 || t.data.size() / element != n) {
    fail("tensor '{}' holds {} bytes but {}[{}] needs {} elements of {} bytes", name, t.data.size(),
         file_dtype_name(t.dtype), fmt::join(t.shape, ", "), n, element);
  }
  std::vector<float> values = float_values(t);
  if (held == DType::kBF16) {
    for (float& v : values) v = from_bf16(to_bf16(v));
  } else if (held != DType::kFP32) {
    fail("file_values: tensor '{}' is held as bf16 or fp32, not as {}", name, dtype_name(held));
  }
  return {values.begin(), values.end()};
}

void check_finite(const TensorSource& file, DType held,
                  std::span<const std::string_view> held_in_fp32) {
  for (const auto& name : file.names()) {
    const TensorInfo info = file.info(name);
    if (!floating(info.dtype)) continue;
    const bool fp32 =
        std::find(held_in_fp32.begin(), held_in_fp32.end(), name) != held_in_fp32.end();
    NonFiniteScan scan(fp32 ? DType::kFP32 : held);
    for_each_piece(file, name, 0, info.numel,
                   [&](std::span<const float> values, std::int64_t at) { scan.scan(values, at); });
    scan.check(file, name, info, 0, info.numel);
  }
}

std::vector<std::byte> read_as(const TensorSource& file, const std::string& name,
                               std::int64_t first, std::int64_t count, DType dtype,
                               bool check_finite) {
  const TensorInfo info = file.check_range(name, first, count);
  if (!floating(info.dtype)) {
    fail("{}: tensor '{}' is {}; expected BF16 or F32", file.source(), name,
         file_dtype_name(info.dtype));
  }
  if (dtype != DType::kBF16 && dtype != DType::kFP32)
    fail("read_as: tensor '{}' is read as bf16 or fp32, not as {}", name, dtype_name(dtype));
  const std::size_t size = dtype_size(dtype);
  std::vector<std::byte> out(static_cast<std::size_t>(count) * size);
  NonFiniteScan scan(dtype);
  for_each_piece(file, name, first, count, [&](std::span<const float> values, std::int64_t at) {
    if (check_finite) scan.scan(values, at);
    std::byte* dst = out.data() + static_cast<std::size_t>(at - first) * size;
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (dtype == DType::kBF16) {
        const BF16 b = to_bf16(values[i]);
        std::memcpy(dst + i * 2, &b, 2);
      } else {
        std::memcpy(dst + i * 4, &values[i], 4);
      }
    }
  });
  if (check_finite) scan.check(file, name, info, first, count);
  return out;
}

}  // namespace moe
