#include "src/expert_stage.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "src/stage_support.h"

namespace moe {
namespace {

// Every rank's `mine` (the same count on every rank), in rank order, on the host; the wait is the
// mesh's, bounded by its timeout. The staging buffer is freed (cudaFree waits for the device)
// only after that wait has seen the stream's work done.
template <typename T>
std::vector<T> all_gather_to_host(const Mesh& mesh, std::span<const T> mine, cudaStream_t stream) {
  const std::size_t bytes = mine.size_bytes();
  const auto world = static_cast<std::size_t>(mesh.world_size());
  DeviceBuffer staging(std::max<std::size_t>(bytes * (world + 1), 16));
  std::byte* gathered = staging.as<std::byte>() + bytes;
  if (bytes > 0) {
    MOE_CHECK_CUDA(
        cudaMemcpyAsync(staging.data(), mine.data(), bytes, cudaMemcpyHostToDevice, stream));
    mesh.all_gather(staging.data(), gathered, bytes, MeshGroup::kWorld, stream);
  }
  Event done;
  done.record(stream);
  mesh.wait(done.get(), "the agreement on the expert GEMMs' algorithms");
  std::vector<T> out(mine.size() * world);
  if (bytes > 0) copy_to_host(out.data(), gathered, bytes * world);
  return out;
}

}  // namespace

ExpertStage::ExpertStage(const MoEConfig& config, const Mesh& mesh, DeviceBuffer& activations)
    : F_(config.ffn_hidden), dtype_(config.dtype), a_(activations) {
  const int local_experts = config.num_experts / mesh.ep();
  const auto workspace = static_cast<std::size_t>(config.gemm_workspace_mib) << 20;
  if (config.fp8) {
    fp8_.emplace(config.hidden, config.ffn_hidden, local_experts, 4, workspace);
    return;
  }
  ffn_.emplace(
      config.hidden, config.ffn_hidden, local_experts, config.dtype, ExpertSchedule::kBatched, 4,
      // Rounded up: a chunk smaller than a byte asked is the smallest, not "no chunks" (0).
      static_cast<std::size_t>(std::ceil(config.activation_chunk_mib * (1 << 20))), workspace,
      config.gemm_autotune);
  ffn_->set_host_wait([&mesh](cudaEvent_t event) {
    mesh.wait(event, "the work queued before the expert GEMMs' algorithm timing");
  });
}

void ExpertStage::prepare_forward(const Tensor& w13, const Tensor& w2, cudaStream_t stream,
                                  bool weights_unchanged) {
  if (!fp8_) return;
  if (weights_unchanged && fp8_->has_weights() && fp8_w13_ == w13.data && fp8_w2_ == w2.data)
    return;
  fp8_->quantize_weights(w13, w2, stream);
  fp8_w13_ = w13.data;
  fp8_w2_ = w2.data;
}

void ExpertStage::forward(const ExpertRows& rows, const Tensor& w13, const Tensor& w2,
                          cudaStream_t stream, ExpertSpan span) {
  const std::int64_t n = rows.offsets.back();
  if (fp8_) {
    // The FP8 products read a over every row (activation_chunk_mib does not apply to them).
    ExpertActivations act{.h = view(h_, dtype_, {n, 2 * F_}), .a = view(a_, dtype_, {n, F_})};
    act.scale = rows.scale;
    fp8_->forward(rows.input, rows.offsets, act, rows.output, stream, span, rows.input_codes);
    return;
  }
  ExpertActivations act{.h = view(h_, dtype_, {n, 2 * F_}),
                        .a = view(a_, dtype_, {ffn_->activation_rows(rows.offsets), F_})};
  act.scale = rows.scale;
  ffn_->forward(rows.input, rows.offsets, w13, w2, act, rows.output, stream, span);
}

void ExpertStage::backward(const ExpertGradRows& rows, const Tensor& w13, const Tensor& w2,
                           const Tensor& w13_grad, const Tensor& w2_grad, cudaStream_t stream,
                           ExpertSpan span, const ExpertFFN::DXQueued& dX_queued) {
  const std::int64_t n = rows.offsets.back();
  // In place: dh over h, dA over a (the SwiGLU backward reads each element before writing its
  // gradient, and writes a there again for dw2).
  const Tensor h(h_.data(), dtype_, {n, 2 * F_});
  const Tensor a(a_.data(), dtype_, {fp8_ ? n : ffn_->activation_rows(rows.offsets), F_});
  ExpertActivations act{.h = h, .a = a, .dA = a, .dh = h};
  act.scale = act.dscale = rows.scale;
  if (fp8_) {
    fp8_->backward(rows.dY, rows.input, rows.offsets, act, rows.dX, w13_grad, w2_grad, stream,
                   rows.refill, span, dX_queued, rows.dY_codes);
    return;
  }
  ffn_->backward(rows.dY, rows.input, rows.offsets, w13, w2, act, false, rows.dX, w13_grad, w2_grad,
                 stream, rows.refill, span, dX_queued);
}

void ExpertStage::agree_gemm_algorithms(const Mesh& mesh, cudaStream_t stream) {
  GemmTuning* tuning = ffn_ ? ffn_->tuning() : nullptr;
  if (tuning == nullptr || tuning->frozen || mesh.world_size() == 1) return;
  const int world = mesh.world_size();
  const std::vector<std::byte> mine = tuning->serialize();
  // Sizes (and whether any product ran) first, then every rank's records padded to the largest.
  const std::uint64_t mine_size[2] = {mine.size(), tuning->ran_products ? 1u : 0u};
  const auto sizes = all_gather_to_host<std::uint64_t>(mesh, std::span(mine_size), stream);
  std::uint64_t widest = 0, ran = 0;
  for (int r = 0; r < world; ++r) {
    widest = std::max(widest, sizes[2 * r]);
    ran = std::max(ran, sizes[2 * r + 1]);
  }
  // No product ran anywhere yet (no rank had rows): agree at a later step instead of freezing
  // the heuristic's choices for good. Products that ran with nothing to time (plain products, one
  // expert a batch) agree on no records. The sizes are the same on every rank, and so is this.
  if (widest == 0 && ran == 0) return;
  std::vector<std::byte> padded(widest);
  std::copy(mine.begin(), mine.end(), padded.begin());
  const auto gathered =
      all_gather_to_host<std::byte>(mesh, std::span<const std::byte>(padded), stream);
  std::vector<std::vector<std::byte>> ranks(world);
  for (int r = 0; r < world; ++r) {
    const auto first = gathered.begin() + static_cast<std::ptrdiff_t>(r * widest);
    ranks[r].assign(first, first + static_cast<std::ptrdiff_t>(sizes[2 * r]));
  }
  tuning->adopt_agreed(ranks);
}

}  // namespace moe
