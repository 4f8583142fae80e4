// The layer's configuration (docs/design.md, "Configuration"), loaded from YAML and validated.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "moe/tensor.h"
#include "moe/types.h"

namespace moe {

std::string_view score_function_name(ScoreFunction score_function);
ScoreFunction parse_score_function(std::string_view text);

// How rows cross the EP group. kPeer: kernels load and store rows in the other GPUs' buffers
// (CUDA IPC over NVLink), no staging; kNccl: grouped ncclSend/ncclRecv through staging buffers;
// kCopy: the copy engines copy each (rank, expert) block of rows into the other GPUs' buffers
// (peer access needed, as for kPeer), no staging and no SM moving rows; kAuto: kPeer when every
// EP rank is on this host with peer access (decided once, the same on every rank), else kNccl.
enum class EpTransport { kAuto, kNccl, kPeer, kCopy };
std::string_view ep_transport_name(EpTransport transport);
EpTransport parse_ep_transport(std::string_view text);

// Which routed slots capacity mode keeps when an expert is offered more than its capacity from one
// source rank. kProbs: the largest probabilities (ties to the lower token, then the lower slot);
// kPosition: the first in token order.
enum class DropPolicy { kProbs, kPosition };
std::string_view drop_policy_name(DropPolicy policy);
DropPolicy parse_drop_policy(std::string_view text);

// The largest hidden and ffn_hidden: far above today's models (H = 16384, F = 53248 fit 16 times
// over), and small enough that sizes built from them (2·F in int; E·2F·H elements in int64) cannot
// overflow in the kernels, the reference or the file checks.
inline constexpr int kMaxHidden = 1 << 20;
// The largest align_size. Padding exists so that each expert's row group starts on a GEMM tile
// (16 to 256 rows in practice); each group gains up to align_size - 1 rows, so a typo such as
// 1000000 would multiply every row buffer (and the CPU reference's matrices) by orders of
// magnitude and fail late, in an allocation. 4096 is far above any tile and keeps the padding of
// kMaxExperts groups under 8.4M rows, well inside the kernels' int32 row index.
inline constexpr int kMaxAlignSize = 4096;
// The largest capacity of capacity mode, in rows: an expert's rows are indexed by int32 on the
// GPU, and with pad_to_capacity every (source rank, expert) block is allocated at this size.
inline constexpr std::int64_t kMaxCapacityRows = (std::int64_t{1} << 31) - 1;
// The largest capacity_factor. From num_experts / topk on (at most kMaxExperts) every expert may
// take every token: the capacity is capped at T and a larger factor changes nothing, so one past
// this bound is a typo (1e9 for 1.0) that would otherwise pad every expert to T rows.
inline constexpr double kMaxCapacityFactor = 1e4;
// The bounds of scaling_factor and of the loss coefficients. The GPU computes with them in fp32,
// and models use scales near 1 (DeepSeek-V3 2.5) and coefficients of about 1e-4 to a few 1e-2: past
// these bounds a value is a typo, which would only surface as non-finite results or a zero scale.
inline constexpr double kMinScalingFactor = 1e-6;
inline constexpr double kMaxScalingFactor = 1e6;
inline constexpr double kMaxLossCoeff = 1e6;

struct MoEConfig {
  // Shapes.
  int hidden = 0;       // H
  int ffn_hidden = 0;   // F: SwiGLU gate and up are each H -> F, down is F -> H
  int num_experts = 0;  // E, global
  int topk = 0;         // K

  // Router (docs/design.md, forward step 2).
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool pre_softmax = false;  // softmax only: select on softmax(logits) instead of the logits
  int num_groups = 0;        // G; 0 with group_topk 0 = group-limited routing off
  int group_topk = 0;        // GK
  // Node-limited routing: each token's experts lie on at most max_nodes_per_token nodes, the EP
  // ranks taken ep_ranks_per_node to a node in rank order. A rank's experts are contiguous, and so
  // are a node's: this is group-limited routing with one group per node (routing_groups()), and no
  // limit at all while the EP group spans at most max_nodes_per_token nodes (one GPU included).
  // Both zero = off; it leaves num_groups and group_topk at zero.
  int max_nodes_per_token = 0;
  int ep_ranks_per_node = 0;
  double scaling_factor = 1.0;
  bool expert_bias = false;  // sigmoid / sqrtsoftplus only: bias that changes selection alone

