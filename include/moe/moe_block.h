// moe::MoEBlock: the whole MoE layer of docs/design.md, forward and backward at one boundary, on
// one GPU or on an EP×DP mesh.
//
//   moe::MoEBlock block(config, mesh, stream);
//   block.initialize(seed);                       // or bind() the trainer's own memory
//   auto [out, aux_loss, z_loss, losses] = block.forward(x);
//   Tensor dx = block.backward(dy);               // fills block.gradients()
//   block.reduce_gradients();                     // sums over the mesh (the trainer scales)
//
// forward saves a context that the next backward consumes; x must stay valid until then. One host
// synchronisation per forward (the routed row counts), none in backward; no device allocation per
// step once the buffers have grown to the batch size. The layers of a model share one MoEScratch:
//
//   auto scratch = std::make_shared<moe::MoEScratch>();
//   for (auto& config : layers) blocks.emplace_back(config, mesh, stream, scratch);
//
// Static shapes (capacity_factor with pad_to_capacity; under EP over the NCCL exchange's fixed
// blocks): no host synchronisation at all with ForwardOptions::losses_on_host = false (under EP
// but for a forward at a new token count), and, once one eager step (forward, backward,
// reduce_gradients) has run at a token count, forward, infer, backward and reduce_gradients at
// that count may be captured in a CUDA graph on the block's stream (moe::CudaGraph, or the
// trainer's own capture); a call that cannot be captured throws before it queues anything:
//
//   moe::ForwardOptions on_device;
//   on_device.losses_on_host = false;
//   block.forward(x, on_device); block.backward(dy); block.reduce_gradients();   // prepares
//   moe::CudaGraph step(stream, [&] {
//     block.forward(x, on_device);
//     block.backward(dy);
//     block.reduce_gradients();
//   });
//   step.replay(stream);                          // equals the eager step, bitwise
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moe/config.h"
#include "moe/mesh.h"
#include "moe/tensor.h"

namespace moe {

// Parameter and gradient views. Layouts (nn.Linear, out × in):
//   gate_weight [E, H] (dtype), w13 [E_loc, 2F, H] (gate rows then up rows), w2 [E_loc, H, F]
//   (dtype), expert_bias [E] (fp32); with shared experts (config.shared_ffn_hidden Fs > 0),
//   replicated on every rank: shared_w13 [2Fs, H] (gate rows then up rows), shared_w2 [H, Fs]
//   (dtype), and with config.shared_gate shared_gate_weight [1, H] (dtype); empty otherwise.
// Gradients: the same shapes (no bias gradient); gate_weight and shared_gate_weight in fp32, the
// expert and shared FFN weights in config.grad_dtype.
struct MoEParameters {
  Tensor gate_weight;
  Tensor w13;
  Tensor w2;
  Tensor expert_bias;
  Tensor shared_w13;
  Tensor shared_w2;
  Tensor shared_gate_weight;
};
struct MoEGradients {
  Tensor gate_weight;
  Tensor w13;
  Tensor w2;
  Tensor shared_w13;
  Tensor shared_w2;
  Tensor shared_gate_weight;
};

// The last forward's routing on this rank (views valid until the next forward).
struct MoERouting {
  Tensor topk_idx;           // [T, K] int32, descending score order
  Tensor topk_p;             // [T, K] fp32, scaled
  Tensor tokens_per_expert;  // [E] int32, this rank's slots that kept their row
  // Capacity mode only (empty tensors when dropless: every slot kept): kept [T, K] int32 is 1
  // where the slot kept its row, dropped_per_expert [E] int32 counts the others. A dropped slot
  // keeps its topk_idx and topk_p.
  Tensor kept;
  Tensor dropped_per_expert;
};

// What one forward may be told beyond its input.
struct ForwardOptions {
  // Routing replay: int32 [T, K] on the device, each token's experts in slot order, such as a
  // recorded step's routing().topk_idx (record_routing copies it out). The router takes these
  // experts instead of selecting and recomputes their probabilities from the current logits, so
  // the gradient flows through them; the losses are computed as usual. Replaying the recorded
  // step's own routing reproduces the step bitwise. Empty (the default): the router selects.
  // The given experts are checked on the host, so a replayed forward always waits for them.
  Tensor replay_topk_idx;
  // Whether MoEForward::aux_loss and z_loss are filled in, which takes a host wait. A dropless
  // forward waits anyway (for the row counts) and fills them whatever this says. A block of
  // static shapes (capacity_factor with pad_to_capacity) needs nothing from the device:
  // with false its forward does not wait at all (under EP but at a new token count), the floats are
  // NaN and the values stay on the device in MoEForward::losses; on a mesh the ranks' agreement on
  // the forward is then left to synchronize(). A forward captured in a CUDA graph must pass false.
  bool losses_on_host = true;
  // With fp8: the expert weights are those of the previous forward, unchanged (a micro-batch
  // after the first of an optimizer step), so their FP8 copy is reused instead of quantized
  // again. The block quantizes anyway when its weights were bound or initialized since, or on the
  // first forward. A trainer sets it only between optimizer updates: a stale copy is not detected.
  // A CUDA graph replayed across optimizer steps must be captured with false, so that every
  // replay quantizes; captured with true, it holds no quantization at all.
  bool weights_unchanged = false;
};

// Per-expert load over the steps since construction or reset_load_statistics(): the mesh-wide
// tokens routed to each expert, summed over the forwards, int64 [E] on the device, and in
// capacity mode the mesh-wide slots each expert dropped over the same forwards. The block adds
// each forward's counts on its stream with no host synchronisation (the drops travel in the
// router's all-reduce: no collective of their own); read them with a copy queued on that stream,
// or after synchronize().
struct MoELoadStatistics {
  // [E] int64, routed before any drop (all zero before the first forward). An expert's kept
  // slots are its tokens less its drops.
  Tensor tokens_per_expert;
  Tensor dropped_per_expert;  // [E] int64 in capacity mode, the empty tensor when dropless
  std::int64_t steps = 0;     // forwards counted
};

// How uneven a load is: the largest over the mean, per expert and per EP rank (whose experts are
// the consecutive E/ep); 1 is perfectly even (and what a load of no tokens reports).
struct LoadImbalance {
  double expert = 1.0;
  double ep_rank = 1.0;
};
LoadImbalance load_imbalance(std::span<const std::int64_t> tokens_per_expert, int ep);

struct MoEForward {
  Tensor out;  // [T, H], x's dtype, owned by the block until the next forward
  // L_aux and L_z on the host; NaN where the forward did not wait (ForwardOptions::losses_on_host).
  float aux_loss = 0.0f;
  float z_loss = 0.0f;
  // fp32 [2] on the device, {L_aux, L_z}, written on the block's stream; valid until the next
  // forward. What a captured forward leaves for the trainer's own graph to read.
  Tensor losses;
};

// Device memory a block needs only inside one forward or one backward call: the SwiGLU output,
// the router's and the layout's workspaces, dlogits and dprob, the staging of the EP exchanges.
// Blocks built with one scratch keep these once between them instead of once each (a model of L
// layers: once, sized for its largest layer), which is safe because their calls never overlap:
// they must all run on one stream, in the order a trainer runs its layers; a block on another
// stream is refused. What a block keeps from forward to backward stays its own. A scratch of
// blocks on a mesh holds buffers that every rank of the EP group maps: destroy it, like the
// blocks, before their mesh.
class MoEScratch {
 public:
  MoEScratch();
  ~MoEScratch();
  MoEScratch(const MoEScratch&) = delete;
  MoEScratch& operator=(const MoEScratch&) = delete;
  std::size_t bytes() const;  // device memory held now
  struct Buffers;             // defined in src/scratch.h

