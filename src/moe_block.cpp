// MoEBlock: SPEC.md's six steps forward, their mirror backward, over one GPU or an EP×DP mesh.
#include "moe/moe_block.h"

#include <nvtx3/nvToolsExt.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "comm/exchange.h"
#include "comm/peer_memory.h"
#include "kernels/elementwise.cuh"
#include "kernels/experts.h"
#include "kernels/gemm.h"
#include "kernels/permute.cuh"
#include "kernels/router.cuh"
#include "moe/device.h"
#include "moe/error.h"

namespace moe {
namespace {

// Per-stage CUDA events of the last forward and backward, when stage timing is on.
struct StageTimes {
  bool on = false;
  struct Stage {
    std::string name;
    Event start{true};
    Event stop{true};
  };
  std::deque<Stage> stages;  // reused: events are created once; nested stages keep their place
  std::size_t used = 0;
};

// A stage: an NVTX range (visible in Nsight Systems) and, with timing on, a pair of events.
class Range {
 public:
  Range(const char* name, StageTimes& times, cudaStream_t stream) : times_(times), stream_(stream) {
    nvtxRangePushA(name);
    if (!times_.on) return;
    if (times_.used == times_.stages.size()) times_.stages.emplace_back();
    stage_ = &times_.stages[times_.used++];
    stage_->name = name;
    stage_->start.record(stream_);
  }
  ~Range() {
    if (stage_ != nullptr) (void)cudaEventRecord(stage_->stop.get(), stream_);
    nvtxRangePop();
  }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  StageTimes& times_;
  cudaStream_t stream_;
  StageTimes::Stage* stage_ = nullptr;
};

// Grow-only device buffer viewed as a tensor of the requested shape.
Tensor view(DeviceBuffer& buffer, DType dtype, std::vector<std::int64_t> shape) {
  Tensor t(nullptr, dtype, std::move(shape));
  buffer.reserve(std::max<std::size_t>(t.bytes(), 16));
  t.data = buffer.data();
  return t;
}

template <typename T>
T* typed(DeviceBuffer& buffer, std::size_t count) {
  buffer.reserve(std::max<std::size_t>(count * sizeof(T), 16));
  return buffer.as<T>();
}

}  // namespace

// What a block needs only inside one call (MoEScratch): shared by the blocks built with it.
struct MoEScratch::Buffers {
  DeviceBuffer a;  // SwiGLU output; dA, then a again, in the backward
  // The peer exchange's Y (then dY, dX), mapped by every EP rank: made by the first block that
  // takes the peer exchange, shared by the blocks of the same mesh.
  std::unique_ptr<PeerBuffer> peer_Y;
  const Mesh* peer_mesh = nullptr;
  DeviceBuffer Y;  // EP: staging and expert output; dY to send, dX (not kept across calls)
  DeviceBuffer dY, router_ws, layout_ws, chunk_ws, dprob, dlogits, dlogits_low, nonfinite,
      grad_stage;
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const DeviceBuffer* b : {&a, &Y, &dY, &router_ws, &layout_ws, &chunk_ws, &dprob, &dlogits,
                                  &dlogits_low, &nonfinite, &grad_stage})
      total += b->bytes();
    return total + (peer_Y ? peer_Y->bytes() : 0);
  }
};

MoEScratch::MoEScratch() : buffers_(std::make_unique<Buffers>()) {}
MoEScratch::~MoEScratch() = default;
std::size_t MoEScratch::bytes() const {
  return buffers_->bytes();
}

struct MoEBlock::State {
  MoEConfig config;
  const Mesh& mesh;
  cudaStream_t stream;
  int E, E_loc, K;
  std::int64_t H, F;
  DType dtype;
  RouterParams router;
  GemmRunner gemm;
  // The gate's weight gradient beside its input gradient (the backward's last stage): neither
  // product fills the GPU, the first with E·H / tile ≈ 60–120 tiles over a long T.
  GemmRunner gate_weight_gemm;
  Stream gate_weight_stream;
  Event gate_fork, gate_join;
  ExpertFFN experts;
  std::optional<ExpertExchange> exchange;  // EP > 1

  DeviceBuffer own_gate, own_w13, own_w2, own_bias, own_dgate, own_dw13, own_dw2;
  MoEParameters params;
  MoEGradients grads;

  // Grow-only buffers. Those of one call only live in the scratch, possibly shared with other
  // blocks (MoEScratch): a, dY, the workspaces, dprob, dlogits; Y too, unless it is kept from
  // forward to backward (keep_expert_input without EP).
  std::shared_ptr<MoEScratch> scratch;
  MoEScratch::Buffers& scratch_buffers;
  DeviceBuffer &a, &dY, &router_ws, &layout_ws, &chunk_ws, &dprob, &dlogits, &dlogits_low,
      &nonfinite, &grad_stage;
  DeviceBuffer own_Y;
  DeviceBuffer& Y;

  DeviceBuffer logits, topk_idx, topk_p, counts, aux_counts, score_sum, z_sum, global_load, scalars;
  DeviceBuffer layout_counts, layout_offsets, row_map, recv_counts;
  // Each buffer serves several roles whose contents never live at the same time (docs/design.md,
  // "Buffers"): without EP, X also holds Y, dY and dX (Y and dY stay empty); under EP, Y also
  // stages received rows and holds dX, dY stages rows in the forward; a holds dA; h holds dh. A
  // role takes its buffer (view) only once the previous role's content is dead.
  DeviceBuffer send_rows, X, h, out;
  // The probability of each expert-major row (fp32 [rows]), beside X on one GPU, where the experts
  // weigh their output with it; their backward leaves its gradient there (docs/design.md,
  // "Probabilities inside the experts").
  DeviceBuffer row_prob;
  PinnedBuffer host_scalars;
  Event copied;
  // One GPU: the row counts go to the host on their own stream, off the permute's path.
  Stream count_stream;
  Event layout_built;
  DeviceBuffer dx;  // the backward's output
  Event initialized;  // initialize() waits for its writes

