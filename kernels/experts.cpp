#include "experts.h"

#include <fmt/format.h>

#include "moe/error.h"
#include "swiglu.cuh"

namespace moe {

std::string_view expert_schedule_name(ExpertSchedule schedule) {
  return schedule == ExpertSchedule::kStreams ? "streams" : "grouped";
}

namespace {

void check_cublas_status(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS error {} in {}", static_cast<int>(status), call);
}

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

}  // namespace

// The grouped path's cuBLAS handle and the arrays cublasGemmGroupedBatchedEx reads: sizes on the
// host, operand pointers on the device (staged through pinned memory).
struct ExpertFFN::Grouped {
  cublasHandle_t handle = nullptr;
  void* pinned = nullptr;
  DeviceBuffer pointers;
  std::size_t capacity = 0;  // products
  Event staged;              // the last pointer upload; the pinned buffer is reused after it

  Grouped() { check_cublas_status(cublasCreate(&handle), "cublasCreate"); }
  ~Grouped() {
    if (handle != nullptr) (void)cublasDestroy(handle);
    if (pinned != nullptr) (void)cudaFreeHost(pinned);
  }
  void reserve(std::size_t products) {
    if (products <= capacity) return;
    if (pinned != nullptr) MOE_CHECK_CUDA(cudaFreeHost(pinned));
    pinned = nullptr;
    MOE_CHECK_CUDA(cudaMallocHost(&pinned, 3 * products * sizeof(void*)));
    pointers.reserve(3 * products * sizeof(void*));
    capacity = products;
  }
};

ExpertFFN::ExpertFFN(int hidden, int ffn, int local_experts, DType dtype, ExpertSchedule schedule,
                     int streams)
    : hidden_(hidden), ffn_(ffn), experts_(local_experts), dtype_(dtype), schedule_(schedule) {
  if (hidden < 1 || ffn < 1 || local_experts < 1) {
    fail("ExpertFFN: hidden = {}, ffn_hidden = {}, local experts = {} must all be positive", hidden,
         ffn, local_experts);
  }
  if (dtype != DType::kBF16 && dtype != DType::kFP32)
    fail("ExpertFFN: dtype = {} must be bf16 or fp32", dtype_name(dtype));
  if (streams < 1) fail("ExpertFFN: streams = {} must be >= 1", streams);
  for (int i = 0; i < streams; ++i) {
    streams_.emplace_back();
    runners_.emplace_back();
    joins_.emplace_back();
  }
  if (schedule == ExpertSchedule::kGrouped) grouped_ = std::make_unique<Grouped>();
}

ExpertFFN::~ExpertFFN() = default;

void ExpertFFN::check_shapes(const Tensor& X, std::span<const std::int64_t> offsets,
                             const Tensor& w13, const Tensor& w2,
                             const ExpertActivations& act) const {
  if (std::ssize(offsets) != experts_ + 1) {
    fail("ExpertFFN: {} offsets for {} local experts (expected {})", offsets.size(), experts_,
         experts_ + 1);
  }
  for (int e = 0; e < experts_; ++e) {
    if (offsets[e] < 0 || offsets[e + 1] < offsets[e])
      fail("ExpertFFN: offsets[{}..{}] = {}, {} decrease", e, e + 1, offsets[e], offsets[e + 1]);
  }
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(X, "ExpertFFN X", dtype_, {rows, H});
  expect_tensor(w13, "ExpertFFN w13", dtype_, {E, 2 * F, H});
  expect_tensor(w2, "ExpertFFN w2", dtype_, {E, H, F});
  expect_tensor(act.h, "ExpertFFN h", dtype_, {rows, 2 * F});
  expect_tensor(act.a, "ExpertFFN a", dtype_, {rows, F});
}

void ExpertFFN::up_products(const Tensor& X, std::span<const std::int64_t> offsets,
                            const Tensor& w13, const Tensor& h, std::vector<Product>& out) const {
  const std::int64_t H = hidden_, F = ffn_;
  const std::size_t elem = dtype_size(dtype_);
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    out.push_back({{m, 2 * F, H, false, true, dtype_, dtype_, dtype_},
                   X.as<char>() + offsets[e] * H * elem,
                   w13.as<char>() + e * 2 * F * H * elem,
                   h.as<char>() + offsets[e] * 2 * F * elem});
  }
}

