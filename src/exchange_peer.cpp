// The token exchange over peer memory (docs/design.md, "Transports"): the experts' input and
// output rows, and each row's probability beside them, live in PeerBuffers that every EP rank
// maps. Senders store their rows straight into the experts' ranks' buffers and load the results
// back: no staging, no chunk sort. The experts apply the probabilities, so the combine is a plain
// sum that keeps nothing for its backward.
//
// A barrier (an all-reduce of one zero over the EP group) returns when every rank's stream has
// finished what it held before; the kernels that store into other GPUs fence their stores at
// system scope before they exit, so a barrier behind them marks the rows as landed everywhere.
//
// Unless keep_expert_input, X is Y's buffer: X, Y, dY and dX share one row buffer, x stored into
// it again in the backward (one more exchange).
//
// Capacity mode: the dropped slots (group E of the kept routing) have no row on any rank: the
// sender's layout, over the E experts' groups, gives them row -1, and the peer kernels store
// nothing for them and add nothing from them (dprob 0).
#include <cstring>
#include <memory>
#include <vector>

#include "comm/peer_memory.h"
#include "kernels/permute.cuh"
#include "moe/error.h"
#include "src/exchange_impl.h"
#include "src/stage_support.h"

namespace moe {
namespace {

class PeerExchange final : public TokenExchange {
 public:
  explicit PeerExchange(const ExchangeSetup& setup)
      : config_(setup.config),
        mesh_(setup.mesh),
        stream_(setup.stream),
        E_(setup.config.num_experts),
        E_loc_(setup.config.num_experts / setup.mesh.ep()),
        K_(setup.config.topk),
        H_(setup.config.hidden),
        dtype_(setup.config.dtype),
        layout_(setup.scratch.layout_ws),
        X_(setup.mesh),
        row_prob_(setup.mesh) {
    // Y holds nothing from one call to the next (the combine keeps the rows it loaded), so the
    // blocks of one mesh share it through the scratch; a block of another mesh has its own.
    MoEScratch::Buffers& shared = setup.scratch;
    if (shared.peer_Y == nullptr) {
      shared.peer_Y = std::make_unique<PeerBuffer>(mesh_);
      shared.peer_mesh = &mesh_;
    }
    if (shared.peer_mesh == &mesh_) {
      Y_ = shared.peer_Y.get();
    } else {
      own_Y_ = std::make_unique<PeerBuffer>(mesh_);
      Y_ = own_Y_.get();
    }
    MOE_CHECK_CUDA(cudaMemsetAsync(typed<int>(barrier_, 1), 0, sizeof(int), stream_));
  }

  // The peer buffers' destructors unmap and free memory that kernels use: first let this rank's
  // own work on them finish, within the mesh's timeout, also after an abort (which is what
  // releases a stuck NCCL kernel, so the peer kernels queued behind it run then).
  ~PeerExchange() override {
    try {
      drained_.record(stream_);
      mesh_.wait(drained_.get(), "the work queued before the peer exchange is freed");
    } catch (const std::exception&) {
      mesh_.abort();
    }
  }

  EpTransport transport() const override { return EpTransport::kPeer; }
  bool probabilities_in_experts() const override { return true; }

  // The sender's layout only: dispatch stores the rows where they go.
  void permute(const Tensor& x, const SlotRouting& routing) override {
    // MoEBlock refuses fixed blocks over the peer exchange; this names the cause if not.
    if (routing.fixed_groups)
      fail("pad_to_capacity under EP runs over the NCCL exchange (fixed blocks), for now");
    saved_.routing = routing;
    layout_.build(routing.topk_idx, x.dim(0), K_, E_, /*align=*/1, stream_);
  }

  void dispatch(const Tensor& x, void* totals) override;

  ExpertRows expert_rows() override {
    return {rows(input_buffer()), rows(*Y_), row_prob(), saved_.expert_offsets};
  }

  // Every rank's Y is complete (one chunk: no pipeline).
  void combine(int /*chunk*/) override { barrier(); }

  void unpermute(const Tensor& out) override {
    peer_unpermute_combine(slots(*Y_), nullptr, K_, out, stream_);
  }

  // dy[t] stored at each slot's row of Y on its expert's rank (Y's content died with the
  // combine); the experts' backward forms dprob.
  void unpermute_backward(const Tensor& dy, float*) override {
    peer_permute(dy, slots(*Y_), K_, own_offsets(), own_counts(), E_loc_, rows(*Y_), stream_);
  }

  void combine_backward() override { barrier(); }  // every rank's dY has landed