  // The peer exchange (EpTransport::kPeer, docs/design.md "Peer exchange"): the experts' input X
  // and output Y live in buffers every EP rank maps; senders store their rows straight into X and
  // load Y back, and Y then holds dY (stored by the senders) and dX (loaded by them). Unless X is
  // kept, X is Y's buffer too, stored again from x in the backward (one row buffer).
  struct Peer {
    explicit Peer(const Mesh& mesh) : X(mesh), row_prob(mesh) {}
    PeerBuffer X;
    PeerBuffer row_prob;  // fp32 [rows]: as State::row_prob, stored by the senders beside X
    // Y holds nothing from one call to the next (the combine keeps the rows it loaded), so the
    // blocks of one mesh share it through the scratch; a block of another mesh has its own.
    PeerBuffer* Y = nullptr;
    std::unique_ptr<PeerBuffer> own_Y;
    DeviceBuffer all_counts;  // [EP, E]: every EP rank's rows per global expert
    DeviceBuffer slot_rows;   // [T, K]: each slot's row on its expert's rank (the context)
    DeviceBuffer plan;        // shift [E], own offsets [E_loc + 1], own counts [E_loc]
    DeviceBuffer barrier;     // one int, zero, that the EP group all-reduces as a barrier
    PinnedBuffer host;        // the counts down, the plan up
    Event copied;
  };
  std::optional<Peer> peer;
  bool transport_decided = false;

  // The context of the last forward.
  bool has_context = false;
  Tensor x;
  std::int64_t T = 0;
  std::int64_t rows = 0;  // expert-major rows, padding included
  std::vector<std::int64_t> expert_offsets;
  std::int64_t global_tokens = 0;
  bool check_finite = false;
  StageTimes times;

  State(const MoEConfig& c, const Mesh& m, cudaStream_t s, std::shared_ptr<MoEScratch> shared,
        MoEScratch::Buffers& buffers)
      : config(c),
        mesh(m),
        stream(s),
        E(c.num_experts),
        E_loc(c.num_experts / m.ep()),
        K(c.topk),
        H(c.hidden),
        F(c.ffn_hidden),
        dtype(c.dtype),
        router(RouterParams::from(c)),
        gemm(static_cast<std::size_t>(c.gemm_workspace_mib) << 20),
        gate_weight_gemm(static_cast<std::size_t>(c.gemm_workspace_mib) << 20),
        experts(c.hidden, c.ffn_hidden, c.num_experts / m.ep(), c.dtype, ExpertSchedule::kBatched,
                4, static_cast<std::size_t>(c.activation_chunk_mib * (1 << 20)),
                static_cast<std::size_t>(c.gemm_workspace_mib) << 20),
        scratch(std::move(shared)),
        scratch_buffers(buffers),
        a(buffers.a),
        dY(buffers.dY),
        router_ws(buffers.router_ws),
        layout_ws(buffers.layout_ws),
        chunk_ws(buffers.chunk_ws),
        dprob(buffers.dprob),
        dlogits(buffers.dlogits),
        dlogits_low(buffers.dlogits_low),
        nonfinite(buffers.nonfinite),
        grad_stage(buffers.grad_stage),
        Y(m.ep() == 1 && c.keep_expert_input ? own_Y : buffers.Y) {}

  bool expert_parallel() const { return mesh.ep() > 1; }
  bool peer_exchange() const { return peer.has_value(); }
  // The experts weigh their rows by the routing probabilities (a scaled before the down product),
  // so the combine is a plain sum and its backward needs no Y: nothing [T·K, H] is kept for it,
  // and dprob comes from the experts' backward. Over NCCL each probability would need an
  // exchange of its own both ways, so there the combine weighs the returned rows as before.
  bool probabilities_in_experts() const { return !expert_parallel() || peer_exchange(); }
  // The probabilities beside the expert-major rows on this rank (see row_prob).
  Tensor expert_row_prob() {
    float* data = peer ? static_cast<float*>(peer->row_prob.local()) : row_prob.as<float>();
    return Tensor(data, DType::kFP32, {rows});
  }

  // Collective over the EP group, at the first forward under EP: the transport of the rows.
  void choose_transport() {
    if (transport_decided || !expert_parallel()) return;
    bool use_peer = false;
    if (config.ep_transport != EpTransport::kNccl) {
      use_peer = ep_group_has_peer_access(mesh, stream);
      if (!use_peer && config.ep_transport == EpTransport::kPeer) {
        fail(
            "MoEBlock: ep_transport = peer, but the EP group of {} ranks is not all on one host "
            "with peer access between its GPUs (at most {} ranks); use auto or nccl",
            mesh.ep(), kMaxPeerRanks);
      }
    }
    if (use_peer) {
      peer.emplace(mesh);
      auto& shared = scratch_buffers;
      if (shared.peer_Y == nullptr) {
        shared.peer_Y = std::make_unique<PeerBuffer>(mesh);
        shared.peer_mesh = &mesh;
      }
      if (shared.peer_mesh == &mesh) {
        peer->Y = shared.peer_Y.get();
      } else {
        peer->own_Y = std::make_unique<PeerBuffer>(mesh);
        peer->Y = peer->own_Y.get();
      }
      MOE_CHECK_CUDA(cudaMemsetAsync(typed<int>(peer->barrier, 1), 0, sizeof(int), stream));
    }
    transport_decided = true;
  }

  // Peer exchange: returns when every EP rank's work queued before it on its stream is done
  // (an all-reduce of a zero; the kernels fence their stores to other GPUs before exiting).
  void peer_barrier() const {
    mesh.all_reduce_sum(peer->barrier.data(), 1, ncclInt32, MeshGroup::kExpertParallel, stream);
  }

  // The slots' rows over the EP group's buffers of `rows` (X or Y).
  PeerRows peer_rows(const PeerBuffer& buffer) {
    PeerRows r;
    r.base = buffer.ranks();
    r.ranks = mesh.ep();
    r.experts_per_rank = E_loc;
    r.topk_idx = topk_idx.as<std::int32_t>();
    r.rows = peer->slot_rows.as<std::int32_t>();
    r.scalars = peer->row_prob.ranks();
    return r;
  }
  const std::int32_t* own_offsets() const { return peer->plan.as<std::int32_t>() + E; }
  const std::int32_t* own_counts() const { return own_offsets() + E_loc + 1; }

