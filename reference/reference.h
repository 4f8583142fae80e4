// The fp64 CPU reference of the whole layer, forward and backward, stage by stage, as
// docs/design.md states it.
//
// Every GPU kernel has a counterpart here and every GPU test compares against it. Users may run it
// to check the layer too. Nothing here is fast; everything here is plain.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "moe/config.h"

namespace moe::reference {

// Row-major matrix of doubles.
struct Matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<double> data;

  Matrix() = default;
  Matrix(std::int64_t rows, std::int64_t cols, double fill = 0.0)
      : rows(rows), cols(cols), data(static_cast<std::size_t>(rows * cols), fill) {}

  double& operator()(std::int64_t r, std::int64_t c) { return data[index(r, c)]; }
  double operator()(std::int64_t r, std::int64_t c) const { return data[index(r, c)]; }
  std::span<double> row(std::int64_t r) {
    return {data.data() + r * cols, static_cast<std::size_t>(cols)};
  }
  std::span<const double> row(std::int64_t r) const {
    return {data.data() + r * cols, static_cast<std::size_t>(cols)};
  }

 private:
  std::size_t index(std::int64_t r, std::int64_t c) const {
    return static_cast<std::size_t>(r * cols + c);
  }
};

Matrix matmul(const Matrix& a, const Matrix& b);     // a · b
Matrix matmul_nt(const Matrix& a, const Matrix& b);  // a · bᵀ
Matrix matmul_tn(const Matrix& a, const Matrix& b);  // aᵀ · b
Matrix transpose(const Matrix& m);
void add_into(Matrix& target, const Matrix& addend);
// Rows [begin, end) of m.
Matrix slice_rows(const Matrix& m, std::int64_t begin, std::int64_t end);
// Rows of every part, in order.
Matrix concat_rows(std::span<const Matrix> parts);
// m rounded to the values `dtype` can hold (what a GPU tensor of that dtype sees).
Matrix round_to(const Matrix& m, DType dtype);

// Which intermediates the reference rounds. kExact: none, the fp64 math. kAsStored: the ones the
// GPU keeps in memory in the activation dtype and then reads through a cancelling sum: the expert
// activations h, a and y (dprob = dy·y loses up to ‖dy‖‖y‖ / |dy·y| of their relative accuracy)
// and dlogits before the gate GEMMs. In bf16 that cancellation is unbounded for a single token, so
// the gate gradient is compared with a reference that rounds where the GPU rounds.
enum class Intermediates { kExact, kAsStored };

// ---- Step 2: router
// ------------------------------------------------------------------------------

// Top-K per token, in descending score order: topk_idx and topk_p (scaled).
struct Routing {
  std::int64_t tokens = 0;
  int topk = 0;
  std::vector<int> expert;   // [T*K]
  std::vector<double> prob;  // [T*K]

  int expert_of(std::int64_t t, int k) const {
    return expert[static_cast<std::size_t>(t * topk + k)];
  }
  double prob_of(std::int64_t t, int k) const {
    return prob[static_cast<std::size_t>(t * topk + k)];
  }
};

// The score s = score_function(logits) of one token row (softmax over the row, or elementwise).
std::vector<double> router_scores(const MoEConfig& config, std::span<const double> logits);

// The scores selection ranks for one token: logits (softmax post), softmax (pre), or the
// elementwise score plus the expert bias (sigmoid, sqrtsoftplus).
std::vector<double> selection_scores(const MoEConfig& config, std::span<const double> logits,
                                     std::span<const double> expert_bias);
// The plain or group-limited top-K over selection scores; descending, ties to the lower
// index.
std::vector<int> select_experts(const MoEConfig& config, std::span<const double> scores);

// `expert_bias` has E entries when config.expert_bias, otherwise it is ignored (may be empty).
Routing route(const MoEConfig& config, const Matrix& logits, std::span<const double> expert_bias);
// The probabilities of a given selection (experts [T*K], in slot order), from the current logits
// by the score function's rule: routing replay, and how a test feeds the reference the GPU's own
// routing where bf16 or fp32 rounding flipped a near-tie. route() is route_given() of its own
// selection, so replaying a recorded topk_idx reproduces the probabilities bit for bit.
Routing route_given(const MoEConfig& config, const Matrix& logits, std::span<const int> experts);
// Throws moe::Error unless `experts` holds `tokens` · K entries, each in [0, E), none twice in a
// token; the message starts with `what` and names the token, the slot and the value.
void check_given_experts(const MoEConfig& config, std::int64_t tokens, std::span<const int> experts,
                         std::string_view what = "given routing");