  ExpertGradRows expert_grad_rows(const Tensor& x) override {
    ExpertGradRows g;
    g.dY = rows(*Y_);
    g.input = rows(input_buffer());
    g.dX = rows(*Y_);  // over dY, each expert's behind its dw2
    g.scale = row_prob();
    g.offsets = saved_.expert_offsets;
    if (!config_.keep_expert_input) {
      // x stored into every rank's buffer again, once every rank has read its dY (the barrier
      // follows each rank's dw2); the store ends with the barrier that dw13 needs.
      g.refill = [this, x](cudaStream_t) {
        barrier();
        store_input(x, nullptr);
      };
    }
    return g;
  }

  // Every rank's dX is complete (one chunk: no pipeline).
  void dispatch_backward(int /*chunk*/) override { barrier(); }

  void permute_backward(const Tensor& dx, float* dprob) override {
    peer_unpermute_combine(slots(*Y_), nullptr, K_, dx, stream_, dprob);
    // A shared Y: the next block's unpermute backward may store its dY there as soon as this rank
    // moves on, while a slower rank still loads this block's dX.
    if (own_Y_ == nullptr) barrier();
  }

 private:
  // Returns when every EP rank's work queued before it on its stream is done.
  void barrier() const {
    mesh_.all_reduce_sum(barrier_.data(), 1, ncclInt32, MeshGroup::kExpertParallel, stream_);
  }
  // The slots' rows over the EP group's buffers of `rows` (X or Y).
  PeerRows slots(const PeerBuffer& buffer) const {
    PeerRows r;
    r.base = buffer.ranks();
    r.ranks = mesh_.ep();
    r.experts_per_rank = E_loc_;
    r.topk_idx = saved_.routing.topk_idx;
    r.rows = slot_rows_.as<std::int32_t>();
    r.scalars = row_prob_.ranks();
    return r;
  }
  PeerBuffer& input_buffer() { return config_.keep_expert_input ? X_ : *Y_; }
  Tensor rows(const PeerBuffer& buffer) const {
    return Tensor(buffer.local(), dtype_, {saved_.rows, H_});
  }
  Tensor row_prob() const { return Tensor(row_prob_.local(), DType::kFP32, {saved_.rows}); }
  const std::int32_t* own_offsets() const { return plan_.as<std::int32_t>() + E_; }
  const std::int32_t* own_counts() const { return own_offsets() + E_loc_ + 1; }
  // x stored at every slot's row on its expert's rank (with prob, each slot's probability beside
  // it), then every rank waits for every rank's stores.
  void store_input(const Tensor& x, const float* prob) {
    PeerBuffer& buffer = input_buffer();
    peer_permute(x, slots(buffer), K_, own_offsets(), own_counts(), E_loc_, rows(buffer), stream_,
                 prob, prob != nullptr ? static_cast<float*>(row_prob_.local()) : nullptr);
    barrier();  // every rank's rows have landed in every buffer
  }

  MoEConfig config_;
  const Mesh& mesh_;
  cudaStream_t stream_;
  int E_, E_loc_, K_;
  std::int64_t H_;
  DType dtype_;
  SlotLayout layout_;
  Event drained_;
  PeerBuffer X_;             // with keep_expert_input
  PeerBuffer row_prob_;      // fp32 [rows]: each row's probability, stored by the senders beside X
  PeerBuffer* Y_ = nullptr;  // the scratch's, or own_Y_ for a block of another mesh
  std::unique_ptr<PeerBuffer> own_Y_;
  DeviceBuffer all_counts_;  // [EP, E]: every EP rank's rows per expert
  DeviceBuffer slot_rows_;   // [T, K]: each slot's row on its expert's rank
  DeviceBuffer plan_;        // shift [E], own offsets [E_loc + 1], own counts [E_loc]
  DeviceBuffer barrier_;     // one int, zero, that the EP group all-reduces as a barrier
  PinnedBuffer host_;        // the totals and counts down, the plan up
  Event copied_;