  // Dispatch over the peer exchange: all-gather the counts (the one host synchronisation, which
  // also brings the 16 bytes of T_glob and the losses into `scalars`), lay every rank's rows out
  // on the host, grow the buffers where needed, then store each slot's row of x at its place on
  // its expert's rank and wait for every rank's stores.
  void peer_dispatch(const Tensor& x, const std::int32_t* layout_counts,
                     const std::int64_t* global_tokens, void* scalars) {
    auto& p = *peer;
    const int EP = mesh.ep(), me = mesh.ep_index();
    const std::int64_t T = x.dim(0);
    const std::size_t counts_bytes = static_cast<std::size_t>(EP) * E * sizeof(std::int32_t);
    const std::size_t plan_count = static_cast<std::size_t>(E) + 2 * E_loc + 1;
    auto* all_counts = typed<std::int32_t>(p.all_counts, static_cast<std::size_t>(EP) * E);
    mesh.all_gather(layout_counts, all_counts, E * sizeof(std::int32_t), MeshGroup::kExpertParallel,
                    stream);
    p.host.reserve(16 + counts_bytes + plan_count * sizeof(std::int32_t));
    auto* host = p.host.as<char>();
    MOE_CHECK_CUDA(cudaMemcpyAsync(host, global_tokens, 16, cudaMemcpyDeviceToHost, stream));
    MOE_CHECK_CUDA(
        cudaMemcpyAsync(host + 16, all_counts, counts_bytes, cudaMemcpyDeviceToHost, stream));
    p.copied.record(stream);
    mesh.wait(p.copied.get(), "the dispatch counts all-gather");  // the one host synchronisation
    std::memcpy(scalars, host, 16);

    // Rows of (source s, global expert g): c[s·E + g]. On g's rank r, expert e = g − r·E_loc owns
    // a padded group; inside it the sources' rows follow in source order, each in token order.
    const auto* c = reinterpret_cast<const std::int32_t*>(host + 16);
    auto* plan = reinterpret_cast<std::int32_t*>(host + 16 + counts_bytes);
    std::int32_t* shift = plan;
    std::int32_t* own_offset = plan + E;
    std::int32_t* own_count = own_offset + E_loc + 1;
    std::vector<std::size_t> bytes(EP);
    std::int64_t sender_offset = 0;  // where this rank's rows of g start in its own layout
    for (int r = 0; r < EP; ++r) {
      std::int64_t offset = 0;
      for (int e = 0; e < E_loc; ++e) {
        const int g = r * E_loc + e;
        std::int64_t total = 0, before_me = 0;
        for (int src = 0; src < EP; ++src) {
          total += c[src * E + g];
          if (src < me) before_me += c[src * E + g];
        }
        shift[g] = static_cast<std::int32_t>(offset + before_me - sender_offset);
        sender_offset += c[me * E + g];
        if (r == me) {
          own_offset[e] = static_cast<std::int32_t>(offset);
          own_count[e] = static_cast<std::int32_t>(total);
        }
        offset += config.padded_rows(total);
      }
      if (offset > INT32_MAX)
        fail("rank {}: EP rank {} would receive {} rows, beyond the int32 row index", mesh.rank(),
             r, offset);
      if (r == me) own_offset[E_loc] = static_cast<std::int32_t>(offset);
      bytes[r] = static_cast<std::size_t>(offset) * H * dtype_size(dtype);
    }
    expert_offsets.assign(own_offset, own_offset + E_loc + 1);
    rows = expert_offsets.back();
    auto* plan_device = typed<std::int32_t>(p.plan, plan_count);
    MOE_CHECK_CUDA(cudaMemcpyAsync(plan_device, plan, plan_count * sizeof(std::int32_t),
                                   cudaMemcpyHostToDevice, stream));
    if (config.keep_expert_input) p.X.reserve(bytes, stream);
    p.Y->reserve(bytes, stream);
    std::vector<std::size_t> prob_bytes(EP);
    for (int r = 0; r < EP; ++r) prob_bytes[r] = bytes[r] / (H * dtype_size(dtype)) * sizeof(float);
    p.row_prob.reserve(prob_bytes, stream);

    auto* slot_rows = typed<std::int32_t>(p.slot_rows, static_cast<std::size_t>(T) * K);
    peer_row_map(row_map.as<std::int32_t>(), topk_idx.as<std::int32_t>(), plan_device, T * K,
                 slot_rows, stream);
    // One row buffer: Y's buffer, which a slower rank may still be loading the previous layer's
    // combine from; the counts all-gather above completed only once every rank's stream had
    // reached it, past that combine.
    peer_store_input(x, topk_p.as<float>());
  }

  // The peer exchange's expert input: x stored at every slot's row on its expert's rank (with
  // prob, each slot's probability beside it), then every rank waits for every rank's stores.
  PeerBuffer& peer_input_buffer() { return config.keep_expert_input ? peer->X : *peer->Y; }
  void peer_store_input(const Tensor& x, const float* prob = nullptr) {
    PeerBuffer& buffer = peer_input_buffer();
    peer_permute(x, peer_rows(buffer), K, own_offsets(), own_counts(), E_loc,
                 Tensor(buffer.local(), dtype, {rows, H}), stream, prob,
                 prob != nullptr ? static_cast<float*>(peer->row_prob.local()) : nullptr);
    peer_barrier();  // every rank's rows have landed in every buffer
  }

  // The experts' input and output rows (padded expert-major) on this rank.
  void* expert_input() { return peer ? peer_input_buffer().local() : X.data(); }
  void* expert_output() const { return peer ? peer->Y->local() : Y.data(); }

  // X, Y, dY and dX in one buffer, X permuted from x again in the backward (MoEConfig): X's
  // buffer on one GPU, the shared Y's under the peer exchange.
  bool one_row_buffer() const { return !expert_parallel() && !config.keep_expert_input; }
  bool peer_one_row_buffer() const { return peer_exchange() && !config.keep_expert_input; }