 private:
  friend class MoEBlock;
  std::unique_ptr<Buffers> buffers_;
  bool has_stream_ = false;
  cudaStream_t stream_ = nullptr;
};

class MoEBlock {
 public:
  // scratch: shared with the model's other blocks (see MoEScratch); null: a scratch of its own.
  MoEBlock(const MoEConfig& config, const Mesh& mesh, cudaStream_t stream,
           std::shared_ptr<MoEScratch> scratch = nullptr);
  // On a mesh of several ranks, first waits for the block's stream under the mesh's timeout, and
  // aborts the mesh where that fails (about two timeouts at most, the abort's included): its
  // frees would otherwise wait for the device with no limit. The stream must outlive the block.
  ~MoEBlock();
  MoEBlock(const MoEBlock&) = delete;
  MoEBlock& operator=(const MoEBlock&) = delete;

  const MoEConfig& config() const;
  // Views of the parameters and gradients in use (the block's own, or those bound).
  const MoEParameters& parameters() const;
  const MoEGradients& gradients() const;
  // Use memory the trainer owns; shapes, dtypes and the 16-byte alignment of every GEMM operand
  // are checked first (nothing changes on error).
  void bind(const MoEParameters& parameters, const MoEGradients& gradients);
  // Seeded initialisation, identical on every rank for the same global expert: gate and experts
  // ~ N(0, 1/fan_in), bias 0. The constructor runs it with seed 0. It returns once the values are
  // written, so that the caller may then overwrite parameters() from any stream.
  void initialize(std::uint64_t seed);

  // On a mesh of several ranks, a forward, infer, backward, reduce_gradients or
  // update_expert_bias that throws aborts the mesh's communicators first: the error names the
  // rank, the call and the stage; the peers fail at their next wait, within the mesh's timeout;
  // every later use of the mesh throws. Recovering means a new mesh and new blocks.
  //
  // x [T, H] in config.dtype, 16-byte aligned (as dy is). Saves the context for backward.
  MoEForward forward(const Tensor& x, const ForwardOptions& options = {});
  // Evaluation: the same output, no context saved (a later backward is an error).
  MoEForward infer(const Tensor& x, const ForwardOptions& options = {});
  // dy [T, H]: returns dx [T, H] (owned by the block until the next backward) and writes this
  // rank's gradients (overwritten, not accumulated). Once per forward.
  Tensor backward(const Tensor& dy);

