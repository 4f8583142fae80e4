// How this rank's routed rows reach their experts and come back: the forward's steps around the
// experts (permute, dispatch; combine, unpermute) and their mirrors in the backward, in the spirit
// of NCCL's transports. Three implementations (docs/design.md, "The exchange across EP × DP"):
//
//   local (one EP rank, src/exchange_local.cpp): the permute writes the experts' input itself;
//     dispatch and combine move nothing.
//   nccl (src/exchange_nccl.cpp): rows gathered by global expert into a send buffer, crossed by an
//     all-to-allv, sorted from (source, expert) chunks into the padded layout, and back.
//   peer (src/exchange_peer.cpp): every EP rank maps the experts' input and output buffers of the
//     others; senders store their rows straight into them and load the results back.
//
// Each owns its row buffers (the call-only ones through MoEScratch) and what the forward keeps for
// the backward. Every verb queues its work on the block's stream; only dispatch blocks the host,
// once per forward, for the row counts (with fixed groups only where asked to). The forward runs
// permute, dispatch, expert_rows, then await_rows and combine chunk by chunk, unpermute in this
// order; the backward unpermute_backward, combine_backward, expert_grad_rows, then await_rows and
// dispatch_backward chunk by chunk, permute_backward, once per forward.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "kernels/experts.h"
#include "kernels/fp8_quantize.cuh"
#include "moe/config.h"
#include "moe/mesh.h"
#include "moe/tensor.h"
#include "src/scratch.h"

namespace moe {

// This rank's routing as the router leaves it on the device.
struct SlotRouting {
  const std::int32_t* topk_idx = nullptr;  // [T, K]: each slot's global expert
  const float* topk_p = nullptr;           // [T, K]: its probability
  // Bytes on the device (the router's T_glob and loss values, a multiple of 8) that the host must
  // learn in the forward: the exchange copies them with its row counts, in the same host
  // synchronisation.
  const void* totals = nullptr;
  std::size_t totals_bytes = 0;
  // Capacity mode's dropped slots name group E (topk_idx = E, topk_p = 0). Every exchange builds
  // its layout over the E experts' groups, which gives them no row: nothing is stored, sent or
  // added for them.
  // pad_to_capacity: every expert's group takes exactly expert_group_rows rows (its kept rows,
  // then zero rows; C, which is 0 at T = 0); without fixed groups each group is padded to
  // align_size alone.
  bool fixed_groups = false;
  std::int64_t expert_group_rows = 0;
  // Whether dispatch copies `totals` (and the row counts) to the host and waits for them. False
  // only with fixed groups, whose layout the host knows beforehand.
  bool to_host = true;
  // Chunks of local experts that a pipelining exchange cuts the forward and backward into (1:
  // none). The NCCL and copy exchanges pipeline; the peer exchange takes one chunk whatever this
  // says.
  int expert_chunks = 1;
};

// The one chunk of an exchange that does not pipeline: every local expert.
inline constexpr ExpertSpan kEveryExpert[1] = {ExpertSpan{}};

// The experts' rows on this rank, padded expert-major (docs/design.md, "Dispatch").
struct ExpertRows {
  Tensor input;   // X [rows, H]
  Tensor output;  // Y [rows, H]; may be X's buffer (one row buffer, docs/design.md "Buffers")
  // fp32 [rows]: each row's probability where the experts weigh their output with it; Tensor{}
  // where the unpermute weighs the rows instead.
  Tensor scale;
  std::span<const std::int64_t> offsets;  // host [E_loc + 1]: expert e owns [offsets[e], [e + 1])
  // The chunks of consecutive local experts, in the order their rows arrive (one chunk of every
  // expert unless the exchange pipelines).
  std::span<const ExpertSpan> chunks = kEveryExpert;
  // X's E4M3 codes and scales where the exchange wrote them beside X for the FP8 experts (the
  // local exchange's permute; over NCCL, the chunk sort of fp8_dispatch's records), which then need
  // not quantize X; none otherwise. They cover every expert's rows, whichever chunk runs.
  QuantizedRows input_codes{};
};

// The same rows in the backward: dY in, dX out, X where it was kept.
struct ExpertGradRows {
  Tensor dY;     // [rows, H]
  Tensor input;  // X [rows, H]: as the forward's, or written again by refill
  Tensor dX;     // [rows, H]; may share dY's or X's buffer
  Tensor scale;  // as ExpertRows::scale; the experts' backward leaves each gradient in its place
  std::span<const std::int64_t> offsets;
  ExpertFFN::RefillInput refill;  // writes X again where the forward's X was not kept
  std::span<const ExpertSpan> chunks = kEveryExpert;
  QuantizedRows dY_codes{};  // dY's, as ExpertRows::input_codes
};

class TokenExchange {
 public:
  virtual ~TokenExchange() = default;