  void check(const char* stage, const Tensor& t) {
    if (!check_finite) return;
    int* count = typed<int>(nonfinite, 1);
    count_nonfinite(t, count, stream);
    int host = 0;
    MOE_CHECK_CUDA(cudaMemcpyAsync(&host, count, sizeof(int), cudaMemcpyDeviceToHost, stream));
    MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
    if (host > 0)
      fail("rank {}: stage '{}' produced {} NaN or Inf values in {}", mesh.rank(), stage, host,
           t.describe());
  }
};

MoEBlock::MoEBlock(const MoEConfig& config, const Mesh& mesh, cudaStream_t stream,
                   std::shared_ptr<MoEScratch> scratch) {
  config.validate();
  if (config.ep != mesh.ep() || config.dp != mesh.dp()) {
    fail("MoEBlock: config has ep = {}, dp = {} but the mesh is {} x {}", config.ep, config.dp,
         mesh.ep(), mesh.dp());
  }
  validate_mesh_shape(mesh.world_size(), mesh.ep(), mesh.dp(), config.num_experts);
  if (scratch == nullptr) scratch = std::make_shared<MoEScratch>();
  if (scratch->has_stream_ && scratch->stream_ != stream) {
    fail(
        "MoEBlock: stream = {}, but the shared scratch serves stream {} (blocks that share a "
        "scratch must run in order on one stream)",
        static_cast<const void*>(stream), static_cast<const void*>(scratch->stream_));
  }
  scratch->has_stream_ = true;
  scratch->stream_ = stream;
  MoEScratch::Buffers& buffers = *scratch->buffers_;
  s_ = std::make_unique<State>(config, mesh, stream, std::move(scratch), buffers);
  auto& s = *s_;
  if (s.expert_parallel()) s.exchange.emplace(mesh, config.num_experts);
  s.experts.set_host_wait([&mesh](cudaEvent_t event) {
    mesh.wait(event, "the work queued before the expert GEMMs' algorithm timing");
  });
  const std::int64_t E = s.E, E_loc = s.E_loc, H = s.H, F = s.F;
  s.params = {view(s.own_gate, s.dtype, {E, H}), view(s.own_w13, s.dtype, {E_loc, 2 * F, H}),
              view(s.own_w2, s.dtype, {E_loc, H, F}), view(s.own_bias, DType::kFP32, {E})};
  const DType grad = config.grad_dtype;
  s.grads = {view(s.own_dgate, DType::kFP32, {E, H}), view(s.own_dw13, grad, {E_loc, 2 * F, H}),
             view(s.own_dw2, grad, {E_loc, H, F})};
  initialize(0);
}

MoEBlock::~MoEBlock() = default;

const MoEConfig& MoEBlock::config() const {
  return s_->config;
}
const MoEParameters& MoEBlock::parameters() const {
  return s_->params;
}
const MoEGradients& MoEBlock::gradients() const {
  return s_->grads;
}
void MoEBlock::set_check_finite(bool on) {
  s_->check_finite = on;
}

void MoEBlock::bind(const MoEParameters& p, const MoEGradients& g) {
  auto& s = *s_;
  const std::int64_t E = s.E, E_loc = s.E_loc, H = s.H, F = s.F;
  expect_tensor(p.gate_weight, "MoEBlock::bind gate_weight", s.dtype, {E, H});
  expect_tensor(p.w13, "MoEBlock::bind w13", s.dtype, {E_loc, 2 * F, H});
  expect_tensor(p.w2, "MoEBlock::bind w2", s.dtype, {E_loc, H, F});
  expect_tensor(p.expert_bias, "MoEBlock::bind expert_bias", DType::kFP32, {E});
  expect_tensor(g.gate_weight, "MoEBlock::bind gradient of gate_weight", DType::kFP32, {E, H});
  const DType grad = s.config.grad_dtype;
  expect_tensor(g.w13, "MoEBlock::bind gradient of w13", grad, {E_loc, 2 * F, H});
  expect_tensor(g.w2, "MoEBlock::bind gradient of w2", grad, {E_loc, H, F});
  s.params = p;
  s.grads = g;
}

void MoEBlock::initialize(std::uint64_t seed) {
  auto& s = *s_;
  const auto first_expert = static_cast<std::uint64_t>(s.mesh.ep_index()) * s.E_loc;
  const auto w13_size = static_cast<std::uint64_t>(2 * s.F * s.H);
  const auto w2_size = static_cast<std::uint64_t>(s.H * s.F);
  // Distinct streams of numbers per tensor; a global expert's slice is the same on every rank.
  init_normal(s.params.gate_weight, seed, 0, 1.0f / std::sqrt(static_cast<float>(s.H)), s.stream);
  init_normal(s.params.w13, seed ^ 0x13, first_expert * w13_size,
              1.0f / std::sqrt(static_cast<float>(s.H)), s.stream);
  init_normal(s.params.w2, seed ^ 0x2, first_expert * w2_size,
              1.0f / std::sqrt(static_cast<float>(s.F)), s.stream);
  MOE_CHECK_CUDA(
      cudaMemsetAsync(s.params.expert_bias.data, 0, s.params.expert_bias.bytes(), s.stream));
  // Returns once the values are written. The caller may overwrite the parameters next from any
  // stream (a checkpoint loaded with cudaMemcpy, say), which nothing would order after these
  // writes: queued behind slow work, they used to land after the caller's own and replace them.
  s.initialized.record(s.stream);
  s.mesh.wait(s.initialized.get(), "the parameters' initialisation");
}

MoEForward MoEBlock::forward(const Tensor& x) {
  return run_forward(x, true);
}
MoEForward MoEBlock::infer(const Tensor& x) {
  return run_forward(x, false);
}