// dlogits [T,E] from dp [T*K] (the gradient of the loss with respect to Routing::prob).
Matrix route_backward(const MoEConfig& config, const Matrix& logits, const Routing& routing,
                      std::span<const double> dprob);

// ---- Step 3: aux losses -------------------------------------------------------------------------

// The summable statistics of the load-balancing loss: f (tokens per expert under the aux routing),
// P (sum of aux scores per expert) and the token count. Ranks add theirs up; see aux_loss.
struct AuxStats {
  std::vector<double> tokens_per_expert;  // f [E]
  std::vector<double> score_sum;          // P [E]
  std::int64_t tokens = 0;                // T
  AuxStats& operator+=(const AuxStats& other);
};

AuxStats aux_stats(const MoEConfig& config, const Matrix& logits);
double aux_loss(const MoEConfig& config, const AuxStats& global);
// Adds ∂L_aux/∂logits of this rank's tokens, given the mesh-wide statistics.
void aux_loss_backward(const MoEConfig& config, const Matrix& logits, const AuxStats& global,
                       Matrix& dlogits);

// Σ_t logsumexp(logits[t])², summable over ranks.
double z_loss_sum(const Matrix& logits);
double z_loss(const MoEConfig& config, double global_sum, std::int64_t global_tokens);
void z_loss_backward(const MoEConfig& config, const Matrix& logits, std::int64_t global_tokens,
                     Matrix& dlogits);

// Tokens routed to each expert by the main routing (before any capacity drop).
std::vector<double> tokens_per_expert(const Routing& routing, int num_experts);
// Aux-loss-free balancing: b_i += rate · sign(mean_j load_j − load_i). The load is the routing
// before capacity drops: tokens_per_expert(routing), i.e. LayerResult's tokens_per_expert plus
// dropped_per_expert.
void update_expert_bias(std::span<double> expert_bias, std::span<const double> load, double rate);

// ---- Capacity mode (docs/design.md, "Capacity mode") ------------------------------------------

// Which slots of one source rank's routing keep their row: kept[t·K + k] is 1 or 0. Each expert
// keeps at most config.expert_capacity(T) of its slots, chosen by config.drop_policy; dropless
// keeps every slot.
std::vector<int> keep_within_capacity(const MoEConfig& config, const Routing& routing);
// The slots of each expert that were routed but dropped.
std::vector<double> dropped_per_expert(const Routing& routing, std::span<const int> kept,
                                       int num_experts);

// ---- Steps 4 and 6: layout, permute, combine ----------------------------------------------------

// Rows grouped expert after expert, each group padded to `align`; inside a group (token, slot)
// ascending. With align 1 and all E experts this is also the EP sender's order. A slot that
// capacity mode dropped has no row.
struct Layout {
  static constexpr std::int64_t kDroppedRow = -1;

  std::vector<std::int64_t> counts;   // [E] rows routed to each expert and kept
  std::vector<std::int64_t> offsets;  // [E+1] start of each padded group; back() = total rows
  std::vector<std::int64_t> row;      // [T*K] (t, k) -> row, or kDroppedRow

  std::int64_t rows() const { return offsets.back(); }
  std::int64_t group_rows(int expert) const { return offsets[expert + 1] - offsets[expert]; }
  std::int64_t row_of(std::int64_t t, int k, int topk) const {
    return row[static_cast<std::size_t>(t * topk + k)];
  }
};

std::vector<std::int64_t> padded_offsets(std::span<const std::int64_t> counts, int align);
Layout make_layout(const Routing& routing, int num_experts, int align);
// The layout of the kept slots alone (kept as keep_within_capacity gives it). block_rows > 0 makes
// every expert's group exactly that many rows (pad_to_capacity: a group holding more is an
// error); 0 pads each group to `align`.
Layout make_layout(const Routing& routing, std::span<const int> kept, int num_experts, int align,
                   std::int64_t block_rows = 0);