  // Split-phase step (docs/design.md, "Split-phase calls"): forward() and backward() in three
  // calls each, so that a trainer may queue other work on the block's stream between them (a
  // second micro-batch's attention, another block's phases) while this block's rows cross the EP
  // group on the exchange's own stream:
  //
  //   block.forward_dispatch(x);            // gate, router, permute; the rows leave
  //   ...                                   // other work, beside the dispatch's transfers
  //   block.forward_experts();              // the expert FFNs; their rows start back
  //   ...                                   // other work, beside the combine's transfers
  //   MoEForward f = block.forward_combine();
  //   block.backward_combine(dy);           // dy's rows leave for the experts
  //   block.backward_experts();             // the experts' backward; dX starts back
  //   Tensor dx = block.backward_dispatch();  // router and gate backward
  //
  // The results are the whole calls' bits. The phases run in this order, each once: a call out of
  // turn is refused (nothing queued, the step as it was), naming the call that is due, and so is
  // every other call of the block until the step's phase ends (forward_combine, then
  // backward_dispatch). x stays valid until the backward, dy until backward_dispatch. Blocks that
  // share a MoEScratch hold it from forward_dispatch to forward_combine and from backward_combine
  // to backward_dispatch: the others' calls that use it are refused meanwhile (interleaved blocks
  // take a scratch each). A refused argument leaves the step and the last forward's context as
  // they were; a phase that throws after that leaves the block with no step under way and no
  // context (and, on a mesh of several ranks, aborts the mesh, as the whole calls do). In a CUDA
  // graph a phase is captured only in the graph of the rest of its forward or backward; a step
  // whose capture ended between its phases is dropped at the next call. The transfers run beside
  // other work over the NCCL and copy exchanges (on a stream of their own); on one EP rank and
  // over the peer exchange the phases run in stream order, with the same results.
  void forward_dispatch(const Tensor& x, const ForwardOptions& options = {});
  void forward_experts();
  MoEForward forward_combine();
  void backward_combine(const Tensor& dy);
  void backward_experts();
  Tensor backward_dispatch();
  // Sums the gradients over the mesh: experts over the DP group, the gate over the world.
  void reduce_gradients();
  // Waits until the block's queued work is done, within the mesh's timeout, polling the mesh's
  // communicators for errors: where a trainer would synchronise its stream at the end of a step,
  // this returns or throws, where a stream synchronisation would wait forever on a peer that
  // failed. On a mesh it is also the step's commit point: every rank calls it once per step, and
  // it returns only when every rank has reached the same call (one small all-reduce over the
  // world), so a rank whose peers gave up on it throws here instead of keeping a step whose
  // collectives ran without them.
  void synchronize();
  MoERouting routing() const;
  // Routing record: copies the last forward's topk_idx into `topk_idx` (device int32 [T, K]),
  // queued on the block's stream (no host synchronisation); ForwardOptions::replay_topk_idx
  // takes it back.
  void record_routing(const Tensor& topk_idx) const;
  // How rows cross the EP group: kPeer, kNccl or kCopy once the first forward under EP has chosen
  // (config.ep_transport, kAuto resolved); kAuto before that and on a single EP rank.
  EpTransport ep_transport() const;
  // Whether the experts weigh their rows by the routing probabilities, so that the combine is a
  // plain sum and keeps nothing for its backward (one GPU, the peer exchange), or the combine
  // weighs the rows it gets back (EP over NCCL or the copy engines). Under EP it is known after the
  // first forward (with the transport); before that it answers false.
  bool probabilities_in_experts() const;
  // Aux-loss-free balancing with the mesh-wide loads of the last forward.
  void update_expert_bias(float rate);
  // The load statistics (views valid for the block's life), and their reset, queued on the
  // block's stream.
  MoELoadStatistics load_statistics() const;
  void reset_load_statistics();
  // Check mode: after each stage, raise a moe::Error naming the first stage (and rank) whose
  // output holds NaN or Inf. Off by default (it synchronises).
  void set_check_finite(bool on);
  // Stage timing for benchmarks: with it on, every stage records a pair of CUDA events;
  // stage_times() waits for them and returns the last forward's stages, then the backward's.
  struct StageTime {
    std::string name;
    float ms = 0.0f;
  };
  void set_stage_timing(bool on);
  std::vector<StageTime> stage_times() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
  // The phases' bodies (src/moe_block_step.cpp); the public calls check the order around them.
  void dispatch_phase(const Tensor& x, const ForwardOptions& options, bool save_context);
  void experts_phase();
  MoEForward combine_phase();
  void combine_backward_phase(const Tensor& dy);
  void experts_backward_phase();
  Tensor dispatch_backward_phase();
};

}  // namespace moe