MoEForward MoEBlock::run_forward(const Tensor& x, bool save_context) {
  auto& s = *s_;
  const std::int64_t T = x.rank() == 2 ? x.dim(0) : -1;
  if (x.dtype != s.dtype || T < 0 || x.dim(1) != s.H) {
    fail("MoEBlock::forward: x must be {}[T, {}], got {}", dtype_name(s.dtype), s.H, x.describe());
  }
  if (x.data == nullptr && T > 0) fail("MoEBlock::forward: x has no data");
  if (T * s.K > INT32_MAX) fail("MoEBlock::forward: T = {} tokens exceed the int32 row index", T);
  s.has_context = false;  // a failure below leaves no half-built context
  s.times.used = 0;       // stage times restart with each forward; backward appends
  s.choose_transport();
  const cudaStream_t stream = s.stream;
  const int E = s.E, K = s.K;
  const std::int64_t H = s.H;

  // 1. Gate GEMM: logits[T, E] = x · Wgᵀ, fp32.
  const Tensor logits = view(s.logits, DType::kFP32, {T, E});
  {
    Range r("moe gate", s.times, stream);
    s.gemm.run({T, E, H, false, true, s.dtype, s.dtype, DType::kFP32}, x.data,
               s.params.gate_weight.data, logits.data, stream);
    s.check("gate", logits);
  }

  // 2. Router: top-K, probabilities, expert counts and the loss statistics.
  auto* topk_idx = typed<std::int32_t>(s.topk_idx, T * K);
  auto* topk_p = typed<float>(s.topk_p, T * K);
  auto* counts = typed<std::int32_t>(s.counts, E);
  auto* aux_counts = typed<std::int32_t>(s.aux_counts, E);
  auto* score_sum = typed<float>(s.score_sum, E);
  auto* z_sum = typed<float>(s.z_sum, 1);
  auto* global_load = typed<std::int32_t>(s.global_load, E);
  auto* global_tokens = typed<std::int64_t>(s.scalars, 2);  // [T_glob, losses as two floats]
  auto* losses = reinterpret_cast<float*>(global_tokens + 1);
  {
    Range r("moe router", s.times, stream);
    RouterForwardArgs a;
    a.logits = logits.data;
    a.tokens = T;
    a.expert_bias = s.config.expert_bias ? s.params.expert_bias.as<float>() : nullptr;
    a.topk_idx = topk_idx;
    a.topk_p = topk_p;
    a.tokens_per_expert = counts;
    a.aux_tokens_per_expert = aux_counts;
    a.aux_score_sum = score_sum;
    a.z_sum = z_sum;
    const std::size_t router_ws_bytes = router_workspace_bytes(s.router, T);
    if (s.router_ws.bytes() < router_ws_bytes) {  // a new allocation starts cleared
      s.router_ws.reserve(router_ws_bytes);
      router_workspace_clear(s.router, s.router_ws.data(), stream);
    }
    a.workspace = s.router_ws.data();
    if (s.mesh.world_size() == 1) {  // these tokens are the whole batch: losses come with it
      a.losses = losses;
      a.aux_loss_coeff = s.config.aux_loss_coeff;
      a.z_loss_coeff = s.config.z_loss_coeff;
    }
    router_forward(s.router, a, stream);
  }

  // 3. Aux losses over the whole mesh: statistics, loads and the token count summed over the world.
  {
    Range r("moe losses", s.times, stream);
    // Sized once for everything the forward copies to the host: never reallocated under a copy.
    s.host_scalars.reserve(16 + (E + 1) * sizeof(std::int32_t));
    MOE_CHECK_CUDA(cudaEventSynchronize(s.copied.get()));
    *s.host_scalars.as<std::int64_t>() = T;
    MOE_CHECK_CUDA(cudaMemcpyAsync(global_tokens, s.host_scalars.as<std::int64_t>(),
                                   sizeof(std::int64_t), cudaMemcpyHostToDevice, stream));
    MOE_CHECK_CUDA(cudaMemcpyAsync(global_load, counts, E * sizeof(std::int32_t),
                                   cudaMemcpyDeviceToDevice, stream));
    s.mesh.group_start();
    s.mesh.all_reduce_sum(global_tokens, 1, ncclInt64, MeshGroup::kWorld, stream);
    s.mesh.all_reduce_sum(global_load, E, ncclInt32, MeshGroup::kWorld, stream);
    if (s.router.aux_loss) {
      s.mesh.all_reduce_sum(aux_counts, E, ncclInt32, MeshGroup::kWorld, stream);
      s.mesh.all_reduce_sum(score_sum, E, ncclFloat32, MeshGroup::kWorld, stream);
    }
    if (s.router.z_loss) s.mesh.all_reduce_sum(z_sum, 1, ncclFloat32, MeshGroup::kWorld, stream);
    s.mesh.group_end("the loss statistics all-reduce");
    if (s.mesh.world_size() > 1)
      router_losses(s.router, s.config, aux_counts, score_sum, z_sum, global_tokens, losses,
                    stream);
  }

  // 4. Dispatch: the layout (padded expert-major on one rank; by global expert, unpadded, when
  //    sending), the rows, the counts (the one host synchronisation).
  auto* layout_counts = typed<std::int32_t>(s.layout_counts, E);
  auto* layout_offsets = typed<std::int32_t>(s.layout_offsets, E + 1);
  auto* row_map = typed<std::int32_t>(s.row_map, T * K);
  struct {
    std::int64_t tokens;
    float losses[2];
  } host{};
  {
    Range r("moe dispatch", s.times, stream);
    const int align = s.expert_parallel() ? 1 : s.config.align_size;
    s.layout_ws.reserve(layout_workspace_bytes(T, K, E));
    build_layout(
        {topk_idx, T, K, E, align, layout_counts, layout_offsets, row_map, s.layout_ws.data()},
        stream);
    if (!s.expert_parallel()) {
      // The permute starts as soon as the layout is built: the two copies on the main stream
      // were 9–10 µs of the dispatch (session-9 stage timing), and the host can learn the
      // counts while the GPU permutes, since X holds the most rows any routing can pad to.
      s.layout_built.record(stream);
      const cudaStream_t count_stream = s.count_stream.get();
      MOE_CHECK_CUDA(cudaStreamWaitEvent(count_stream, s.layout_built.get(), 0));
      MOE_CHECK_CUDA(cudaMemcpyAsync(s.host_scalars.as<char>(), global_tokens, 16,
                                     cudaMemcpyDeviceToHost, count_stream));
      MOE_CHECK_CUDA(cudaMemcpyAsync(s.host_scalars.as<char>() + 16, layout_offsets,
                                     (E + 1) * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                     count_stream));
      s.copied.record(count_stream);
      const std::int64_t max_rows = T * K + std::int64_t{E} * std::max(align - 1, 0);
      s.X.reserve(std::max<std::int64_t>(max_rows * H, 1) * dtype_size(s.dtype));
      s.row_prob.reserve(std::max<std::int64_t>(max_rows, 1) * sizeof(float));
      permute_rows(x, row_map, K, layout_offsets, layout_counts, E,
                   Tensor(s.X.data(), s.dtype, {max_rows, H}), stream, topk_p,
                   s.row_prob.as<float>());
      s.mesh.wait(s.copied.get(), "the forward's row counts");  // the one host synchronisation
      std::memcpy(&host, s.host_scalars.as<char>(), 16);
      const auto* off = reinterpret_cast<const std::int32_t*>(s.host_scalars.as<char>() + 16);
      s.expert_offsets.assign(off, off + E + 1);
      s.rows = s.expert_offsets.back();
    } else if (s.peer_exchange()) {
      s.peer_dispatch(x, layout_counts, global_tokens, &host);
    } else {
      const Tensor sent = view(s.send_rows, s.dtype, {T * K, H});
      permute_rows(x, row_map, K, layout_offsets, layout_counts, E, sent, stream);
      auto* recv_counts = typed<std::int32_t>(s.recv_counts, E);
      const auto& c =
          s.exchange->exchange_counts(layout_counts, recv_counts, global_tokens, &host, 16, stream);
      const std::int64_t received = c.total_received();
      const Tensor recv = view(s.Y, s.dtype, {received, H});  // Y is not written yet
      s.exchange->exchange_rows(sent.data, c.send_rows, recv.data, c.recv_rows,
                                H * dtype_size(s.dtype), stream);
      std::vector<std::int64_t> per_expert(s.E_loc, 0);
      for (int src = 0; src < s.mesh.ep(); ++src) {
        for (int e = 0; e < s.E_loc; ++e) per_expert[e] += c.received[src * s.E_loc + e];
      }
      s.expert_offsets.assign(s.E_loc + 1, 0);
      for (int e = 0; e < s.E_loc; ++e)
        s.expert_offsets[e + 1] = s.expert_offsets[e] + s.config.padded_rows(per_expert[e]);
      s.rows = s.expert_offsets.back();
      s.chunk_ws.reserve(chunk_workspace_bytes(s.mesh.ep(), s.E_loc));
      sort_chunks({recv_counts, s.mesh.ep(), s.E_loc, s.config.align_size, s.chunk_ws.data()}, recv,
                  view(s.X, s.dtype, {s.rows, H}), stream);
    }
    s.global_tokens = host.tokens;
  }
  const Tensor X(s.expert_input(), s.dtype, {s.rows, H});
  s.check("dispatch", X);

  // 5. Experts: h = X·w13ᵀ, a = silu(h_gate) ⊙ h_up, Y = a·w2ᵀ; with one row buffer Y is written
  //    over X (the backward permutes x again instead of keeping X, docs/design.md "Buffers").
  const Tensor Y = s.one_row_buffer() || s.peer_one_row_buffer() ? X
                   : s.peer_exchange() ? Tensor(s.expert_output(), s.dtype, {s.rows, H})
                                       : view(s.Y, s.dtype, {s.rows, H});
  {
    Range r("moe experts", s.times, stream);
    ExpertActivations act{
        .h = view(s.h, s.dtype, {s.rows, 2 * s.F}),
        .a = view(s.a, s.dtype, {s.experts.activation_rows(s.expert_offsets), s.F})};
    if (s.probabilities_in_experts()) act.scale = s.expert_row_prob();
    s.experts.forward(X, s.expert_offsets, s.params.w13, s.params.w2, act, Y, stream);
    s.check("experts", Y);
  }

  // 6. Combine: back to the senders (EP), then out[t] = Σ_k p[t,k] · Y_row(t,k) — a plain sum
  //    where the experts weighed their rows.
  const Tensor out = view(s.out, s.dtype, {T, H});
  {
    Range r("moe combine", s.times, stream);
    const Tensor* combined = &Y;
    Tensor returned;
    if (s.peer_exchange()) {
      s.peer_barrier();  // every rank's Y is complete
      peer_unpermute_combine(s.peer_rows(*s.peer->Y), nullptr, K, out, stream);
      combined = nullptr;
    } else if (s.expert_parallel()) {
      const auto& c = s.exchange->counts();
      const Tensor recv = view(s.dY, s.dtype, {c.total_received(), H});  // backward's, free now
      unsort_chunks({typed<std::int32_t>(s.recv_counts, E), s.mesh.ep(), s.E_loc,
                     s.config.align_size, s.chunk_ws.data()},
                    Y, recv, stream);
      returned = Tensor(s.send_rows.data(), s.dtype,
                        {T * K, H});  // the sender's layout, kept for backward
      s.exchange->exchange_rows(recv.data, c.recv_rows, returned.data, c.send_rows,
                                H * dtype_size(s.dtype), stream);
      combined = &returned;
    }
    if (combined != nullptr) {
      unpermute_combine(*combined, row_map, s.probabilities_in_experts() ? nullptr : topk_p, K, out,
                        stream);
    }
    s.check("combine", out);
  }

  s.x = x;
  s.T = T;
  s.has_context = save_context;
  return {out, host.losses[0], host.losses[1]};
}