Matrix permute(const Matrix& x, const Layout& layout, const Routing& routing);  // padding rows zero
Matrix unpermute_combine(const Matrix& y, const Layout& layout, const Routing& routing);
// Backward of the combine: dY[row(t,k)] = p[t,k]·dy[t] (padding rows zero) and
// dp[t,k] = <dy[t], Y[row(t,k)]>, with Y the tensor the combine consumed, in its layout.
Matrix combine_backward_rows(const Matrix& dy, const Layout& layout, const Routing& routing);
std::vector<double> combine_backward_prob(const Matrix& dy, const Matrix& y, const Layout& layout,
                                          const Routing& routing);
// Backward of permute: dx[t] = Σ_k dX[row(t,k)]. Dropped slots take no part in any of these: they
// move no row, add nothing to out or dx, and their dp is 0.
Matrix permute_backward(const Matrix& dX, const Layout& layout, const Routing& routing);

// The EP receiver's rows arrive ordered by (source rank, local expert), unpadded; the expert
// computation wants them expert-major and padded. counts[s * local_experts + e].
struct ChunkLayout {
  int sources = 0;
  int local_experts = 0;
  std::vector<std::int64_t> counts;

  std::int64_t count(int source, int expert) const {
    return counts[static_cast<std::size_t>(source * local_experts + expert)];
  }
  std::vector<std::int64_t> rows_per_expert() const;
};

Matrix sort_chunks(const Matrix& source_major, const ChunkLayout& chunks, int align);
Matrix unsort_chunks(const Matrix& expert_major, const ChunkLayout& chunks, int align);

// ---- Step 5: experts
// ------------------------------------------------------------------------------

struct ExpertWeights {
  std::vector<Matrix> w13;  // per expert [H, 2F]: columns [0, F) gate, [F, 2F) up
  std::vector<Matrix> w2;   // per expert [F, H]
};

struct ExpertActivations {
  Matrix h;  // [rows, 2F]
  Matrix a;  // [rows, F] = silu(h_gate) ⊙ h_up
  Matrix y;  // [rows, H]
};

struct ExpertGrads {
  Matrix dX;
  std::vector<Matrix> dw13;
  std::vector<Matrix> dw2;
};

double silu(double v);
// Rows [offsets[e], offsets[e+1]) belong to expert e (padding rows included).
// kAsStored rounds h, a and y to `dtype` as they are produced.
ExpertActivations experts_forward(const Matrix& X, std::span<const std::int64_t> offsets,
                                  const ExpertWeights& weights,
                                  Intermediates intermediates = Intermediates::kExact,
                                  DType dtype = DType::kFP32);
ExpertGrads experts_backward(const Matrix& X, const ExpertActivations& act, const Matrix& dY,
                             std::span<const std::int64_t> offsets, const ExpertWeights& weights);

// ---- FP8 block quantization (docs/design.md, "FP8") ---------------------------------------------

// E4M3 as the GPU rounds to it: nearest, ties to even, saturated to ±448; NaN stays NaN.
std::uint8_t to_e4m3(float value);
double from_e4m3(std::uint8_t code);

// A matrix quantized in blocks of 1 × 128 (rows) or 128 × 128 (tiles), as kernels/fp8_quantize
// does it from the matrix's values (bf16 values, held as doubles): a block's scale is 2^e, e the
// least in [-126, 127] with amax <= 448 · 2^e (1 for a block of zeros), and each value is
// to_e4m3(x / scale), the division exact.
struct BlockQuantized {
  std::int64_t rows = 0, cols = 0;
  std::int64_t block_rows = 1;                         // 1 (rows) or 128 (tiles)
  std::int64_t scale_cols = 0;                         // ceil(cols / 128)
  std::vector<std::uint8_t> codes;                     // [rows, cols]
  std::vector<float> scales;                           // [ceil(rows / block_rows), scale_cols]
  double value(std::int64_t r, std::int64_t c) const;  // code · its block's scale
  Matrix dequantized() const;
};
BlockQuantized quantize_row_blocks(const Matrix& x);
BlockQuantized quantize_tiles(const Matrix& x);
// What fp8_dispatch makes of the rows on their way to the experts: quantized in row blocks, each
// value decoded and rounded to bf16 (as the GPU's chunk sort decodes the records that crossed).
Matrix round_rows_through_fp8(const Matrix& x);