void ExpertFFN::forward(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
                        const Tensor& w2, const ExpertActivations& act, const Tensor& y,
                        cudaStream_t stream) {
  check_shapes(X, offsets, w13, w2, act);
  const std::int64_t H = hidden_, F = ffn_;
  expect_tensor(y, "ExpertFFN y", dtype_, {offsets.back(), H});
  const std::size_t elem = dtype_size(dtype_);

  std::vector<Product> products;
  up_products(X, offsets, w13, act.h, products);
  run(products, stream);                 // h = X·w13ᵀ
  swiglu_forward(act.h, act.a, stream);  // a = silu(h_gate) ⊙ h_up
  products.clear();
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    products.push_back({{m, H, F, false, true, dtype_, dtype_, dtype_},
                        act.a.as<char>() + offsets[e] * F * elem,
                        w2.as<char>() + e * H * F * elem,
                        y.as<char>() + offsets[e] * H * elem});
  }
  run(products, stream);  // y = a·w2ᵀ
}

void ExpertFFN::backward(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                         const Tensor& w13, const Tensor& w2, const ExpertActivations& act,
                         bool recompute_h, const Tensor& dX, const Tensor& dw13, const Tensor& dw2,
                         cudaStream_t stream) {
  check_shapes(X, offsets, w13, w2, act);
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(dY, "ExpertFFN dY", dtype_, {rows, H});
  expect_tensor(dX, "ExpertFFN dX", dtype_, {rows, H});
  expect_tensor(act.dA, "ExpertFFN dA", dtype_, {rows, F});
  expect_tensor(act.dh, "ExpertFFN dh", dtype_, {rows, 2 * F});
  const DType grad_type = dw13.dtype;
  if (grad_type != DType::kBF16 && grad_type != DType::kFP32)
    fail("ExpertFFN: dw13 dtype {} must be bf16 or fp32", dtype_name(grad_type));
  expect_tensor(dw13, "ExpertFFN dw13", grad_type, {E, 2 * F, H});
  expect_tensor(dw2, "ExpertFFN dw2", grad_type, {E, H, F});
  const std::size_t elem = dtype_size(dtype_);
  const std::size_t grad_elem = dtype_size(grad_type);

  std::vector<Product> products;
  if (recompute_h) {
    up_products(X, offsets, w13, act.h, products);
    run(products, stream);
    products.clear();
  }
  for (int e = 0; e < experts_; ++e) {  // dA = dY·w2
    const std::int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    products.push_back({{m, F, H, false, false, dtype_, dtype_, dtype_},
                        dY.as<char>() + offsets[e] * H * elem,
                        w2.as<char>() + e * H * F * elem,
                        act.dA.as<char>() + offsets[e] * F * elem});
  }
  run(products, stream);
  swiglu_backward(act.h, act.dA, act.dh, act.a, stream);
  products.clear();
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    const char* dY_e = dY.as<char>() + offsets[e] * H * elem;
    const char* dh_e = act.dh.as<char>() + offsets[e] * 2 * F * elem;
    // dw2 = dYᵀ·a and dw13 = dhᵀ·X; with no rows (K = 0) these write zeros.
    products.push_back({{H, F, m, true, false, dtype_, dtype_, grad_type},
                        dY_e,
                        act.a.as<char>() + offsets[e] * F * elem,
                        dw2.as<char>() + e * H * F * grad_elem});
    products.push_back({{2 * F, H, m, true, false, dtype_, dtype_, grad_type},
                        dh_e,
                        X.as<char>() + offsets[e] * H * elem,
                        dw13.as<char>() + e * 2 * F * H * grad_elem});
    if (m > 0) {  // dX = dh·w13
      products.push_back({{m, H, 2 * F, false, false, dtype_, dtype_, dtype_},
                          dh_e,
                          w13.as<char>() + e * 2 * F * H * elem,
                          dX.as<char>() + offsets[e] * H * elem});
    }
  }
  run(products, stream);
}