  // Losses (docs/design.md, forward step 3); 0 = off.
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;

  // Layout (docs/design.md, forward step 4): each expert's row group padded to a multiple; 0 or 1 =
  // none; at most kMaxAlignSize.
  int align_size = 0;

  // Capacity mode (docs/design.md, "Capacity mode"): each expert takes at most
  // expert_capacity(T) rows from each source rank of T tokens, the rest of its slots are dropped.
  // 0 = dropless (the default). pad_to_capacity makes every (source rank, expert) block exactly
  // that many rows.
  double capacity_factor = 0.0;
  DropPolicy drop_policy = DropPolicy::kProbs;
  bool pad_to_capacity = false;

  // Shared experts (docs/design.md, "Shared experts"): a SwiGLU FFN of this width that every token
  // passes through beside the routed experts; 0 = none. shared_gate scales its output by
  // sigmoid(x · shared_gate_weightᵀ).
  int shared_ffn_hidden = 0;
  bool shared_gate = false;
  // The shared experts on a stream of their own, overlapped with the routed path; false runs them
  // in series on the block's stream (the same results bit for bit): what the overlap saves is
  // measured against it.
  bool shared_expert_overlap = true;

  // FP8 expert products (docs/design.md, "FP8"): the routed experts' four data products (forward
  // h and y, backward dA and dX) in E4M3 with 1 × 128 activation and 128 × 128 weight scales on
  // Hopper, their weight gradients in bf16 products; everything else as without. Needs bf16,
  // align_size a multiple of 16, and hidden and ffn_hidden multiples of 16.
  bool fp8 = false;
  // With fp8: the rows the exchange carries toward the experts (x in the forward, dY in the
  // backward) travel as E4M3 with their 1 × 128 scales, half the bytes of bf16, and the experts
  // see them as dequantized (docs/design.md, "FP8 dispatch"). On one EP rank nothing travels, but
  // the rows are rounded the same way, so that the experts see alike rows on a mesh and on one GPU.
  // Runs over the NCCL exchange.
  bool fp8_dispatch = false;

  DType dtype = DType::kBF16;  // activations and weights: bf16 or fp32
  // The expert weight gradients: fp32 (a trainer's fp32 main gradients) or bf16 (half the memory,
  // as autograd keeps them for bf16 weights); the GEMMs accumulate in fp32 either way, and the DP
  // sum of reduce_gradients() runs in fp32 (chunks widened, summed, narrowed back). The gate's
  // gradient is always fp32.
  DType grad_dtype = DType::kFP32;

  // Without EP the backward permutes x again into the experts' input X instead of keeping it
  // from the forward, so that X, Y, dY and dX share one [rows, H] buffer: two such buffers less
  // (0.5 GiB at qwen3-30b-a3b, 1.8 GiB at deepseek-v3, T = 8192) for one more permute. true keeps
  // X (and the separate buffers). Under the peer exchange likewise: x is stored into the
  // experts' ranks again (one more exchange), and X, Y, dY and dX share the exchange's buffer;
  // over NCCL X is always kept.
  bool keep_expert_input = false;

  // The SwiGLU output a (and dA in the backward) lives only between two products, so it is made
  // and consumed in chunks of rows of at most this many MiB instead of over every row at once
  // (0: every row at once). 64 MiB: mixtral-8x7b at T = 8192 holds 0.06 GiB instead of 0.44.
  double activation_chunk_mib = 64;

  // cuBLASLt workspace of each GEMM stream (four for the experts, one for the gate), MiB. 4 MiB
  // ran the layer as fast as 32 MiB at the three model shapes (docs/performance.md).
  int gemm_workspace_mib = 4;
  // On: the first product of each expert GEMM size class times cuBLASLt's proposals and keeps the
  // fastest. Off: the heuristic's first proposal, chosen alike on every rank and in every run,
  // with no trial launches (the sanitizer runs take it: instrumented trials take hours).
  bool gemm_autotune = true;

