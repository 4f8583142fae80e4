// The experts in FP8 on Hopper (docs/design.md, "FP8"): E4M3 products with 1 × 128 activation
// scales and 128 × 128 weight scales, fp32 accumulation, bf16 results.
//   forward:  h = X·w13ᵀ, X quantized in row blocks per expert where its product reads the
//             scales; a = SwiGLU(h), weighed by the row weights as ExpertFFN does, in bf16, then
//             quantized; y = a·w2ᵀ.
//   backward: dA = dY·w2 and dX = dh·w13 in FP8 (dY and dh quantized in row blocks, the weights'
//             transposes in tiles); dh, a again and the row weights' gradient by SwiGLU's
//             backward; the weight gradients dw2 = dYᵀ·a and dw13 = dhᵀ·X in bf16 products with
//             fp32 accumulation, batched as ExpertFFN batches them where the FP8 passes are
//             grouped (their inner dimension is the tokens, which FP8 would need quantized a
//             second time, along the columns).
// Weights are quantized by quantize_weights, with their transposes, and that copy serves every
// step until the next call: a trainer calls it once after each update of the weights, and
// micro-batches in between share it. Each FP8 pass runs as one launch of the grouped products
// (kernels/grouped_fp8_gemm.cuh), every expert's tiles side by side, or as cuBLASLt's products,
// one expert a call, spread over streams largest first (cuBLASLt refuses its block-scaled products
// a strided batch: bench_fp8_gemm asks): Fp8Products says which.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "experts.h"
#include "gemm_fp8.h"
#include "moe/device.h"
#include "moe/tensor.h"
#include "swiglu.cuh"

namespace moe {

// How the four FP8 passes (h, y, dA, dX) run their experts' products.
enum class Fp8Products {
  // Grouped where the GPU runs them and the experts' products are small (grouped_rows_limit),
  // else one expert a call.
  kAuto,
  kPerExpert,  // cuBLASLt, one expert a call, over the streams
  kGrouped,    // one grouped launch a pass (compute capability 9.0, at most 256 experts)
};
// An expert's forward of this many multiply-adds (its rows · 3·H·F) is where the grouped
// products, with the weight gradients batched, stop running the layer's step faster than
// cuBLASLt's one expert a call: kAuto takes them where the experts with rows average fewer rows
// than it takes to reach it (grouped_rows_limit). Measured in the layer, the passes in chunks
// beside the exchange (docs/performance.md, "FP8"): the grouped step wins at qwen3-30b-a3b's shape
// at 1031 rows (4.9·10⁹) and loses at 2055 (9.7·10⁹; alone on one GPU, out of chunks, it still
// wins there), and loses at deepseek-v3's 263 (1.2·10¹⁰) and at mixtral-8x7b's shape.
inline constexpr double kGroupedMacsLimit = 7e9;

class Fp8ExpertFFN {
 public:
  // hidden and ffn: multiples of 16 (FP8 rows are read 16 bytes at a time).
  Fp8ExpertFFN(int hidden, int ffn, int local_experts, int streams = 4,
               std::size_t workspace_bytes = kDefaultGemmWorkspaceBytes,
               Fp8Products products = Fp8Products::kAuto);

  // w13 [E_loc, 2F, H], w2 [E_loc, H, F], bf16: quantized in tiles into this object's copy.
  void quantize_weights(const Tensor& w13, const Tensor& w2, cudaStream_t stream);
  bool has_weights() const { return has_weights_; }
  // Whether a pass over these rows (host offsets, [E_loc + 1]) runs as the grouped products (and
  // the weight gradients' bf16 products batched): under kAuto, where the GPU runs them and the
  // experts with rows average fewer than grouped_rows_limit() rows.
  bool grouped_pass(std::span<const std::int64_t> offsets) const;
  // The least average of rows an expert at which an expert's forward reaches kGroupedMacsLimit
  // multiply-adds at this hidden and ffn size.
  std::int64_t grouped_rows_limit() const;

  // X [rows, H] bf16, offsets host [E_loc + 1] (each expert's rows a multiple of 16), act.h
  // [rows, 2F] and act.a [rows, F] bf16 (a over every row: no chunks), act.scale optional fp32
  // [rows]; y [rows, H] bf16. The grouped products store whole rows, 16 bytes at a time: their
  // outputs (h and y here, dA and dX in backward) must be 16-byte aligned, or they throw.
  // span: the experts of one chunk of a pipelined exchange (every expert by default). Only their
  // rows are read and written, by the products the whole call would run for them (grouped or one
  // a call as the whole call's rows decide), so that spans in turn give one call's bits.
  // X_codes, where given: X quantized already (QuantizedRows, over every expert's rows at these
  // offsets, whatever the span), read instead of quantizing X here.
  void forward(const Tensor& X, std::span<const std::int64_t> offsets, const ExpertActivations& act,
               const Tensor& y, cudaStream_t stream, ExpertSpan span = {},
               const QuantizedRows& X_codes = {});

