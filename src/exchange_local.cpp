// The token exchange on one EP rank: the permute writes the experts' input directly, padded
// expert-major, with each row's probability beside it (the experts apply it); nothing crosses a
// link. Without keep_expert_input, X, Y, dY and dX are one buffer (docs/design.md, "Buffers").
// Capacity mode's dropped slots (group E of the kept routing) have no row here: the layout gives
// them none, and the row kernels store nothing for them and add nothing from them.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/fp8_quantize.cuh"
#include "kernels/permute.cuh"
#include "moe/error.h"
#include "src/exchange_impl.h"
#include "src/stage_support.h"

namespace moe {
namespace {

class LocalExchange final : public TokenExchange {
 public:
  explicit LocalExchange(const ExchangeSetup& setup)
      : config_(setup.config),
        mesh_(setup.mesh),
        stream_(setup.stream),
        E_(setup.config.num_experts),
        K_(setup.config.topk),
        H_(setup.config.hidden),
        dtype_(setup.config.dtype),
        layout_(setup.scratch.layout_ws),
        dY_(setup.scratch.dY) {}

  EpTransport transport() const override { return EpTransport::kAuto; }
  bool probabilities_in_experts() const override { return true; }

  void permute(const Tensor& x, const SlotRouting& routing) override {
    const std::int64_t T = x.dim(0);
    const int align = config_.align_size;
    // pad_to_capacity: every expert's group exactly C rows (kept rows never exceed C), so the
    // expert GEMMs run on fixed shapes whatever the routing. The dropped slots name group E, past
    // the layout's groups: no row.
    const auto fixed_rows = static_cast<int>(routing.expert_group_rows);
    layout_.build(routing.topk_idx, T, K_, E_, align, stream_, fixed_rows,
                  fixed_rows > 0 ? E_ : 0);  // C = 0 (T = 0): no rows, as without fixed groups
    tokens_ = T;
    fixed_ = routing.fixed_groups;
    fixed_rows_ = fixed_rows;
    to_host_ = routing.to_host;
    if (to_host_) {
      // The permute starts as soon as the layout is built: on the main stream the two copies took
      // 9–10 µs of the dispatch stage, and the host can learn the counts while the GPU permutes,
      // since X holds the most rows any routing can pad to.
      layout_built_.record(stream_);
      const cudaStream_t count_stream = count_stream_.get();
      MOE_CHECK_CUDA(cudaStreamWaitEvent(count_stream, layout_built_.get(), 0));
      host_.reserve(routing.totals_bytes + (E_ + 1) * sizeof(std::int32_t));
      totals_bytes_ = routing.totals_bytes;
      MOE_CHECK_CUDA(cudaMemcpyAsync(host_.as<char>(), routing.totals, totals_bytes_,
                                     cudaMemcpyDeviceToHost, count_stream));
      MOE_CHECK_CUDA(cudaMemcpyAsync(host_.as<char>() + totals_bytes_, layout_.offsets(),
                                     (E_ + 1) * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     count_stream));
      copied_.record(count_stream);
    } else if (!fixed_) {
      fail("the local exchange: the row counts stay on the device only with fixed groups");
    }
    // Fixed groups: E·C rows, whatever the routing. Else every slot kept, each group padded.
    const std::int64_t max_rows = fixed_rows > 0
                                      ? std::int64_t{E_} * fixed_rows
                                      : T * K_ + std::int64_t{E_} * std::max(align - 1, 0);
    X_.reserve(std::max<std::int64_t>(max_rows * H_, 1) * dtype_size(dtype_));
    row_prob_.reserve(std::max<std::int64_t>(max_rows, 1) * sizeof(float));
    topk_idx_ = routing.topk_idx;
    x_quantized_ = permute_toward_experts(toward_experts(x, x_rounded_),
                                          Tensor(X_.data(), dtype_, {max_rows, H_}), routing.topk_p,
                                          row_prob_.as<float>());
  }