// One expert's step as fp8 forms it: each data product's activation operand quantized in row
// blocks and its weight operand in tiles, both dequantized, the product in fp64, and h, a, y, dA,
// dh and dX rounded to bf16 where the GPU stores them; the weight gradients from those bf16
// values, unquantized. w13 [H, 2F] and w2 [F, H] in the reference's math layout (ExpertWeights).
// What the GPU's FP8 experts compute up to their accumulation order, to measure what FP8 costs
// against experts_forward / experts_backward at any shape.
struct Fp8ExpertStep {
  Matrix h, a, y;     // [T, 2F], [T, F], [T, H]
  Matrix dA, dh, dX;  // [T, F], [T, 2F], [T, H]
  Matrix dw13, dw2;   // [H, 2F], [F, H]
};
Fp8ExpertStep fp8_expert_step(const Matrix& X, const Matrix& w13, const Matrix& w2,
                              const Matrix& dy);

// The two halves of that step, which the layer runs apart (run_layer under config.fp8): h, a and y
// from the rows X; then dA, dh, dX and the weight gradients from dY and the forward's h (a is
// formed again from h, as the GPU's SwiGLU backward forms it). fp8_expert_step is the one after
// the other, unweighed.
//
// row_weights (one per row, or empty) are the routing probabilities of rows that the experts
// weigh themselves, as the GPU's do where they form dprob (ProbabilityGradient::kExperts): a is
// weighed before its rounding and quantization, so y comes weighed; dY is the unweighed output
// gradient, dh takes weight · dA, and the weights' gradients are <dA, silu(h_gate) ⊙ h_up>.
ExpertActivations fp8_expert_forward(const Matrix& X, const Matrix& w13, const Matrix& w2,
                                     std::span<const double> row_weights = {});
struct Fp8ExpertBackward {
  Matrix dA, dh, dX;                     // [T, F], [T, 2F], [T, H]
  Matrix dw13, dw2;                      // [H, 2F], [F, H]
  std::vector<double> row_weight_grads;  // [T] with row_weights, else empty
};
Fp8ExpertBackward fp8_expert_backward(const Matrix& X, const Matrix& h, const Matrix& w13,
                                      const Matrix& w2, const Matrix& dY,
                                      std::span<const double> row_weights = {});

// A weight gradient aᵀ · b (a [T, m], b [T, n], the tokens the products' inner dimension) as
// DeepSeek-V3's recipe forms it in FP8: both operands quantized in blocks of 128 × 1 (each
// column's 128 consecutive tokens share a scale), dequantized, the product in fp64. The layer's
// weight gradients read their bf16 operands unquantized (docs/design.md, "Weight gradients against
// the recipe"); this measures what FP8 there would cost, unrounded (fp32 gradients).
Matrix fp8_weight_gradient(const Matrix& a, const Matrix& b);

// ---- Shared experts (docs/design.md, "Shared experts") ----------------------------------------

// One SwiGLU FFN of width Fs = config.shared_ffn_hidden that every token passes through, in the
// reference's math layout like ExpertWeights.
struct SharedExpert {
  Matrix w13;          // [H, 2Fs]: columns [0, Fs) gate, [Fs, 2Fs) up
  Matrix w2;           // [Fs, H]
  Matrix gate_weight;  // [1, H] with config.shared_gate (nn.Linear layout, as gate_weight)
};

struct SharedExpertGrads {
  Matrix dw13;          // [H, 2Fs]
  Matrix dw2;           // [Fs, H]
  Matrix dgate_weight;  // [1, H] with config.shared_gate, else empty
  // [1, H] with config.shared_gate: what rounding can move each element of dgate_weight by, per
  // unit of relative rounding (2^-24 in fp32) and of sum length: the terms of its sums by
  // magnitude, Σ_t |g(1 − g)| · Σ_f (Σ_h |dy·w2|) · |a| · |x|, plus what the forward's sums (h
  // and the gate's logit) carry into it. A few tokens' gradient may cancel to far below its terms.
  Matrix dgate_weight_magnitude;
};

