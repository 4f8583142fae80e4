// Dispatch and combine on one rank: the padded expert-major layout built from topk_idx, permute,
// unpermute-combine and their backward; and the EP receiver's chunk sort between (source rank,
// local expert) order and the padded expert-major layout.
//
// Rows are moved with 16-byte vector accesses when a row's bytes allow it (H·elem % 16 == 0),
// element by element otherwise. Row indices are int32 (up to 2^31 rows).
//
// The implementation: permute_layout.cu (the layout), permute_rows.cu (the row kernels, local and
// over the peer exchange), permute_chunks.cu (the chunk sort), permute_fp8.cu (the permute that
// quantizes), with the device code they share in permute_device.cuh and the host side of their
// launches in permute_launch.h / permute_launch.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>

#include "fp8_quantize.cuh"
#include "moe/tensor.h"
#include "moe/types.h"

namespace moe {

// The layout of T·K routed rows over `experts` expert groups, each padded to `align`. A token's
// K experts are distinct, so it has one row per group it names (were two of its slots to name one
// group they would share a row, which the group's count still covers). A slot that names a group
// at or past `experts` (capacity mode's dropped slots) has no row: row_map -1, counted nowhere.
// Every row kernel below, local or over the peer exchange, skips such slots: the permute stores
// nothing for them, the combines add nothing and give them dprob 0, the combine backward stores no
// dY row.
struct LayoutArgs {
  const std::int32_t* topk_idx = nullptr;  // [T, K]
  std::int64_t tokens = 0;
  int topk = 0;
  int experts = 0;
  int align = 0;                    // 0 or 1: no padding
  std::int32_t* counts = nullptr;   // [E] out: rows routed to each expert
  std::int32_t* offsets = nullptr;  // [E + 1] out: start of each padded group; [E] = total rows
  std::int32_t* row_map = nullptr;  // [T, K] out: (t, k) -> row; inside a group, token order
  void* workspace = nullptr;        // layout_workspace_bytes()
  // > 0: groups [0, fixed_groups) each take exactly fixed_rows rows (capacity mode's
  // pad_to_capacity; their counts must not exceed it), the groups after them `align` as before.
  int fixed_rows = 0;
  int fixed_groups = 0;
};

std::size_t layout_workspace_bytes(std::int64_t tokens, int topk, int experts);
void build_layout(const LayoutArgs& args, cudaStream_t stream);

// out[row(t, k)] = x[t]; padding rows (offsets/counts of `experts` groups) are written as zeros.
// With prob [T, K] and row_prob [rows of out] (both or neither): row_prob[row(t, k)] = prob[t, k]
// too, padding rows 0 — each slot's probability beside its row, for experts that weigh their
// own output (docs/design.md, "Probabilities inside the experts").
void permute_rows(const Tensor& x, const std::int32_t* row_map, int topk,
                  const std::int32_t* offsets, const std::int32_t* counts, int experts,
                  const Tensor& out, cudaStream_t stream, const float* prob = nullptr,
                  float* row_prob = nullptr);

// permute_rows, and each row's E4M3 codes and 1 × 128 scales into `quantized` as
// quantize_row_blocks_segmented(out, the layout's offsets, H) would leave them, bit for bit, in
// the same pass: a token's row is quantized once for its K rows. Padding rows: codes 0, scales 1.
// topk_idx [T, K] names each slot's group (the layout's input). Where permute_rows_fp8_applies:
// bf16 rows of a multiple of 128 values, x and out 16-byte aligned (codes too, scales 4).
bool permute_rows_fp8_applies(const Tensor& x, const Tensor& out);
void permute_rows_fp8(const Tensor& x, const std::int32_t* row_map, const std::int32_t* topk_idx,
                      int topk, const std::int32_t* offsets, const std::int32_t* counts,
                      int experts, const Tensor& out, const QuantizedRows& quantized,
                      cudaStream_t stream, const float* prob = nullptr, float* row_prob = nullptr);

// out[t] = Σ_k prob[t, k]·y[row(t, k)] (prob null: plain sum, the permute backward), accumulated in
// fp32 in slot order, written in out's dtype. With row_grad [rows of y] and dprob [T, K] (both or
// neither): dprob[t, k] = row_grad[row(t, k)] too, the probabilities' gradients that the experts'
// backward left beside their rows.
void unpermute_combine(const Tensor& y, const std::int32_t* row_map, const float* prob, int topk,
                       const Tensor& out, cudaStream_t stream, const float* row_grad = nullptr,
                       float* dprob = nullptr);

// Combine backward: dY[row(t, k)] = prob[t, k]·dy[t] (padding rows zero) and
// dprob[t, k] = <dy[t], y[row(t, k)]>, with y the tensor the combine consumed. dY may be y itself.
void combine_backward(const Tensor& dy, const Tensor& y, const std::int32_t* row_map,
                      const float* prob, int topk, const std::int32_t* offsets,
                      const std::int32_t* counts, int experts, const Tensor& dY, float* dprob,
                      cudaStream_t stream);

// combine_backward whose dY rows are written as fp8_dispatch's records (kernels/fp8_quantize.cuh:
// fp8_row_bytes(H) bytes a row, H a multiple of 16, bf16 dy and y, every pointer 16-byte aligned)
// instead of bf16: each record that of the bf16 row combine_backward would store, in one pass.
// Padding rows' records are zero bytes (their codes decode to zeros, as a quantized zero row's).
void combine_backward_records(const Tensor& dy, const Tensor& y, const std::int32_t* row_map,
                              const float* prob, int topk, const std::int32_t* offsets,
                              const std::int32_t* counts, int experts, void* records, float* dprob,
                              cudaStream_t stream);

// The EP receiver: rows ordered by (source, local expert) with counts[s · E_loc + e], unpadded,
// moved to or from the expert-major layout padded to `align` (padding rows zero when writing it).
struct ChunkArgs {
  // [sources · local_experts], device; or null, every chunk then uniform_count rows (fixed blocks,
  // whose sizes the host knows without reading them back)
  const std::int32_t* counts = nullptr;
  int sources = 0;
  int local_experts = 0;
  int align = 0;
  void* workspace = nullptr;  // chunk_workspace_bytes()
  int uniform_count = 0;
  // Only the chunks of local experts [first_expert, end_expert) move (end 0: every expert), the
  // pipelined exchange's chunk of experts; widest_source is then the most rows one source holds
  // for them (the host knows it from the counts), and only those experts' padding is zeroed.
  int first_expert = 0;
  int end_expert = 0;
  std::int64_t widest_source = 0;
};
std::size_t chunk_workspace_bytes(int sources, int local_experts);
void sort_chunks(const ChunkArgs& chunks, const Tensor& source_major, const Tensor& expert_major,
                 cudaStream_t stream);
// The sort of rows that travelled as records of E4M3 codes and scales (fp8_dispatch;
// kernels/fp8_quantize.cuh): `rows` source-major records of fp8_row_bytes(H) bytes, each decoded
// into its bf16 row of expert_major [.., H] (H a multiple of 16), padding zeroed as sort_chunks.
// With `codes` (H a multiple of 128), the records' codes and scales are also stored unchanged
// where the FP8 experts read them, as permute_rows_fp8 leaves them (each local expert's scales
// over its padded rows; a padding row's codes 0, its scales 1), so that no pass quantizes the
// rows again.
void sort_chunk_records(const ChunkArgs& chunks, const void* records, std::int64_t rows,
                        const Tensor& expert_major, cudaStream_t stream,
                        const QuantizedRows& codes = {});
void unsort_chunks(const ChunkArgs& chunks, const Tensor& expert_major, const Tensor& source_major,
                   cudaStream_t stream);
// Only the padding rows of the expert-major layout (of the chunk's experts) become zero: where the
// rows were put in place by other means (the copy exchange's copies).
void zero_chunk_padding(const ChunkArgs& chunks, const Tensor& expert_major, cudaStream_t stream);

// ---- Rows on the EP group's ranks: the peer exchange (docs/design.md, "Transports")
// Slot (t, k) of this rank's tokens lives at row rows[t, k] of rank topk_idx[t, k] /
// experts_per_rank's buffer, which base[] maps here (CUDA IPC over NVLink). Kernels that store
// into peers' buffers fence each thread's stores at system scope before it exits, so a
// collective queued behind them on the stream marks the rows as landed on every rank.
struct PeerRows {
  std::array<void*, kMaxPeerRanks> base{};
  // Each rank's float per row (fp32 [rows]) beside the rows, for the kernels that move one.
  std::array<void*, kMaxPeerRanks> scalars{};
  int ranks = 0;
  int experts_per_rank = 0;
  const std::int32_t* topk_idx = nullptr;  // [T, K]
  const std::int32_t* rows = nullptr;      // [T, K]
};

// rows[i] = row_map[i] + shift[topk_idx[i]] for i < slots: a slot's row on its expert's rank from
// its row in the sender's layout (shift[g]: where this sender's rows of global expert g start on
// g's rank, minus where they start in the sender's layout); -1 where row_map is -1 (capacity
// mode's dropped slots, which have no row on any rank, so the peer kernels skip them as the local
// ones do).
void peer_row_map(const std::int32_t* row_map, const std::int32_t* topk_idx,
                  const std::int32_t* shift, std::int64_t slots, std::int32_t* rows,
                  cudaStream_t stream);

// Dispatch: x[t] stored at every slot's row on its rank; this rank's own padding rows (groups
// own_offsets / own_counts of `own`, its buffer) zeroed in the same launch. With prob [T, K] and
// own_prob (both or neither): prob[t, k] stored beside the slot's row too (out.scalars), and
// own_prob's padding rows zeroed.
void peer_permute(const Tensor& x, const PeerRows& out, int topk, const std::int32_t* own_offsets,
                  const std::int32_t* own_counts, int own_experts, const Tensor& own,
                  cudaStream_t stream, const float* prob = nullptr, float* own_prob = nullptr);

// Combine: out[t] = Σ_k prob[t, k]·y(t, k) loaded from the slots' ranks (prob null: plain sum, the
// dispatch backward), fp32 in slot order as unpermute_combine. With dprob: dprob[t, k] = the float
// beside the slot's row (y.scalars), as unpermute_combine's row_grad.
void peer_unpermute_combine(const PeerRows& y, const float* prob, int topk, const Tensor& out,
                            cudaStream_t stream, float* dprob = nullptr);

}  // namespace moe
