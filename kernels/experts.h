// The experts on the GPU: every local expert's SwiGLU FFN over its row group of the padded
// expert-major buffer, forward and backward.
//
// Weights follow PyTorch nn.Linear (out_features × in_features, row-major), so checkpoints map
// without transposes:
//   w13 [E_loc, 2F, H]: rows [0, F) are gate_proj.weight, rows [F, 2F) up_proj.weight;
//   w2  [E_loc, H, F]:  down_proj.weight.
// h = X·w13ᵀ, a = silu(h_gate) ⊙ h_up, y = a·w2ᵀ; backward dA = dY·w2, dw2 = dYᵀ·a,
// dX = dh·w13, dw13 = dhᵀ·X. Weight gradients may be bf16 or fp32 (fp32 accumulation either way).
//
// Three schedules for the per-expert products (row counts are known on the host):
//   streams: one cuBLASLt matmul per expert, spread over several streams joined by events;
//   batched: the same, but experts whose products have one shape (equal padded row counts, which
//            top-K routing with alignment padding makes common) share one pointer-array batched
//            cuBLASLt call; ~8 calls instead of 128 per step at E_loc = 128 (the default);
//   grouped: one cublasGemmGroupedBatchedEx call per step, products of one shape in one group
//            (it takes no bf16 -> fp32 products: fp32 weight gradients of bf16 run batched).
//
// Activation chunks: the SwiGLU output a (and dA in the backward) holds nothing from one pass to
// the next, so it need not span every row. With a chunk budget, the rows are cut into chunks of
// whole experts (an expert larger than a chunk into near-equal pieces) and a is made and consumed
// one chunk at a time in a buffer of one chunk: forward SwiGLU then the down products; backward
// dA, SwiGLU backward, then dw2 (an expert cut into pieces sums its dw2 over them, beta = 1).
// At mixtral-8x7b, T = 8192, a is 0.44 GiB over all rows against 64 MiB in chunks.
//
// Row weights (ExpertActivations::scale): a·diag(p) before the down product, so that the caller's
// combine is a plain sum and its backward needs no y (docs/design.md).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "gemm.h"
#include "moe/device.h"
#include "moe/tensor.h"

namespace moe {

enum class ExpertSchedule { kStreams, kBatched, kGrouped };

// The local experts [first, end) whose products a call runs; the others' rows, outputs and weight
// gradients are left alone, so that a caller can run the experts in turn as their rows arrive
// (the pipelined exchange). Each product is launched as the call over every expert launches it
// (the same batches' size classes and alignments, hence the same algorithms), so that running
// the spans in turn gives the bits of one call over all (batched and stream schedules).
struct ExpertSpan {
  int first = 0;
  int end = std::numeric_limits<int>::max();  // clamped to the local experts
};
std::string_view expert_schedule_name(ExpertSchedule schedule);

// Per-row buffers [rows, ...] that the caller owns (rows = offsets.back()).
// a and dA hold one chunk: [activation_rows(offsets), F] (all rows without a chunk budget).
struct ExpertActivations {
  Tensor h{};   // [rows, 2F]: written by forward, read by backward (or recomputed there)
  Tensor a{};   // [chunk rows, F]: scratch
  Tensor dA{};  // [chunk rows, F]: scratch of backward; may be a itself
  Tensor
      dh{};  // [rows, 2F]: scratch of backward; may be h itself (h is dead after SwiGLU's backward)
  // Optional, fp32 [rows] (Tensor{} for none): each row's weight, applied to a before the down
  // product, so y = (scale ⊙ a)·w2ᵀ comes out weighed (the routing probabilities, MoEBlock); the
  // backward then writes each weight's gradient Σ_f dA·a to dscale, which may be scale itself.
  Tensor scale{};
  Tensor dscale{};
};

class ExpertFFN {
 public:
  // activation_chunk_bytes: the most bytes a chunk of a may take (0: all rows in one chunk).
  // workspace_bytes: each stream's cuBLASLt workspace.
  // autotune: time the algorithms of each batched size class at its first use (else the
  // heuristic's first).
  ExpertFFN(int hidden, int ffn, int local_experts, DType dtype,
            ExpertSchedule schedule = ExpertSchedule::kBatched, int streams = 4,
            std::size_t activation_chunk_bytes = 0,
            std::size_t workspace_bytes = kDefaultGemmWorkspaceBytes, bool autotune = true);
  ~ExpertFFN();
  ExpertFFN(const ExpertFFN&) = delete;
  ExpertFFN& operator=(const ExpertFFN&) = delete;

  // offsets: host [E_loc + 1], expert e owns rows [offsets[e], offsets[e + 1]) of X (padding
  // incl.). y may be X itself: every product reading X completes before the first writes y.
  void forward(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
               const Tensor& w2, const ExpertActivations& act, const Tensor& y, cudaStream_t stream,
               ExpertSpan span = {});

  // Writes X again, queued on the stream it is given, when X was not kept (memory against one
  // more pass over the rows). With it, dY, X and dX may share one buffer: every dA and dw2
  // product (the readers of dY) completes, then refill_input runs, then each expert's dw13 reads
  // its rows of X before that expert's dX product, queued behind it on the same stream, writes
  // them.
  using RefillInput = std::function<void(cudaStream_t)>;