  // From dY [rows, H] and what forward left in act (h), with X as forward read it: act.dA
  // [rows, F] and act.dh [rows, 2F] as scratch (dh may be h, dA may be a: act.a is written again,
  // weighed), act.dscale [rows] with act.scale; dX [rows, H] bf16, written after dw2's products
  // (the last readers of dY), so it may be dY, and last where it is X; dw13 [E_loc, 2F, H] and
  // dw2 [E_loc, H, F], bf16 or fp32 (zero for an expert without rows). With refill_input, X is
  // not valid on entry: it is written (over dY, say) once dY's last reader is done, as ExpertFFN
  // does it. span as in forward (every expert with refill_input). dX_queued, where given, is
  // called once the span's dX is queued on `stream`: where dX is not X and nothing is refilled,
  // before dw13's products, which then run beside whatever the caller queues there (ExpertFFN's
  // backward does the same); otherwise last. dY_codes as forward's X_codes.
  void backward(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                const ExpertActivations& act, const Tensor& dX, const Tensor& dw13,
                const Tensor& dw2, cudaStream_t stream,
                const ExpertFFN::RefillInput& refill_input = {}, ExpertSpan span = {},
                const ExpertFFN::DXQueued& dX_queued = {}, const QuantizedRows& dY_codes = {});

 private:
  struct Weights {
    ScaleBuffer tiles;  // one expert's
    DeviceBuffer codes, scales;
  };
  // One FP8 product C = A·Bᵀ, bf16 out.
  struct Product {
    std::int64_t m, n, k;
    const std::uint8_t* a;
    const float* a_scales;
    const std::uint8_t* b;
    const float* b_scales;
    void* c;
  };
  void check_offsets(std::span<const std::int64_t> offsets, const char* call) const;
  // The experts of a span and their rows, with the offsets of those rows from the first, and
  // whether the whole call's passes run grouped.
  struct Part {
    int first = 0, end = 0;
    std::int64_t first_row = 0, rows = 0;
    std::vector<std::int64_t> offsets;  // [end - first + 1], from 0
    bool grouped = false;
  };
  Part part(std::span<const std::int64_t> offsets, ExpertSpan span, const char* call) const;
  // Grows the activations' codes and scales (codes_, scales_) for a call over `rows`; the first
  // pair (X's and dY's) only where the caller does not quantize those rows itself.
  void reserve_scratch(std::int64_t rows, bool rows_given);
  // The part's rows as the caller quantized them (every expert's), or else scratch(0, ...).
  Fp8RowBlocks input_rows(const QuantizedRows& given, const Part& part, const char* call);
  // The part's rows of codes_[buffer] and scales_[buffer], `width` columns, where a whole call
  // over every expert would put them.
  Fp8RowBlocks scratch(int buffer, const Part& part, std::int64_t width);
  // out = a·weightsᵀ per expert of the part, by products_: a and out hold the part's rows from
  // their first.
  void fp8_pass(const Part& part, const Fp8RowBlocks& a, std::int64_t k, const Weights& weights,
                std::int64_t n, void* out, cudaStream_t stream);
  void run(std::vector<Product> products, cudaStream_t stream);

  int hidden_, ffn_, experts_;
  Fp8Products products_;
  bool grouped_available_ = false;  // the GPU runs the grouped products, for this many experts
  bool has_weights_ = false;
  Weights w13_, w2_;                        // [E, 2F, H] and [E, H, F]
  Weights w13_transposed_, w2_transposed_;  // [E, H, 2F] and [E, F, H]
  DeviceBuffer codes_[2], scales_[2];       // the activations of the pass at hand, and the next
  // The bf16 weight gradients' products: batched as the bf16 experts batch them where the FP8
  // passes are grouped, else one expert a call over the streams, largest first.
  // Built only where grouped_pass can pick them.
  std::unique_ptr<ExpertFFN> batched_grads_, per_expert_grads_;
  std::vector<Stream> streams_;
  std::vector<std::unique_ptr<BlockScaledGemm>> gemms_;  // one a stream
  Event fork_;
  std::vector<Event> joins_;
};

}  // namespace moe