  void dispatch(const Tensor&, void* totals) override {
    const std::int32_t* offsets = nullptr;  // on the host, with the counts
    if (to_host_) {
      mesh_.wait(copied_.get(), "the forward's row counts");  // the one host synchronisation
      std::memcpy(totals, host_.as<char>(), totals_bytes_);
      offsets = reinterpret_cast<const std::int32_t*>(host_.as<char>() + totals_bytes_);
    }
    if (fixed_) {
      // Known beforehand, whether or not the counts came: expert e's group is rows
      // [e·C, (e + 1)·C), the same shapes every step, so the same GEMM plans and the same
      // buffers, as a graph captured after a step that waited or one that did not needs.
      saved_.expert_offsets.resize(static_cast<std::size_t>(E_) + 1);
      for (int e = 0; e <= E_; ++e) saved_.expert_offsets[e] = std::int64_t{e} * fixed_rows_;
    } else {
      saved_.expert_offsets.assign(offsets, offsets + E_ + 1);
    }
    saved_.rows = saved_.expert_offsets.back();
  }

  ExpertRows expert_rows() override {
    // One row buffer: the down products write Y over X once the up products have read it.
    if (!one_row_buffer()) view(Y_, dtype_, {saved_.rows, H_});
    const Tensor Y = one_row_buffer() ? rows(X_) : rows(Y_);
    ExpertRows out{rows(X_), Y, row_prob(), saved_.expert_offsets};
    if (x_quantized_) out.input_codes = codes();
    return out;
  }

  // The experts' output is already where the unpermute reads it.
  void combine(int /*the only chunk*/) override {}

  void unpermute(const Tensor& out) override {
    const Tensor Y = one_row_buffer() ? rows(X_) : rows(Y_);
    unpermute_combine(Y, layout_.row_map(), nullptr, K_, out, stream_);
  }

  // dY(t, k) = dy[t]: the probabilities are inside the experts, whose backward forms dprob.
  void unpermute_backward(const Tensor& dy, float*) override {
    // One row buffer: dY over the dead Y. Else the scratch's dY.
    const Tensor dY = one_row_buffer() ? rows(X_) : view(dY_, dtype_, {saved_.rows, H_});
    dy_quantized_ = permute_toward_experts(toward_experts(dy, dy_rounded_), dY);
  }

  void combine_backward() override {}

  ExpertGradRows expert_grad_rows(const Tensor& x) override {
    ExpertGradRows g;
    g.input = rows(X_);
    g.scale = row_prob();
    g.offsets = saved_.expert_offsets;
    if (dy_quantized_) g.dY_codes = codes();
    if (one_row_buffer()) {
      // X permuted from x again over dY once dY is dead, dX over X once dw13 has read it.
      g.dY = g.dX = g.input;
      // From the forward's rounded rows under fp8_dispatch (x_rounded_ is kept until then).
      const Tensor source =
          config_.fp8_dispatch ? Tensor(x_rounded_.data(), dtype_, {tokens_, H_}) : x;
      g.refill = [this, source, X = g.input](cudaStream_t on) {
        permute_rows(source, layout_.row_map(), K_, layout_.offsets(), layout_.counts(), E_, X, on);
      };
    } else {
      g.dY = rows(dY_);
      g.dX = rows(Y_);  // dead since the unpermute
    }
    return g;
  }

  // dX is already where the permute backward reads it.
  void dispatch_backward(int /*the only chunk*/) override {}

  void permute_backward(const Tensor& dx, float* dprob) override {
    const Tensor dX = one_row_buffer() ? rows(X_) : rows(Y_);
    // dprob from beside the rows, where the experts' backward left it.
    unpermute_combine(dX, layout_.row_map(), nullptr, K_, dx, stream_, row_prob_.as<float>(),
                      dprob);
  }