// What the shared expert's forward keeps for its backward.
struct SharedForward {
  ExpertActivations act;     // h, a and the ungated output y, one row per token
  std::vector<double> gate;  // [T] sigmoid(x · gate_weightᵀ); 1 without shared_gate
  Matrix out;                // [T, H] gate ⊙ y: what the layer adds to its output
  // How the forward rounded: under kAsStored the backward forms the gate's gradient as the GPU
  // does, <dy·w2ᵀ rounded, a>, instead of <dy, y> (the same number in exact arithmetic).
  Intermediates intermediates = Intermediates::kExact;
};

SharedForward shared_forward(const MoEConfig& config, const SharedExpert& shared, const Matrix& x,
                             Intermediates intermediates = Intermediates::kExact);
// Adds the shared expert's part of dx into `dx` and returns its weight gradients.
SharedExpertGrads shared_backward(const MoEConfig& config, const SharedExpert& shared,
                                  const Matrix& x, const SharedForward& forward, const Matrix& dy,
                                  Matrix& dx);

// ---- The whole layer --------------------------------------------------------------------------

struct Params {
  Matrix gate_weight;               // Wg [E, H]
  std::vector<double> expert_bias;  // [E] (used with config.expert_bias)
  ExpertWeights experts;            // all E experts
  SharedExpert shared;              // used with config.shared_ffn_hidden > 0
};

// What one run of forward then backward(dy) yields: what a GPU rank must hold afterwards.
struct LayerResult {
  Routing routing;  // as selected (or replayed), dropped slots included
  Matrix logits;
  Matrix out;
  double aux_loss = 0.0;  // both losses from the routing before capacity drops
  double z_loss = 0.0;
  std::vector<int> kept;                   // [T*K] 1 where the slot kept its row; all 1 dropless
  std::vector<double> tokens_per_expert;   // this rank's kept slots per expert
  std::vector<double> dropped_per_expert;  // this rank's dropped slots per expert
  std::int64_t expert_rows = 0;            // rows this rank's experts ran on, padding included
  Matrix dlogits;
  Matrix dx;
  Matrix d_gate_weight;  // summed over the world
  // [E, H], fp32 runs of one rank (run_layer) asked for it, else empty: what rounding can move each
  // element of d_gate_weight by, per unit of relative rounding and of sum length. At a few tokens
  // that gradient is a few dlogits, which may cancel to far below what formed them.
  Matrix d_gate_weight_magnitude;
  ExpertGrads expert_grads;        // dw13 / dw2 of this rank's experts, summed over its DP group
  SharedExpertGrads shared_grads;  // with shared experts: summed over the world
};

// Where dprob is formed, which decides what kAsStored rounds on its way there: in the combine
// backward, dy·y with y stored (the combine as docs/design.md states it; MoEBlock over NCCL), or in
// the experts that weighed their own rows, <dy·w2ᵀ, a> with dy·w2ᵀ stored and a from the stored h
// (MoEBlock on one GPU and over the peer exchange). The same number in exact arithmetic. Under
// fp8 it also decides what the FP8 experts quantize, as on the GPU: the experts that form dprob
// weigh their own rows (a by p before its quantization, dY unweighed); elsewhere a is unweighed
// and dY = p·dy, in bf16.
enum class ProbabilityGradient { kCombine, kExperts };

// dprob[t·K + k] = <dy[t]·w2_eᵀ, a(row(t, k))>, e the slot's expert, as the experts form it.
std::vector<double> experts_prob_grads(const Matrix& dy, const ExpertActivations& act,
                                       const Layout& layout, const Routing& routing,
                                       const ExpertWeights& weights, Intermediates intermediates,
                                       DType dtype);

// How one run of the layer goes beyond what the config says.
struct LayerOptions {
  // Routing replay: each token's K experts (topk_idx [T*K], slot order) taken as given instead of
  // selected; the probabilities are formed from the current logits (route_given). nullopt selects.
  std::optional<std::span<const int>> replay_experts;
  // kAsStored rounds the intermediates to config.dtype where the GPU stores them.
  Intermediates intermediates = Intermediates::kExact;
  ProbabilityGradient dprob_from = ProbabilityGradient::kCombine;
  // Forms LayerResult::d_gate_weight_magnitude (fp32 configs): about as costly again as the
  // experts' backward, so only the checks that fall back to it ask.
  bool rounding_magnitudes = false;
};

