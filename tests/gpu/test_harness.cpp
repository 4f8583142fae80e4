// The GPU harness: device memory, a kernel built for this architecture, and cuBLASLt products,
// each checked against host values.
#include <algorithm>
#include <cstring>
#include <random>

#include "kernels/elementwise.cuh"
#include "kernels/gemm.h"
#include "moe/device.h"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

// Uploads m (row-major, or transposed when `transposed`) in `dtype`; returns the buffer.
DeviceBuffer upload(const Matrix& m, DType dtype, bool transposed = false) {
  std::vector<float> values;
  values.reserve(m.data.size());
  if (transposed) {
    for (std::int64_t c = 0; c < m.cols; ++c) {
      for (std::int64_t r = 0; r < m.rows; ++r) values.push_back(static_cast<float>(m(r, c)));
    }
  } else {
    for (const double v : m.data) values.push_back(static_cast<float>(v));
  }
  DeviceBuffer buffer(std::max<std::size_t>(values.size() * dtype_size(dtype), 1));
  if (dtype == DType::kBF16) {
    std::vector<BF16> half(values.size());
    to_bf16(values, half);
    copy_to_device(buffer.data(), half.data(), half.size() * sizeof(BF16));
  } else {
    copy_to_device(buffer.data(), values.data(), values.size() * sizeof(float));
  }
  return buffer;
}

// The values a matrix holds once stored in dtype (what the GPU actually multiplies).
Matrix rounded(const Matrix& m, DType dtype) {
  Matrix out = m;
  for (auto& v : out.data) {
    v = dtype == DType::kBF16 ? from_bf16(to_bf16(static_cast<float>(v))) : static_cast<float>(v);
  }
  return out;
}

}  // namespace

TEST_CASE("device memory round trip", "[gpu][harness]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const std::size_t bytes : {1u, 17u, 4096u, 3u << 20}) {
    std::vector<unsigned char> data(bytes);
    for (auto& b : data) b = static_cast<unsigned char>(rng());
    DeviceBuffer buffer(bytes);
    MOE_CHECK_CUDA(cudaMemset(buffer.data(), 0xA5, bytes));
    copy_to_device(buffer.data(), data.data(), bytes);
    std::vector<unsigned char> back(bytes, 0);
    copy_to_host(back.data(), buffer.data(), bytes);
    CHECK(std::memcmp(back.data(), data.data(), bytes) == 0);
  }
  DeviceBuffer grow(1024);
  void* first = grow.data();
  grow.reserve(512);  // grow-only: a smaller request keeps the allocation
  CHECK(grow.data() == first);
  grow.reserve(4096);
  CHECK(grow.bytes() == 4096);
}

TEST_CASE("convert kernel matches host bf16 rounding bit for bit", "[gpu][harness]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  for (const std::size_t n : {1u, 1000u, 1u << 20}) {
    std::vector<float> values(n);
    for (auto& v : values) v = normal(rng);
    values[0] = std::numeric_limits<float>::infinity();
    DeviceBuffer in(n * 4), out(n * 2), back(n * 4);
    copy_to_device(in.data(), values.data(), n * 4);
    MOE_CHECK_CUDA(cudaMemset(out.data(), 0xFF, n * 2));   // poison: bf16 NaN
    MOE_CHECK_CUDA(cudaMemset(back.data(), 0xFF, n * 4));  // poison: fp32 NaN
    MOE_CHECK_CUDA(cudaDeviceSynchronize());               // the fill is on the legacy stream
    Stream stream;
    convert(Tensor(in.data(), DType::kFP32, {static_cast<std::int64_t>(n)}),
            Tensor(out.data(), DType::kBF16, {static_cast<std::int64_t>(n)}), stream.get());
    convert(Tensor(out.data(), DType::kBF16, {static_cast<std::int64_t>(n)}),
            Tensor(back.data(), DType::kFP32, {static_cast<std::int64_t>(n)}), stream.get());
    stream.synchronize();
    std::vector<BF16> got(n);
    std::vector<float> got_back(n);
    copy_to_host(got.data(), out.data(), n * 2);
    copy_to_host(got_back.data(), back.data(), n * 4);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(got[i].bits == to_bf16(values[i]).bits);
      REQUIRE(got_back[i] == from_bf16(got[i]));
    }
  }
}

TEST_CASE("cuBLASLt row-major products against the fp64 reference", "[gpu][harness][gemm]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  GemmRunner gemm;
  Stream stream;
  struct Types {
    DType in, out;
    double tolerance;
  };
  // Inputs are rounded to their dtype before the reference sees them, so only accumulation
  // order and the output's rounding remain: fp32 out ≤ 1e-5, bf16 out ≤ 1e-2 (docs/design.md,
  // "Tests").
  for (const Types types :
       {Types{DType::kFP32, DType::kFP32, 1e-5}, Types{DType::kBF16, DType::kFP32, 1e-5},
        Types{DType::kBF16, DType::kBF16, 1e-2}}) {
    for (const auto& [m, n, k] :
         {std::tuple{1, 8, 64}, std::tuple{7, 13, 33}, std::tuple{128, 256, 96},
          std::tuple{257, 64, 1000}, std::tuple{64, 48, 0}}) {
      for (const bool trans_a : {false, true}) {
        for (const bool trans_b : {false, true}) {
          INFO(dtype_name(types.in)
               << "->" << dtype_name(types.out) << " M=" << m << " N=" << n << " K=" << k
               << " transA=" << trans_a << " transB=" << trans_b);
          const Matrix a = rounded(test::random_matrix(m, k, rng), types.in);  // op(A)
          const Matrix b = rounded(test::random_matrix(k, n, rng), types.in);  // op(B)
          const DeviceBuffer a_dev = upload(a, types.in, trans_a);
          const DeviceBuffer b_dev = upload(b, types.in, trans_b);
          DeviceBuffer c_dev(static_cast<std::size_t>(m * n) * dtype_size(types.out));
          MOE_CHECK_CUDA(cudaMemset(c_dev.data(), 0xFF, c_dev.bytes()));  // poison: NaN
          MOE_CHECK_CUDA(cudaDeviceSynchronize());  // the fill is on the legacy stream
          const GemmShape shape{m, n, k, trans_a, trans_b, types.in, types.in, types.out};
          gemm.run(shape, a_dev.data(), b_dev.data(), c_dev.data(), stream.get());
          stream.synchronize();
          const Matrix want = reference::matmul(a, b);
          const Matrix got = test::download_matrix(c_dev, m, n, types.out);
          CHECK(test::relative_error(got, want) <= types.tolerance);
        }
      }
    }
  }
}