void ExpertFFN::run(const std::vector<Product>& products, cudaStream_t stream) {
  if (products.empty()) return;
  if (schedule_ == ExpertSchedule::kGrouped) return run_grouped(products, stream);
  run_on_streams(products, stream);
}

void ExpertFFN::run_on_streams(const std::vector<Product>& products, cudaStream_t stream) {
  const std::size_t lanes = std::min(streams_.size(), products.size());
  fork_.record(stream);
  for (std::size_t s = 0; s < lanes; ++s)
    MOE_CHECK_CUDA(cudaStreamWaitEvent(streams_[s].get(), fork_.get(), 0));
  for (std::size_t i = 0; i < products.size(); ++i) {
    const auto& p = products[i];
    runners_[i % lanes].run(p.shape, p.a, p.b, p.c, streams_[i % lanes].get());
  }
  for (std::size_t s = 0; s < lanes; ++s) {
    joins_[s].record(streams_[s].get());
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, joins_[s].get(), 0));
  }
}

void ExpertFFN::run_grouped(const std::vector<Product>& products, cudaStream_t stream) {
  // Empty products (K = 0) only zero their output; cuBLAS takes the rest in one call. Row-major
  // C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, as in GemmRunner.
  std::vector<const Product*> work;
  for (const auto& p : products) {
    if (p.shape.m == 0 || p.shape.n == 0) continue;
    if (p.shape.k == 0) {
      MOE_CHECK_CUDA(cudaMemsetAsync(
          p.c, 0, static_cast<std::size_t>(p.shape.m * p.shape.n) * dtype_size(p.shape.c_type),
          stream));
    } else {
      work.push_back(&p);
    }
  }
  if (work.empty()) return;
  const std::size_t n = work.size();
  auto& g = *grouped_;
  MOE_CHECK_CUDA(
      cudaEventSynchronize(g.staged.get()));  // the previous upload has left the pinned buffer
  g.reserve(n);
  std::vector<cublasOperation_t> trans_first(n), trans_second(n);
  std::vector<int> m(n), nn(n), k(n), ld_first(n), ld_second(n), ld_out(n), group_size(n, 1);
  std::vector<float> alpha(n, 1.0f), beta(n, 0.0f);
  auto** host = static_cast<const void**>(g.pinned);
  const DType a_type = work.front()->shape.a_type;
  const DType c_type = work.front()->shape.c_type;
  for (std::size_t i = 0; i < n; ++i) {
    const GemmShape& s = work[i]->shape;
    if (s.a_type != a_type || s.b_type != a_type || s.c_type != c_type)
      fail("ExpertFFN: a grouped call mixes dtypes");
    trans_first[i] = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    trans_second[i] = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = static_cast<int>(s.n);
    nn[i] = static_cast<int>(s.m);
    k[i] = static_cast<int>(s.k);
    ld_first[i] = static_cast<int>(s.trans_b ? s.k : s.n);
    ld_second[i] = static_cast<int>(s.trans_a ? s.m : s.k);
    ld_out[i] = static_cast<int>(s.n);
    host[i] = work[i]->b;
    host[n + i] = work[i]->a;
    host[2 * n + i] = work[i]->c;
  }
  MOE_CHECK_CUDA(cudaMemcpyAsync(g.pointers.data(), g.pinned, 3 * n * sizeof(void*),
                                 cudaMemcpyHostToDevice, stream));
  g.staged.record(stream);
  const auto* const* device = g.pointers.as<const void* const>();
  check_cublas_status(cublasSetStream(g.handle, stream), "cublasSetStream");
  check_cublas_status(
      cublasGemmGroupedBatchedEx(g.handle, trans_first.data(), trans_second.data(), m.data(),
                                 nn.data(), k.data(), alpha.data(), device, cuda_type(a_type),
                                 ld_first.data(), device + n, cuda_type(a_type), ld_second.data(),
                                 beta.data(), const_cast<void* const*>(device + 2 * n),
                                 cuda_type(c_type), ld_out.data(), static_cast<int>(n),
                                 group_size.data(), CUBLAS_COMPUTE_32F),
      "cublasGemmGroupedBatchedEx");
}

}  // namespace moe