  // What the forward keeps for the backward, beside the layout, slot_rows, the plan and X.
  struct Saved {
    SlotRouting routing;
    std::int64_t rows = 0;  // this rank's experts', padding included
    std::vector<std::int64_t> expert_offsets;
  } saved_;
};

// All-gather the counts (the one host synchronisation, which also brings routing.totals), lay
// every rank's rows out on the host, grow the buffers where needed, then store each slot's row of
// x at its place on its expert's rank and wait for every rank's stores.
void PeerExchange::dispatch(const Tensor& x, void* totals) {
  const int EP = mesh_.ep(), me = mesh_.ep_index();
  const std::int64_t T = x.dim(0);
  const std::size_t totals_bytes = saved_.routing.totals_bytes;
  const std::size_t counts_bytes = static_cast<std::size_t>(EP) * E_ * sizeof(std::int32_t);
  const std::size_t plan_count = static_cast<std::size_t>(E_) + 2 * E_loc_ + 1;
  auto* all_counts = typed<std::int32_t>(all_counts_, static_cast<std::size_t>(EP) * E_);
  mesh_.all_gather(layout_.counts(), all_counts, E_ * sizeof(std::int32_t),
                   MeshGroup::kExpertParallel, stream_);
  host_.reserve(totals_bytes + counts_bytes + plan_count * sizeof(std::int32_t));
  auto* host = host_.as<char>();
  MOE_CHECK_CUDA(
      cudaMemcpyAsync(host, saved_.routing.totals, totals_bytes, cudaMemcpyDeviceToHost, stream_));
  MOE_CHECK_CUDA(cudaMemcpyAsync(host + totals_bytes, all_counts, counts_bytes,
                                 cudaMemcpyDeviceToHost, stream_));
  copied_.record(stream_);
  mesh_.wait(copied_.get(), "the dispatch counts all-gather");  // the one host synchronisation
  std::memcpy(totals, host, totals_bytes);

  // Rows of (source s, global expert g): c[s·E + g]. On g's rank r, expert e = g − r·E_loc owns
  // a padded group; inside it the sources' rows follow in source order, each in token order.
  const auto* c = reinterpret_cast<const std::int32_t*>(host + totals_bytes);
  auto* plan = reinterpret_cast<std::int32_t*>(host + totals_bytes + counts_bytes);
  std::int32_t* shift = plan;
  std::int32_t* own_offset = plan + E_;
  std::int32_t* own_count = own_offset + E_loc_ + 1;
  std::vector<std::size_t> bytes(EP);
  std::int64_t sender_offset = 0;  // where this rank's rows of g start in its own layout
  for (int r = 0; r < EP; ++r) {
    std::int64_t offset = 0;
    for (int e = 0; e < E_loc_; ++e) {
      const int g = r * E_loc_ + e;
      std::int64_t total = 0, before_me = 0;
      for (int src = 0; src < EP; ++src) {
        total += c[src * E_ + g];
        if (src < me) before_me += c[src * E_ + g];
      }
      shift[g] = static_cast<std::int32_t>(offset + before_me - sender_offset);
      sender_offset += c[me * E_ + g];
      if (r == me) {
        own_offset[e] = static_cast<std::int32_t>(offset);
        own_count[e] = static_cast<std::int32_t>(total);
      }
      offset += config_.padded_rows(total);
    }
    if (r == me) own_offset[E_loc_] = static_cast<std::int32_t>(offset);
    if (offset > INT32_MAX)
      fail("rank {}: EP rank {} would receive {} rows, beyond the int32 row index", mesh_.rank(), r,
           offset);
    bytes[r] = static_cast<std::size_t>(offset) * H_ * dtype_size(dtype_);
  }
  saved_.expert_offsets.assign(own_offset, own_offset + E_loc_ + 1);
  saved_.rows = saved_.expert_offsets.back();
  auto* plan_device = typed<std::int32_t>(plan_, plan_count);
  MOE_CHECK_CUDA(cudaMemcpyAsync(plan_device, plan, plan_count * sizeof(std::int32_t),
                                 cudaMemcpyHostToDevice, stream_));
  if (config_.keep_expert_input) X_.reserve(bytes, stream_);
  Y_->reserve(bytes, stream_);
  std::vector<std::size_t> prob_bytes(EP);
  for (int r = 0; r < EP; ++r) prob_bytes[r] = bytes[r] / (H_ * dtype_size(dtype_)) * sizeof(float);
  row_prob_.reserve(prob_bytes, stream_);

  auto* slot_rows = typed<std::int32_t>(slot_rows_, static_cast<std::size_t>(T) * K_);
  peer_row_map(layout_.row_map(), saved_.routing.topk_idx, plan_device, T * K_, slot_rows, stream_);
  // One row buffer: Y's buffer, which a slower rank may still be loading the previous layer's
  // combine from; the counts all-gather above completed only once every rank's stream had
  // reached it, past that combine.
  store_input(x, saved_.routing.topk_p);
}

}  // namespace

std::unique_ptr<TokenExchange> make_peer_exchange(const ExchangeSetup& setup) {
  return std::make_unique<PeerExchange>(setup);
}

}  // namespace moe