// One GPU: forward and backward of the batch x with output gradient dy. With config.fp8 the routed
// experts run as FP8 forms them (fp8_expert_forward, fp8_expert_backward: bf16 where the GPU
// stores, whatever options.intermediates says, since the quantization reads those bf16 values) and
// the gate, the router and the shared expert as without it, as on the GPU; the exact layer is the
// same config with fp8 off. What the GPU adds is its accumulation order and the bf16 roundings it
// moves.
LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, const LayerOptions& options = {});

// ---- Experts one at a time ----------------------------------------------------------------------
//
// A layer's routed experts can outgrow memory as doubles (deepseek-v3: 256 experts of 3·7168·2048
// weights, 90 GB), while what the backward keeps of them is per row (h, a, y). The streamed
// run_layer below therefore takes the experts one at a time, from an ExpertSource, in the forward
// and again in the backward, and hands each expert's weight gradients to an ExpertGradSink as soon
// as they are known: it never holds more than one expert's weights or gradients. Its results are
// the in-memory run_layer's, bit for bit (that run_layer is this one over the two in-memory
// implementations).

// Where the experts' weights come from.
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual int num_experts() const = 0;
  // Expert e's weights as an ExpertWeights of one expert: w13 [H, 2F], w2 [F, H].
  virtual ExpertWeights load(int expert) const = 0;
};

// Experts already in memory (each load copies one expert).
class ExpertsInMemory final : public ExpertSource {
 public:
  explicit ExpertsInMemory(const ExpertWeights& experts) : experts_(experts) {}
  int num_experts() const override;
  ExpertWeights load(int expert) const override;

 private:
  const ExpertWeights& experts_;
};

// Where the experts' weight gradients go: take() is called once per expert, e = 0, 1, ..., E-1,
// with dw13 [H, 2F] and dw2 [F, H].
class ExpertGradSink {
 public:
  virtual ~ExpertGradSink() = default;
  virtual void take(int expert, Matrix dw13, Matrix dw2) = 0;
};

// Collects the gradients into dw13 and dw2, expert after expert.
class ExpertGradsInMemory final : public ExpertGradSink {
 public:
  void take(int expert, Matrix dw13, Matrix dw2) override;
  std::vector<Matrix> dw13;
  std::vector<Matrix> dw2;
};

// run_layer with the experts streamed: params.experts is not read (it may be empty), the experts
// come from `experts` and their weight gradients go to `expert_grads` (result.expert_grads then
// holds dX only). An expert that gets no rows is not loaded: its gradients are zero.
LayerResult run_layer(const MoEConfig& config, const Params& params, const ExpertSource& experts,
                      const Matrix& x, const Matrix& dy, ExpertGradSink& expert_grads,
                      const LayerOptions& options = {});
// As the GPU tests run it: with kAsStored, also the rounding magnitudes their fp32 checks fall
// back to.
LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, Intermediates intermediates,
                      ProbabilityGradient dprob_from = ProbabilityGradient::kCombine);

// An EP×DP mesh (config.ep, config.dp), simulated exchange by exchange: x[r] and dy[r] are world
// rank r's batch (r = dp_index·EP + ep_index), all ranks share params. Element r of the result is
// what rank r must hold, its expert gradients those of experts [ep_index·E_loc,
// (ep_index+1)·E_loc). replay_experts is empty (every rank selects) or holds each rank's given
// routing, as LayerOptions::replay_experts. In capacity mode each rank drops on its own tokens.
// Under fp8 the experts run as fp8_expert_forward / fp8_expert_backward form them, with the NCCL
// exchange's roles (the combine weighs the rows, as run_layer's ProbabilityGradient::kCombine):
// dropless, every rank's results are run_layer's on the concatenated batch, up to fp64 summation
// order.
std::vector<LayerResult> run_mesh(const MoEConfig& config, const Params& params,
                                  std::span<const Matrix> x, std::span<const Matrix> dy,
                                  std::span<const std::vector<int>> replay_experts = {});

// Σ out·dy + L_aux + L_z: the scalar whose gradients run_layer computes (for finite differences).
double layer_objective(const MoEConfig& config, const Params& params, const Matrix& x,
                       const Matrix& dy, const LayerOptions& options = {});

}  // namespace moe::reference
