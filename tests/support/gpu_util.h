// Device buffers for tests: upload, download, poison.
#pragma once

#include <cstring>
#include <vector>

#include "moe/device.h"
#include "moe/tensor.h"
#include "reference/reference.h"
#include "support/test_util.h"

namespace moe::test {

template <typename T>
DeviceBuffer upload(const std::vector<T>& values) {
  DeviceBuffer buffer(std::max<std::size_t>(values.size() * sizeof(T), 16));
  copy_to_device(buffer.data(), values.data(), values.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buffer, std::size_t count) {
  std::vector<T> values(count);
  copy_to_host(values.data(), buffer.data(), count * sizeof(T));
  return values;
}

// All bytes 0xFF: NaN as fp32 or bf16, -1 as int32. Outputs are poisoned before every launch so
// that an element a kernel failed to write can never pass.
// Waits for the fill: cudaMemset runs on the legacy default stream, which does not order the
// tests' non-blocking streams, and a large fill still running could land after the kernel under
// test wrote its output (seen as NaN in dprob at T = 65536, seed 17115714651638029931).
inline void poison(const DeviceBuffer& buffer) {
  MOE_CHECK_CUDA(cudaMemset(buffer.data(), 0xFF, buffer.bytes()));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
}

// A matrix's device copy in `dtype`.
inline DeviceBuffer upload_as(const reference::Matrix& m, DType dtype) {
  if (dtype == DType::kBF16) {
    std::vector<BF16> values(m.data.size());
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = to_bf16(static_cast<float>(m.data[i]));
    return upload(values);
  }
  std::vector<float> values(m.data.begin(), m.data.end());
  return upload(values);
}

// rows × cols values at device address `data`, stored in `dtype` (bf16 or fp32), back in fp64:
// the values as the device holds them.
inline reference::Matrix download_matrix(const void* data, std::int64_t rows, std::int64_t cols,
                                         DType dtype) {
  reference::Matrix m(rows, cols);
  const auto n = static_cast<std::size_t>(rows * cols);
  if (dtype == DType::kBF16) {
    std::vector<BF16> v(n);
    copy_to_host(v.data(), data, n * sizeof(BF16));
    for (std::size_t i = 0; i < n; ++i) m.data[i] = from_bf16(v[i]);
  } else {
    std::vector<float> v(n);
    copy_to_host(v.data(), data, n * sizeof(float));
    for (std::size_t i = 0; i < n; ++i) m.data[i] = v[i];
  }
  return m;
}
inline reference::Matrix download_matrix(const DeviceBuffer& buffer, std::int64_t rows,
                                         std::int64_t cols, DType dtype) {
  return download_matrix(buffer.data(), rows, cols, dtype);
}

inline std::vector<double> to_double(const std::vector<float>& values) {
  return {values.begin(), values.end()};
}

}  // namespace moe::test