  // Mesh: expert-parallel and data-parallel degrees; world = ep * dp.
  int ep = 1;
  int dp = 1;
  // How rows cross the EP group (docs/design.md, "Transports"): peer and copy require peer access
  // between every pair of the group's GPUs (else an error); auto takes peer where it has it.
  EpTransport ep_transport = EpTransport::kAuto;
  // The NCCL exchange's pipeline: the local experts in this many chunks of consecutive experts,
  // each exchanged on its own stream, so that the experts start on a chunk as soon as its rows
  // arrive and its results go back under the next chunk's products, forward and backward; the
  // results are bitwise those of one chunk. 0: automatic (effective_exchange_chunks), 1: the
  // exchange in one piece (still on its own stream, beside a split-phase caller's work). At most
  // the local experts; the peer exchange takes one chunk. The copy exchange pipelines as the NCCL
  // one does, and the FP8 experts as the bf16 ones.
  int exchange_chunks = 0;
  int effective_exchange_chunks() const;

  // Tokens per GPU used by the benchmarks for this shape (not a property of the layer).
  int bench_tokens = 0;

  // The groups the router limits each token to: num_groups keeping group_topk, or under
  // node-limited routing one group per node of the mesh's ep keeping max_nodes_per_token; {0, 0}
  // when there is no limit.
  struct RoutingGroups {
    int count = 0;
    int topk = 0;
  };
  RoutingGroups routing_groups() const;
  bool grouped_routing() const { return routing_groups().count > 0; }
  bool node_limited_routing() const { return max_nodes_per_token > 0 || ep_ranks_per_node > 0; }
  // This config for one rank running the mesh's whole batch, routed as the mesh routes it: ep and
  // dp 1, and node-limited routing (which depends on ep) written as the groups it resolves to.
  MoEConfig for_one_rank() const;
  bool capacity_mode() const { return capacity_factor > 0; }
  bool shared_experts() const { return shared_ffn_hidden > 0; }
  int local_experts() const { return num_experts / ep; }  // E_loc
  // Rows an expert group of `count` rows occupies after padding to align_size, in 64 bits; a
  // negative count, an align_size outside [0, kMaxAlignSize] or an overflow throws moe::Error.
  std::int64_t padded_rows(std::int64_t count) const;
  // Capacity mode's row limit per (source rank, expert) for a source rank of `tokens` tokens:
  // ceil(capacity_factor · tokens · topk / num_experts), evaluated in double in that order, at
  // most `tokens` (an expert is offered one slot per token at most), then padded to align_size.
  // Throws moe::Error outside capacity mode, for a negative count, or when the limit passes
  // kMaxCapacityRows.
  std::int64_t expert_capacity(std::int64_t tokens) const;
  // Why the GPU layer (MoEBlock) cannot run this config yet, naming the setting and its value, or
  // empty when it can: fp8_dispatch or pad_to_capacity under EP over the peer or copy exchange
  // (they run over NCCL).
  std::string unsupported_by_gpu_layer() const;

  // Throws moe::Error naming the first invalid parameter and its value.
  void validate() const;
  // One line: "H=4096 F=14336 E=8 K=2 softmax(post) ... bf16 EP=1 DP=1".
  std::string describe() const;
};

// Loads a YAML file of flat `key: value` pairs (the fields above; `tokens` for bench_tokens).
// Unknown and repeated keys are errors, so a typo or a stale duplicate line is never silently
// ignored. The result is validated. load_config reads regular files of at most kMaxConfigBytes
// only (a FIFO or a device is refused instead of read forever); 1 MiB is thousands of times a
// real config's size.
inline constexpr std::uint64_t kMaxConfigBytes = 1 << 20;
MoEConfig load_config(const std::filesystem::path& path);
MoEConfig parse_config(std::string_view yaml_text, std::string_view source = "<string>");

}  // namespace moe