  // Without refill_input, dX may be dY itself (X kept): each expert's dX product is queued behind
  // its dw2, the last reader of its rows of dY, on one stream.
  //
  // recompute_h: act.h was not kept, so the first GEMM runs again (memory against time); it
  // needs X on entry, so it cannot be combined with refill_input.
  //
  // dX_queued, where given, is called once the span's dX is queued on `stream` and before the
  // products that feed only dw13 (without refill_input), so that a caller can queue dX's transfer
  // there and have it run beside them. With refill_input dX comes last, and so does the call.
  using DXQueued = std::function<void()>;
  void backward(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                const Tensor& w13, const Tensor& w2, const ExpertActivations& act, bool recompute_h,
                const Tensor& dX, const Tensor& dw13, const Tensor& dw2, cudaStream_t stream,
                const RefillInput& refill_input = {}, ExpertSpan span = {},
                const DXQueued& dX_queued = {});

  // The weight gradients alone, as backward batches them: dw2 = dYᵀ·a and dw13 = dhᵀ·X, a [rows,
  // F] and dh [rows, 2F] over every row (no chunks), zero for an expert without rows. `between`,
  // where given, is called once dw2's products, dY's last readers, are done and before dw13's
  // (X may be written over dY there). span: the experts whose gradients run, batched as the whole
  // call batches them, so that spans in turn give one call's bits. For callers that form a and dh
  // themselves (the FP8 experts).
  void weight_gradients(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                        const Tensor& a, const Tensor& dh, const Tensor& dw13, const Tensor& dw2,
                        cudaStream_t stream, const RefillInput& between = {}, ExpertSpan span = {});

  ExpertSchedule schedule() const { return schedule_; }

  // Rows that act.a and act.dA must have for these offsets: the largest chunk's.
  std::int64_t activation_rows(std::span<const std::int64_t> offsets) const;

  // How the host waits for queued work before it times GEMM algorithms (once per size class).
  // Default: cudaEventSynchronize. MoEBlock passes its mesh's wait, which gives up after the
  // mesh timeout instead of blocking forever behind a collective whose peer is gone.
  void set_host_wait(std::function<void(cudaEvent_t)> wait);

  // What autotuning learned, shared by the streams' runners; null without autotuning. A mesh
  // agrees on it (GemmTuning::adopt_agreed) so that every rank runs the same algorithms.
  GemmTuning* tuning() const { return tuning_.get(); }

 private:
  struct Product {
    GemmShape shape;
    const void* a;
    const void* b;
    void* c;
    float beta = 0.0f;  // 1: add to C (a piece of an expert's dw2 after its first)
    int expert = -1;    // whose product it is (the span filter)
  };
  // Rows [first_row, first_row + rows) of the padded buffer, all of one expert.
  struct Piece {
    int expert;
    std::int64_t first_row;
    std::int64_t rows;
    bool first_of_expert;
  };
  // Consecutive rows whose a is made and consumed together: whole experts, or one piece of a
  // large one.
  struct Chunk {
    std::int64_t first_row = 0;
    std::int64_t rows = 0;
    std::vector<Piece> pieces;
  };
  std::vector<Chunk> plan_chunks(std::span<const std::int64_t> offsets) const;
  // The rows {first, count} of a chunk that the span's experts own ({0, 0}: none).
  static std::pair<std::int64_t, std::int64_t> span_rows(const Chunk& chunk, ExpertSpan span);
  // E_loc + 1 offsets, starting at or above 0, never decreasing.
  void check_offsets(std::span<const std::int64_t> offsets) const;
  void check_shapes(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
                    const Tensor& w2, const ExpertActivations& act) const;
  void up_products(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
                   const Tensor& h, std::vector<Product>& out) const;
  // followers[i] (may be empty, m·n = 0) runs after products[i], on the same stream (grouped: after
  // the whole call): it may read what products[i] wrote or overwrite what it read.
  // Only the products of the span's experts run, each launched as in a call over all of them.
  void run(const std::vector<Product>& products, cudaStream_t stream,
           const std::vector<Product>* followers = nullptr, ExpertSpan span = {});
  void run_on_streams(const std::vector<Product>& products, bool batch_equal_shapes,
                      cudaStream_t stream, const std::vector<Product>* followers, ExpertSpan span);
  void run_grouped(const std::vector<Product>& products, cudaStream_t stream);
  void run_grouped_call(const std::vector<std::vector<const Product*>>& groups, DType type,
                        cudaStream_t stream);

  int hidden_, ffn_, experts_;
  DType dtype_;
  std::int64_t chunk_rows_;  // the most rows of a chunk
  ExpertSchedule schedule_;
  std::vector<Stream> streams_;
  std::shared_ptr<GemmTuning> tuning_;
  std::vector<GemmRunner> runners_;  // one per stream: cuBLASLt workspaces must not be shared
  std::vector<Event> joins_;
  Event fork_;
  std::function<void(cudaEvent_t)> host_wait_ = [](cudaEvent_t event) {
    MOE_CHECK_CUDA(cudaEventSynchronize(event));
  };
  struct PointerStaging;
  std::unique_ptr<PointerStaging> pointers_;
  struct Grouped;
  std::unique_ptr<Grouped> grouped_;
};

}  // namespace moe