Tensor MoEBlock::backward(const Tensor& dy) {
  auto& s = *s_;
  if (!s.has_context)
    fail(
        "MoEBlock::backward: no forward context (call forward first; backward runs once per "
        "forward)");
  expect_tensor(dy, "MoEBlock::backward dy", s.dtype, {s.T, s.H});
  s.has_context = false;
  const cudaStream_t stream = s.stream;
  const int E = s.E, K = s.K;
  const std::int64_t T = s.T, H = s.H, F = s.F, rows = s.rows;
  const std::size_t row_bytes = H * dtype_size(s.dtype);
  auto* row_map = s.row_map.as<std::int32_t>();
  auto* topk_p = s.topk_p.as<float>();
  auto* dprob = typed<float>(s.dprob, T * K);
  // One row buffer: it holds Y, then dY, X again and dX (docs/design.md, "Buffers"). Peer
  // exchange: Y's buffer holds dY, then dX.
  const Tensor rows_buffer(s.X.data(), s.dtype, {rows, H});
  const Tensor peer_Y =
      s.peer_exchange() ? Tensor(s.expert_output(), s.dtype, {rows, H}) : Tensor{};
  const Tensor dY = s.one_row_buffer()  ? rows_buffer
                    : s.peer_exchange() ? peer_Y
                                        : view(s.dY, s.dtype, {rows, H});
  const Tensor dx = view(s.dx, s.dtype, {T, H});

  // 6'. Combine backward. Probabilities inside the experts: dY(t, k) = dy[t] at every slot's row
  //     (dY over the dead Y), on the experts' ranks under the peer exchange; dprob comes from the
  //     experts' backward. Over NCCL against the Y the combine consumed, in the layout it consumed
  //     it, then back to the experts' ranks and into their padded layout.
  {
    Range r("moe combine backward", s.times, stream);
    if (s.peer_exchange()) {
      peer_permute(dy, s.peer_rows(*s.peer->Y), K, s.own_offsets(), s.own_counts(), s.E_loc, peer_Y,
                   stream);
      s.peer_barrier();  // every rank's dY has landed
    } else if (!s.expert_parallel()) {
      permute_rows(dy, row_map, K, s.layout_offsets.as<std::int32_t>(),
                   s.layout_counts.as<std::int32_t>(), E, dY, stream);
    } else {
      const auto& c = s.exchange->counts();
      const Tensor dY_sent = view(s.Y, s.dtype, {T * K, H});  // Y is dead: the combine kept its own
      combine_backward(dy, Tensor(s.send_rows.data(), s.dtype, {T * K, H}), row_map, topk_p, K,
                       s.layout_offsets.as<std::int32_t>(), s.layout_counts.as<std::int32_t>(), E,
                       dY_sent, dprob, stream);
      // The returned Y in send_rows is dead once the combine backward has read it.
      const Tensor recv = view(s.send_rows, s.dtype, {c.total_received(), H});
      s.exchange->exchange_rows(dY_sent.data, c.send_rows, recv.data, c.recv_rows, row_bytes,
                                stream);
      sort_chunks({s.recv_counts.as<std::int32_t>(), s.mesh.ep(), s.E_loc, s.config.align_size,
                   s.chunk_ws.data()},
                  recv, dY, stream);
    }
    s.check("combine backward", dY);
  }

  // 5'. Experts backward. In place: dh over h, dA over a (the SwiGLU backward reads each element
  //     before writing its gradient, and writes a there again for dw2). One row buffer: X
  //     permuted from x again over dY once dY is dead, dX over X once dw13 has read it. Else dX
  //     into Y, dead since the combine backward.
  const Tensor dX = s.one_row_buffer()  ? rows_buffer
                    : s.peer_exchange() ? peer_Y  // over dY, each expert's behind its dw2
                                        : Tensor(s.Y.data(), s.dtype, {rows, H});
  {
    Range r("moe experts backward", s.times, stream);
    const Tensor h(s.h.data(), s.dtype, {rows, 2 * F});
    const Tensor a(s.a.data(), s.dtype, {s.experts.activation_rows(s.expert_offsets), F});
    ExpertActivations act{.h = h, .a = a, .dA = a, .dh = h};
    if (s.probabilities_in_experts()) act.scale = act.dscale = s.expert_row_prob();
    ExpertFFN::RefillInput refill;
    if (s.one_row_buffer()) {
      refill = [&s, &rows_buffer, row_map, K, E](cudaStream_t on) {
        permute_rows(s.x, row_map, K, s.layout_offsets.as<std::int32_t>(),
                     s.layout_counts.as<std::int32_t>(), E, rows_buffer, on);
      };
    } else if (s.peer_one_row_buffer()) {
      // x stored into every rank's buffer again, once every rank has read its dY (the barrier
      // follows each rank's dw2); the store ends with the barrier that dw13 needs.
      refill = [&s](cudaStream_t) {
        s.peer_barrier();
        s.peer_store_input(s.x);
      };
    }
    s.experts.backward(dY, Tensor(s.expert_input(), s.dtype, {rows, H}), s.expert_offsets,
                       s.params.w13, s.params.w2, act, false, dX, s.grads.w13, s.grads.w2, stream,
                       refill);
    s.check("experts backward", dX);
  }

  // 4'. Dispatch backward: EP back to the senders; dx[t] = Σ_k dX_row(t,k).
  {
    Range r("moe dispatch backward", s.times, stream);
    const Tensor* rows_in = &dX;
    Tensor returned;
    if (s.peer_exchange()) {
      s.peer_barrier();  // every rank's dX is complete
      peer_unpermute_combine(s.peer_rows(*s.peer->Y), nullptr, K, dx, stream, dprob);
      rows_in = nullptr;
    } else if (s.expert_parallel()) {
      const auto& c = s.exchange->counts();
      const Tensor recv = view(s.dY, s.dtype, {c.total_received(), H});  // dead after the experts
      unsort_chunks({s.recv_counts.as<std::int32_t>(), s.mesh.ep(), s.E_loc, s.config.align_size,
                     s.chunk_ws.data()},
                    dX, recv, stream);
      returned = view(s.send_rows, s.dtype, {T * K, H});
      s.exchange->exchange_rows(recv.data, c.recv_rows, returned.data, c.send_rows, row_bytes,
                                stream);
      rows_in = &returned;
    }
    if (rows_in != nullptr && s.probabilities_in_experts()) {  // dprob from beside the rows
      unpermute_combine(*rows_in, row_map, nullptr, K, dx, stream, s.row_prob.as<float>(), dprob);
    } else if (rows_in != nullptr) {
      unpermute_combine(*rows_in, row_map, nullptr, K, dx, stream);
    }
    // The shared Y: the next block's combine backward may store its dY there as soon as this
    // rank moves on, while a slower rank still loads this block's dX.
    if (s.peer_exchange() && s.peer->own_Y == nullptr) s.peer_barrier();
  }

  // 2'-3'. Router backward with the loss gradients (mesh-wide f and T).
  const Tensor dlogits = view(s.dlogits, DType::kFP32, {T, E});
  {
    Range r("moe router backward", s.times, stream);
    RouterBackwardArgs a;
    a.logits = s.logits.data();
    a.tokens = T;
    a.topk_idx = s.topk_idx.as<std::int32_t>();
    a.topk_p = topk_p;
    a.dprob = dprob;
    a.aux_tokens_per_expert = s.router.aux_loss ? s.aux_counts.as<std::int32_t>() : nullptr;
    a.aux_factor = s.router.aux_loss ? aux_loss_factor(s.config, s.global_tokens) : 0.0f;
    a.z_factor = s.router.z_loss ? z_loss_factor(s.config, s.global_tokens) : 0.0f;
    a.dlogits = dlogits.as<float>();
    router_backward(s.router, a, stream);
    s.check("router backward", dlogits);
  }

  // 1'. Gate backward: dx += dlogits · Wg, dWg = dlogitsᵀ · x (fp32 accumulation), dWg on the
  //     side stream beside dx.
  {
    Range r("moe gate backward", s.times, stream);
    Tensor dl = dlogits;
    if (s.dtype == DType::kBF16) {  // the GEMM takes both operands in one dtype
      dl = view(s.dlogits_low, DType::kBF16, {T, E});
      convert(dlogits, dl, stream);
    }
    const cudaStream_t side = s.gate_weight_stream.get();
    s.gate_fork.record(stream);
    MOE_CHECK_CUDA(cudaStreamWaitEvent(side, s.gate_fork.get(), 0));
    s.gate_weight_gemm.run({E, H, T, true, false, s.dtype, s.dtype, DType::kFP32}, dl.data,
                           s.x.data, s.grads.gate_weight.data, side);
    s.gemm.run({T, H, E, false, false, s.dtype, s.dtype, s.dtype}, dl.data,
               s.params.gate_weight.data, dx.data, stream, 1.0f, 1.0f);
    s.gate_join.record(side);
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, s.gate_join.get(), 0));  // dl and dWg are done
    s.check("gate backward", dx);
  }
  return dx;
}

