// The token exchange on one EP rank: the permute writes the experts' input directly, padded
// expert-major, with each row's probability beside it (the experts apply it); nothing crosses a
// link. Without keep_expert_input, X, Y, dY and dX are one buffer (docs/design.md, "Buffers").
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/elementwise.cuh"
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
    groups_ = E_ + (routing.has_dropped_group ? 1 : 0);
    // pad_to_capacity: every expert's group exactly C rows (kept rows never exceed C), so the
    // expert GEMMs run on fixed shapes whatever the routing.
    const auto fixed_rows = static_cast<int>(routing.expert_group_rows);
    layout_.build(routing.topk_idx, T, K_, groups_, align, stream_, fixed_rows,
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
      host_.reserve(routing.totals_bytes + (groups_ + 1) * sizeof(std::int32_t));
      totals_bytes_ = routing.totals_bytes;
      MOE_CHECK_CUDA(cudaMemcpyAsync(host_.as<char>(), routing.totals, totals_bytes_,
                                     cudaMemcpyDeviceToHost, count_stream));
      MOE_CHECK_CUDA(cudaMemcpyAsync(host_.as<char>() + totals_bytes_, layout_.offsets(),
                                     (groups_ + 1) * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     count_stream));
      copied_.record(count_stream);
    } else if (!fixed_) {
      fail("the local exchange: the row counts stay on the device only with fixed groups");
    }
    const std::int64_t max_rows = T * K_ + std::int64_t{groups_} * std::max(align - 1, 0) +
                                  std::int64_t{E_} * routing.expert_group_rows;
    X_.reserve(std::max<std::int64_t>(max_rows * H_, 1) * dtype_size(dtype_));
    row_prob_.reserve(std::max<std::int64_t>(max_rows, 1) * sizeof(float));
    permute_rows(toward_experts(x, x_rounded_), layout_.row_map(), K_, layout_.offsets(),
                 layout_.counts(), groups_, Tensor(X_.data(), dtype_, {max_rows, H_}), stream_,
                 routing.topk_p, row_prob_.as<float>());
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
      // [e·C, (e + 1)·C), the same shapes every step, so the same GEMM plans. The dropped group
      // after them takes a row per dropped slot, rounded up to A (a token's several dropped slots
      // share one of them, and the rest go unused): at most T·K rows. Its exact end comes with
      // the counts; without them the whole bound is cleared. The buffers are sized for the bound
      // either way, so that a step that waits and one that does not use the same memory, as a
      // graph captured after either needs.
      saved_.expert_offsets.resize(static_cast<std::size_t>(E_) + 1);
      for (int e = 0; e <= E_; ++e) saved_.expert_offsets[e] = std::int64_t{e} * fixed_rows_;
      saved_.rows = saved_.expert_offsets.back();
      const std::int64_t align = std::max(config_.align_size, 1);
      const std::int64_t slots = tokens_ * K_;
      saved_.reserved_rows = saved_.rows + (groups_ > E_ ? (slots + align - 1) / align * align : 0);
      saved_.all_rows = offsets != nullptr ? offsets[groups_] : saved_.reserved_rows;
      saved_.dropped_end_on_device = offsets == nullptr && groups_ > E_;
      return;
    }
    saved_.expert_offsets.assign(offsets, offsets + E_ + 1);
    saved_.rows = saved_.expert_offsets.back();
    saved_.all_rows = saved_.reserved_rows = offsets[groups_];
    saved_.dropped_end_on_device = false;
  }

  ExpertRows expert_rows() override {
    // One row buffer: the down products write Y over X once the up products have read it. Y holds
    // the dropped group's rows too, which the unpermute reads.
    if (!one_row_buffer()) view(Y_, dtype_, {saved_.reserved_rows, H_});
    const Tensor Y = one_row_buffer() ? rows(X_) : rows(Y_);
    return {rows(X_), Y, row_prob(), saved_.expert_offsets};
  }

  // The experts' output is already where the unpermute reads it; the dropped slots' rows, which
  // no expert wrote, become zero.
  void combine(int /*the only chunk*/) override { clear_dropped_rows(one_row_buffer() ? X_ : Y_); }

  void unpermute(const Tensor& out) override {
    const Tensor Y = one_row_buffer() ? rows(X_) : rows(Y_);
    unpermute_combine(Y, layout_.row_map(), nullptr, K_, out, stream_);
  }

  // dY(t, k) = dy[t]: the probabilities are inside the experts, whose backward forms dprob.
  void unpermute_backward(const Tensor& dy, float*) override {
    // One row buffer: dY over the dead Y. Else the scratch's dY.
    const Tensor dY = one_row_buffer() ? rows(X_) : view(dY_, dtype_, {saved_.reserved_rows, H_});
    permute_rows(toward_experts(dy, dy_rounded_), layout_.row_map(), K_, layout_.offsets(),
                 layout_.counts(), groups_, dY, stream_);
  }

  void combine_backward() override {}

  ExpertGradRows expert_grad_rows(const Tensor& x) override {
    ExpertGradRows g;
    g.input = rows(X_);
    g.scale = row_prob();
    g.offsets = saved_.expert_offsets;
    if (one_row_buffer()) {
      // X permuted from x again over dY once dY is dead, dX over X once dw13 has read it.
      g.dY = g.dX = g.input;
      // From the forward's rounded rows under fp8_dispatch (x_rounded_ is kept until then).
      const Tensor source =
          config_.fp8_dispatch ? Tensor(x_rounded_.data(), dtype_, {tokens_, H_}) : x;
      g.refill = [this, source, X = g.input](cudaStream_t on) {
        permute_rows(source, layout_.row_map(), K_, layout_.offsets(), layout_.counts(), groups_, X,
                     on);
      };
    } else {
      g.dY = rows(dY_);
      g.dX = rows(Y_);  // dead since the unpermute
    }
    return g;
  }

  // dX's rows of dropped slots, which no expert wrote, become zero.
  void dispatch_backward(int /*the only chunk*/) override {
    clear_dropped_rows(one_row_buffer() ? X_ : Y_);
  }

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
  Tensor rows(const DeviceBuffer& buffer) const {
    return Tensor(buffer.data(), dtype_, {saved_.rows, H_});
  }
  Tensor row_prob() const { return Tensor(row_prob_.data(), DType::kFP32, {saved_.rows}); }
  // Zero in `buffer` the rows of the dropped group, after the experts' rows: up to its end where
  // the host knows it, else up to the end the layout holds on the device (the bound, T·K rows, is
  // what a memset would have to take, most of them unused).
  void clear_dropped_rows(DeviceBuffer& buffer) const {
    const std::int64_t dropped_rows = saved_.all_rows - saved_.rows;
    if (dropped_rows == 0) return;
    const auto row_bytes = static_cast<std::size_t>(H_) * dtype_size(dtype_);
    if (saved_.dropped_end_on_device) {
      clear_rows_to(buffer.data(), row_bytes, saved_.rows, layout_.offsets() + groups_,
                    saved_.all_rows, stream_);
      return;
    }
    MOE_CHECK_CUDA(cudaMemsetAsync(buffer.as<char>() + saved_.rows * row_bytes, 0,
                                   static_cast<std::size_t>(dropped_rows) * row_bytes, stream_));
  }

  MoEConfig config_;
  const Mesh& mesh_;
  cudaStream_t stream_;
  int E_, K_;
  int groups_ = 0;  // the layout's: E, and in capacity mode the dropped group after them
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
    std::int64_t rows = 0;      // the experts', padding included
    std::int64_t all_rows = 0;  // rows, then the dropped group's in capacity mode
    // all_rows, or with fixed groups the most that all_rows can be: what Y and dY are sized for.
    std::int64_t reserved_rows = 0;
    // Fixed groups without the counts on the host: the dropped group's end is on the device
    // alone (the layout's offsets[groups_]), all_rows its bound.
    bool dropped_end_on_device = false;
    std::vector<std::int64_t> expert_offsets;
  } saved_;
};

}  // namespace

std::unique_ptr<TokenExchange> make_local_exchange(const ExchangeSetup& setup) {
  return std::make_unique<LocalExchange>(setup);
}

}  // namespace moe
