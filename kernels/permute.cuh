// SPEC.md steps 4 and 6 on one rank: the padded expert-major layout built from topk_idx, permute,
// unpermute-combine and their backward; and the EP receiver's chunk sort between (source rank,
// local expert) order and the padded expert-major layout.
//
// Rows are moved with 16-byte vector accesses when a row's bytes allow it (H·elem % 16 == 0),
// element by element otherwise. Row indices are int32 (up to 2^31 rows).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moe/tensor.h"

namespace moe {

// The layout of T·K routed rows over `experts` expert groups, each padded to `align`.
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
};

std::size_t layout_workspace_bytes(std::int64_t tokens, int topk, int experts);
void build_layout(const LayoutArgs& args, cudaStream_t stream);

// out[row(t, k)] = x[t]; padding rows (offsets/counts of `experts` groups) are written as zeros.
void permute_rows(const Tensor& x, const std::int32_t* row_map, int topk,
                  const std::int32_t* offsets, const std::int32_t* counts, int experts,
                  const Tensor& out, cudaStream_t stream);

// out[t] = Σ_k prob[t, k]·y[row(t, k)] (prob null: plain sum, the permute backward), accumulated in
// fp32 in slot order, written in out's dtype.
void unpermute_combine(const Tensor& y, const std::int32_t* row_map, const float* prob, int topk,
                       const Tensor& out, cudaStream_t stream);

// Combine backward: dY[row(t, k)] = prob[t, k]·dy[t] (padding rows zero) and
// dprob[t, k] = <dy[t], y[row(t, k)]>, with y the tensor the combine consumed. dY may be y itself.
void combine_backward(const Tensor& dy, const Tensor& y, const std::int32_t* row_map,
                      const float* prob, int topk, const std::int32_t* offsets,
                      const std::int32_t* counts, int experts, const Tensor& dY, float* dprob,
                      cudaStream_t stream);

// The EP receiver: rows ordered by (source, local expert) with counts[s · E_loc + e], unpadded,
// moved to or from the expert-major layout padded to `align` (padding rows zero when writing it).
struct ChunkArgs {
  const std::int32_t* counts = nullptr;  // [sources · local_experts], device
  int sources = 0;
  int local_experts = 0;
  int align = 0;
  void* workspace = nullptr;  // chunk_workspace_bytes()
};
std::size_t chunk_workspace_bytes(int sources, int local_experts);
void sort_chunks(const ChunkArgs& chunks, const Tensor& source_major, const Tensor& expert_major,
                 cudaStream_t stream);
void unsort_chunks(const ChunkArgs& chunks, const Tensor& expert_major, const Tensor& source_major,
                   cudaStream_t stream);

}  // namespace moe