void MoEBlock::reduce_gradients() {
  auto& s = *s_;
  Range r("moe gradient reduction", s.times, s.stream);
  if (s.config.grad_dtype == DType::kBF16 && s.mesh.dp() > 1) {
    // NCCL would round every hop's partial sum to bf16: widen a chunk at a time to fp32, sum,
    // narrow back (SPEC.md: every reduction in fp32), through one bounded staging buffer.
    constexpr std::int64_t kStageElements = std::int64_t{16} << 20;  // 64 MiB of fp32
    for (const Tensor* grad : {&s.grads.w13, &s.grads.w2}) {
      const std::int64_t total = grad->numel();
      s.grad_stage.reserve(static_cast<std::size_t>(std::min(total, kStageElements)) * 4);
      for (std::int64_t first = 0; first < total; first += kStageElements) {
        const std::int64_t n = std::min(kStageElements, total - first);
        const Tensor part(static_cast<std::uint16_t*>(grad->data) + first, DType::kBF16, {n});
        const Tensor wide(s.grad_stage.data(), DType::kFP32, {n});
        convert(part, wide, s.stream);
        s.mesh.all_reduce_sum(wide.data, static_cast<std::size_t>(n), ncclFloat32,
                              MeshGroup::kDataParallel, s.stream);
        convert(wide, part, s.stream);
      }
    }
  } else {
    const ncclDataType_t grad = s.config.grad_dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat32;
    s.mesh.group_start();
    s.mesh.all_reduce_sum(s.grads.w13.data, s.grads.w13.numel(), grad, MeshGroup::kDataParallel,
                          s.stream);
    s.mesh.all_reduce_sum(s.grads.w2.data, s.grads.w2.numel(), grad, MeshGroup::kDataParallel,
                          s.stream);
    s.mesh.group_end("the expert gradient reduction");
  }
  s.mesh.all_reduce_sum(s.grads.gate_weight.data, s.grads.gate_weight.numel(), ncclFloat32,
                        MeshGroup::kWorld, s.stream);
}

