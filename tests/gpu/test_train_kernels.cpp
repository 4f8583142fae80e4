// moe_train's kernels (residual add, squared error, AdamW) against fp64 host values, outputs
// poisoned first, at even and odd sizes, bf16 and fp32.
#include <cmath>
#include <random>

#include "apps/train_kernels.cuh"
#include "moe/device.h"
#include "support/block_util.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

TEST_CASE("residual add and squared error equal the host values", "[gpu][train]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const std::int64_t n : {1, 7, 1000, 70001}) {
      INFO(dtype_name(dtype) << " n=" << n);
      const Matrix a = test::round_to(test::random_matrix(1, n, rng), dtype);
      const Matrix b = test::round_to(test::random_matrix(1, n, rng), dtype);
      const auto a_dev = test::upload_as(a, dtype), b_dev = test::upload_as(b, dtype);
      DeviceBuffer out(n * dtype_size(dtype)), grad(n * dtype_size(dtype)),
          partial(train::kLossBlocks * 4);
      test::poison(out);
      test::poison(grad);
      const Tensor a_t(a_dev.data(), dtype, {1, n}), b_t(b_dev.data(), dtype, {1, n}),
          out_t(out.data(), dtype, {1, n}), grad_t(grad.data(), dtype, {1, n});
      train::add(a_t, b_t, out_t, nullptr);
      const float scale = 0.25f;
      const int parts = train::squared_error(a_t, b_t, scale, grad_t, partial.as<float>(), nullptr);
      MOE_CHECK_CUDA(cudaDeviceSynchronize());
      const Matrix sum = test::read(out_t, 1, n), g = test::read(grad_t, 1, n);
      std::vector<float> sums(parts);
      copy_to_host(sums.data(), partial.data(), sums.size() * 4);
      double sse = 0, want_sse = 0;
      for (const float s : sums) sse += s;
      const double tol = dtype == DType::kBF16 ? 8e-3 : 1e-6;
      for (std::int64_t i = 0; i < n; ++i) {
        const double d = a(0, i) - b(0, i);
        want_sse += d * d;
        REQUIRE(sum(0, i) == Approx(a(0, i) + b(0, i)).epsilon(tol).margin(tol));
        REQUIRE(g(0, i) == Approx(2 * scale * d).epsilon(tol).margin(tol));
      }
      CHECK(sse == Approx(want_sse).epsilon(1e-5));
    }
  }
}

TEST_CASE("AdamW equals the host formula over several steps", "[gpu][train]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType param_dtype : {DType::kFP32, DType::kBF16}) {
    for (const DType grad_dtype : {DType::kFP32, DType::kBF16}) {
      const std::int64_t n = 1031;
      INFO("param " << dtype_name(param_dtype) << " grad " << dtype_name(grad_dtype));
      std::vector<float> w(n), m(n, 0.0f), v(n, 0.0f);
      for (auto& x : w) x = std::normal_distribution<float>(0, 1)(rng);
      DeviceBuffer master(n * 4), m_dev(n * 4), v_dev(n * 4), param(n * dtype_size(param_dtype));
      copy_to_device(master.data(), w.data(), n * 4);
      copy_to_device(m_dev.data(), m.data(), n * 4);
      copy_to_device(v_dev.data(), v.data(), n * 4);
      test::poison(param);
      train::AdamWHyper hyper;
      hyper.lr = 0.01f;
      hyper.weight_decay = 0.1f;
      std::vector<double> W(w.begin(), w.end()), M(n, 0.0), V(n, 0.0);
      for (int step = 1; step <= 3; ++step) {
        const Matrix g = test::round_to(test::random_matrix(1, n, rng), grad_dtype);
        const auto g_dev = test::upload_as(g, grad_dtype);
        hyper.step = step;
        train::adamw_step(hyper, Tensor(g_dev.data(), grad_dtype, {n}), master.as<float>(),
                          m_dev.as<float>(), v_dev.as<float>(),
                          Tensor(param.data(), param_dtype, {n}), nullptr);
        for (std::int64_t i = 0; i < n; ++i) {
          M[i] = 0.9 * M[i] + 0.1 * g(0, i);
          V[i] = 0.999 * V[i] + 0.001 * g(0, i) * g(0, i);
          const double update = M[i] / (1 - std::pow(0.9, step)) /
                                (std::sqrt(V[i] / (1 - std::pow(0.999, step))) + 1e-8);
          W[i] -= 0.01 * (update + 0.1 * W[i]);
        }
      }
      MOE_CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<float> got(n);
      copy_to_host(got.data(), master.data(), n * 4);
      const Matrix p = test::read(Tensor(param.data(), param_dtype, {n}), 1, n);
      const double tol = param_dtype == DType::kBF16 ? 8e-3 : 1e-6;
      for (std::int64_t i = 0; i < n; ++i) {
        REQUIRE(got[i] == Approx(W[i]).epsilon(1e-5).margin(1e-5));
        REQUIRE(p(0, i) == Approx(W[i]).epsilon(tol).margin(1e-5));
      }
    }
  }
}