  // kNccl or kPeer; kAuto for the local exchange (no EP group).
  virtual EpTransport transport() const = 0;
  // Whether the experts weigh their rows by the probabilities (docs/design.md, "Probabilities
  // inside the experts"), so that the unpermute is a plain sum and dprob comes from beside the
  // rows; otherwise the unpermute weighs them and its backward forms dprob.
  virtual bool probabilities_in_experts() const = 0;
  // Whether the rows travel on a stream of the exchange's own once dispatch() and
  // combine_backward() have queued them: work forked from the block's stream after those calls
  // then runs beside the transfers (the shared expert does). Otherwise the transfers hold the
  // block's stream, and such work would only start behind them.
  virtual bool transfers_beside_the_stream() const { return false; }

  // Forward. x [T, H] (the same in both calls) stays valid until the backward.
  // Lays the T·K slots out by expert (the row map) and gathers x's rows into the layout this
  // transport sends from; the peer exchange gathers nothing here, it stores in dispatch.
  virtual void permute(const Tensor& x, const SlotRouting& routing) = 0;
  // The rows reach their experts' ranks in the padded expert-major layout, and the host learns
  // the row counts and routing.totals (into `totals`): the forward's one host synchronisation.
  // Without routing.to_host, `totals` is null and the host learns nothing.
  virtual void dispatch(const Tensor& x, void* totals) = 0;
  // Where the experts read and write; may grow the output buffer.
  virtual ExpertRows expert_rows() = 0;
  // Pipelined (ExpertRows::chunks holds several): the block's stream waits until this chunk's
  // rows are in place, the dispatch's in the forward and the combine backward's in the backward;
  // the chunks after it are still on their way. Nothing where the exchange does not pipeline.
  virtual void await_rows(int /*chunk*/) {}
  // The experts' output of this chunk (once the work queued on the block's stream so far is done)
  // becomes readable where its senders sum it; called for each chunk in order. Pipelined, the
  // transfers stay on the exchange's stream: the block's stream takes them up in unpermute (and
  // dispatch_backward's in permute_backward), so that work queued between stays beside them.
  virtual void combine(int chunk) = 0;
  // out [T, H]: out[t] = Σ_k y(t, k), weighed by p[t, k] unless the experts did, fp32 in slot
  // order.
  virtual void unpermute(const Tensor& out) = 0;

  // Backward. dy [T, H] to each slot's row; weighed by p and with dprob [T, K] = ⟨dy, y⟩ where
  // the unpermute weighed the rows (dprob is left alone otherwise).
  virtual void unpermute_backward(const Tensor& dy, float* dprob) = 0;
  // The slots' rows of dY reach the experts' ranks in the padded layout.
  virtual void combine_backward() = 0;
  // For the experts' backward; x is the forward's, for a refill.
  virtual ExpertGradRows expert_grad_rows(const Tensor& x) = 0;
  // The rows of dX of this chunk become readable where their senders sum them; called for each
  // chunk in order, as combine.
  virtual void dispatch_backward(int chunk) = 0;
  // dx [T, H]: dx[t] = Σ_k dX(t, k), and dprob [T, K] from beside the rows where the experts
  // applied the probabilities.
  virtual void permute_backward(const Tensor& dx, float* dprob) = 0;
};

// The streams on which the exchanges alive in this process queue collectives of their own (the
// NCCL exchange's), by mesh. A split-phase step leaves its transfers in flight there while other
// blocks run, so a buffer growth, whose free waits for the whole device, and a block's destruction
// first wait for those of their mesh (drain_streams).
class ExchangeStreamRegistration {
 public:
  ExchangeStreamRegistration(cudaStream_t stream, const Mesh& mesh);
  ~ExchangeStreamRegistration();
  ExchangeStreamRegistration(const ExchangeStreamRegistration&) = delete;
  ExchangeStreamRegistration& operator=(const ExchangeStreamRegistration&) = delete;

 private:
  cudaStream_t stream_;
  const Mesh* mesh_;
};
// Waits, under the mesh's timeout, for the work queued so far on `stream` and on every exchange
// stream registered with the mesh, but for those capturing a CUDA graph (their work runs at the
// graph's launch); `what` names it in a timeout's error.
void drain_streams(const Mesh& mesh, cudaStream_t stream, const char* what);

struct ExchangeSetup {
  const MoEConfig& config;
  const Mesh& mesh;
  cudaStream_t stream;
  MoEScratch::Buffers& scratch;  // shared with the blocks built with the same MoEScratch
};

// Whether make_token_exchange communicates: under EP it is collective over the EP group (every
// rank votes on peer access, so the group always agrees), so it must run where every rank of the
// group is, which the block's first forward is. On one EP rank it may run at construction.
bool choosing_exchange_is_collective(const Mesh& mesh);
// The exchange config.ep_transport asks for, auto resolved: peer where the EP group allows it.
std::unique_ptr<TokenExchange> make_token_exchange(const ExchangeSetup& setup);

}  // namespace moe