MoERouting MoEBlock::routing() const {
  auto& s = *s_;
  return {Tensor(s.topk_idx.data(), DType::kInt32, {s.T, s.K}),
          Tensor(s.topk_p.data(), DType::kFP32, {s.T, s.K}),
          Tensor(s.counts.data(), DType::kInt32, {s.E})};
}

EpTransport MoEBlock::ep_transport() const {
  const auto& s = *s_;
  if (!s.transport_decided) return EpTransport::kAuto;
  return s.peer_exchange() ? EpTransport::kPeer : EpTransport::kNccl;
}

bool MoEBlock::probabilities_in_experts() const {
  const auto& s = *s_;
  return (s.transport_decided || !s.expert_parallel()) && s.probabilities_in_experts();
}

void MoEBlock::set_stage_timing(bool on) {
  s_->times.on = on;
  s_->times.used = 0;
}

std::vector<MoEBlock::StageTime> MoEBlock::stage_times() const {
  std::vector<StageTime> out;
  for (std::size_t i = 0; i < s_->times.used; ++i) {
    const auto& stage = s_->times.stages[i];
    MOE_CHECK_CUDA(cudaEventSynchronize(stage.stop.get()));
    out.push_back({stage.name, stage.stop.elapsed_ms_since(stage.start)});
  }
  return out;
}

void MoEBlock::update_expert_bias(float rate) {
  auto& s = *s_;
  if (!s.config.expert_bias)
    fail("MoEBlock::update_expert_bias: the config has expert_bias = false");
  if (s.global_load.data() == nullptr)
    fail("MoEBlock::update_expert_bias: no forward has counted the loads yet");
  moe::update_expert_bias(s.params.expert_bias.as<float>(), s.global_load.as<std::int32_t>(), s.E,
                          rate, s.stream);
}

}  // namespace moe