 private:
  bool one_row_buffer() const { return !config_.keep_expert_input; }
  // The rows the experts get from `rows` [T, H]: themselves, or under fp8_dispatch what their
  // records would decode to over a mesh, in `rounded` (docs/design.md, "FP8 dispatch").
  Tensor toward_experts(const Tensor& rows, DeviceBuffer& rounded) {
    if (!config_.fp8_dispatch) return rows;
    const Tensor out = view(rounded, dtype_, {rows.dim(0), H_});
    round_rows_through_fp8(rows.data, rows.dim(0), H_, out.data, stream_);
    return out;
  }
  // The permute of `source` [T, H] into the expert-major `out`, the rows' codes and scales beside
  // them where the experts run in FP8 and the rows allow it (bf16 rows of whole 128-value blocks,
  // 16-byte aligned; docs/design.md, "Where the activations are quantized"). Returns whether it
  // quantized them.
  bool permute_toward_experts(const Tensor& source, const Tensor& out, const float* prob = nullptr,
                              float* row_prob = nullptr) {
    const bool quantize = config_.fp8 && permute_rows_fp8_applies(source, out);
    if (!quantize) {
      permute_rows(source, layout_.row_map(), K_, layout_.offsets(), layout_.counts(), E_, out,
                   stream_, prob, row_prob);
      return false;
    }
    // Sized as X, for the most rows any routing can pad to: X's codes in the forward, dY's over
    // them in the backward (X's are read by the first product alone).
    const std::int64_t rows = out.dim(0);
    codes_.reserve(static_cast<std::size_t>(std::max<std::int64_t>(rows * H_, 16)));
    code_scales_.reserve(
        static_cast<std::size_t>(std::max<std::int64_t>(rows * (H_ / kFP8Block), 1)) *
        sizeof(float));
    permute_rows_fp8(source, layout_.row_map(), topk_idx_, K_, layout_.offsets(), layout_.counts(),
                     E_, out, codes(), stream_, prob, row_prob);
    return true;
  }
  QuantizedRows codes() const { return {codes_.as<std::uint8_t>(), code_scales_.as<float>()}; }
  Tensor rows(const DeviceBuffer& buffer) const {
    return Tensor(buffer.data(), dtype_, {saved_.rows, H_});
  }
  Tensor row_prob() const { return Tensor(row_prob_.data(), DType::kFP32, {saved_.rows}); }

  MoEConfig config_;
  const Mesh& mesh_;
  cudaStream_t stream_;
  int E_, K_;
  std::int64_t H_;
  DType dtype_;
  SlotLayout layout_;
  // X: the experts' input; without keep_expert_input also Y, dY (over the dead Y), X permuted
  // again, dX. Sized for the most rows any routing can pad to, so that the permute need not wait
  // for the counts.
  DeviceBuffer X_;
  // Each row's probability (fp32 [rows]), which the experts apply; their backward leaves its
  // gradient in its place (docs/design.md, "Probabilities inside the experts").
  DeviceBuffer row_prob_;
  // With keep_expert_input: the experts' output, then dX. Nothing in it outlives a call, yet it is
  // the block's own, not the scratch's.
  DeviceBuffer Y_;
  DeviceBuffer& dY_;  // the scratch's; with keep_expert_input
  // fp8_dispatch: x and dy as the experts get them (x's kept for the backward's refill).
  DeviceBuffer x_rounded_, dy_rounded_;
  // FP8 experts: the E4M3 codes and 1 × 128 scales of X's rows (forward) and dY's (backward), as
  // the permute wrote them, where it did (x_quantized_, dy_quantized_).
  DeviceBuffer codes_, code_scales_;
  bool x_quantized_ = false, dy_quantized_ = false;
  const std::int32_t* topk_idx_ = nullptr;  // the forward's routing, which the backward permutes
  // The counts go to the host on their own stream, off the permute's path.
  Stream count_stream_;
  Event layout_built_, copied_;
  PinnedBuffer host_;  // routing.totals, then the layout's offsets

  std::size_t totals_bytes_ = 0;  // where the offsets start in host_
  std::int64_t tokens_ = 0;       // the forward's T
  bool fixed_ = false;            // pad_to_capacity's fixed groups
  int fixed_rows_ = 0;            // their C (0 at T = 0)
  bool to_host_ = true;           // routing.to_host

  // What the forward keeps for the backward, beside the layout, X (unless refilled) and row_prob.
  struct Saved {
    std::int64_t rows = 0;  // the experts', padding included
    std::vector<std::int64_t> expert_offsets;
  } saved_;
};

}  // namespace

std::unique_ptr<TokenExchange> make_local_exchange(const ExchangeSetup& setup) {
  return std::make_unique<LocalExchange>(setup);
}

}  // namespace moe
