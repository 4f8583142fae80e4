#include "io/layer_files.h"

#include <fmt/ranges.h>

#include <cstring>

#include "moe/error.h"

namespace moe {
namespace {

using reference::transpose;

const FileTensor& expect(const TensorFile& file, const std::string& name,
                         std::vector<std::int64_t> shape, bool float_only = true) {
  const FileTensor& t = file.get(name);
  if (float_only && t.dtype != FileDType::kBF16 && t.dtype != FileDType::kF32) {
    fail("tensor '{}' is {}; expected BF16 or F32", name, file_dtype_name(t.dtype));
  }
  if (t.shape != shape)
    fail("tensor '{}' has shape [{}]; expected [{}]", name, fmt::join(t.shape, ", "),
         fmt::join(shape, ", "));
  return t;
}

// Rows [first_row, first_row + rows) of a row-major [·, cols] tensor's values.
reference::Matrix matrix(const std::vector<double>& values, std::int64_t rows, std::int64_t cols,
                         std::int64_t first_row = 0) {
  reference::Matrix m(rows, cols);
  std::copy(values.begin() + first_row * cols, values.begin() + (first_row + rows) * cols,
            m.data.begin());
  return m;
}

void add_f32(TensorFile& file, const std::string& name, std::vector<std::int64_t> shape,
             const std::vector<double>& values) {
  const std::vector<float> data(values.begin(), values.end());
  file.add(name, FileDType::kF32, std::move(shape), data.data());
}

// Per-expert matrices in the reference's math layout, stacked in the files' nn.Linear layout.
std::vector<double> stacked_transposed(const std::vector<reference::Matrix>& experts) {
  std::vector<double> out;
  for (const auto& m : experts) {
    const auto t = transpose(m);
    out.insert(out.end(), t.data.begin(), t.data.end());
  }
  return out;
}

}  // namespace

std::vector<double> file_values(const FileTensor& t) {
  const auto n = static_cast<std::size_t>(t.numel());
  std::vector<double> values(n);
  if (t.dtype == FileDType::kBF16) {
    std::vector<BF16> raw(n);
    std::memcpy(raw.data(), t.data.data(), n * 2);
    for (std::size_t i = 0; i < n; ++i) values[i] = from_bf16(raw[i]);
  } else if (t.dtype == FileDType::kF32) {
    std::vector<float> raw(n);
    std::memcpy(raw.data(), t.data.data(), n * 4);
    for (std::size_t i = 0; i < n; ++i) values[i] = raw[i];
  } else {
    fail("file_values: {} is not a floating-point type", file_dtype_name(t.dtype));
  }
  return values;
}

LayerInputs read_layer_inputs(const MoEConfig& config, const TensorFile& weights,
                              const TensorFile& inputs) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  LayerInputs in;
  in.params.gate_weight = matrix(file_values(expect(weights, "gate_weight", {E, H})), E, H);
  // Each stack converted once (values, not references into the file: a reference returned by
  // expect() beside its temporary arguments is what gcc 13's -Wdangling-reference flags).
  const std::vector<double> w13 = file_values(expect(weights, "w13", {E, 2 * F, H}));
  const std::vector<double> w2 = file_values(expect(weights, "w2", {E, H, F}));
  for (std::int64_t e = 0; e < E; ++e) {
    in.params.experts.w13.push_back(transpose(matrix(w13, 2 * F, H, e * 2 * F)));
    in.params.experts.w2.push_back(transpose(matrix(w2, H, F, e * H)));
  }
  if (config.expert_bias) {
    in.params.expert_bias = file_values(expect(weights, "expert_bias", {E}));
  } else {
    in.params.expert_bias.assign(E, 0.0);
  }
  const auto& x = inputs.get("x");
  if (x.shape.size() != 2 || x.shape[1] != H)
    fail("tensor 'x' has shape [{}]; expected [T, {}]", fmt::join(x.shape, ", "), H);
  const std::int64_t T = x.shape[0];
  in.x = matrix(file_values(expect(inputs, "x", {T, H})), T, H);
  in.dy = matrix(file_values(expect(inputs, "dy", {T, H})), T, H);
  if (inputs.contains("tokens_per_rank")) {
    const auto& split = inputs.get("tokens_per_rank");
    if (split.dtype != FileDType::kI64 || split.shape.size() != 1)
      fail("tensor 'tokens_per_rank' must be I64 [world]");
    in.tokens_per_rank.resize(static_cast<std::size_t>(split.shape[0]));
    std::memcpy(in.tokens_per_rank.data(), split.data.data(), in.tokens_per_rank.size() * 8);
    std::int64_t sum = 0;
    for (const auto t : in.tokens_per_rank) {
      if (t < 0) fail("tokens_per_rank holds a negative count {}", t);
      sum += t;
    }
    if (sum != T) fail("tokens_per_rank sums to {} but x has {} tokens", sum, T);
  }
  return in;
}

TensorFile layer_weights_file(const MoEConfig& config, const reference::Params& p) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  TensorFile file;
  add_f32(file, "gate_weight", {E, H}, p.gate_weight.data);
  add_f32(file, "w13", {E, 2 * F, H}, stacked_transposed(p.experts.w13));
  add_f32(file, "w2", {E, H, F}, stacked_transposed(p.experts.w2));
  if (config.expert_bias) add_f32(file, "expert_bias", {E}, p.expert_bias);
  return file;
}

TensorFile layer_inputs_file(const reference::Matrix& x, const reference::Matrix& dy) {
  TensorFile file;
  add_f32(file, "x", {x.rows, x.cols}, x.data);
  add_f32(file, "dy", {dy.rows, dy.cols}, dy.data);
  return file;
}

TensorFile layer_results_file(const MoEConfig& config, const reference::LayerResult& r) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden,
                     K = config.topk;
  const std::int64_t T = r.out.rows;
  TensorFile file;
  add_f32(file, "out", {T, H}, r.out.data);
  add_f32(file, "dx", {T, H}, r.dx.data);
  add_f32(file, "topk_p", {T, K}, r.routing.prob);
  file.add("topk_idx", FileDType::kI32, {T, K}, r.routing.expert.data());
  add_f32(file, "aux_loss", {1}, {r.aux_loss});
  add_f32(file, "z_loss", {1}, {r.z_loss});
  const std::vector<std::int32_t> load(r.tokens_per_expert.begin(), r.tokens_per_expert.end());
  file.add("tokens_per_expert", FileDType::kI32, {E}, load.data());
  add_f32(file, "grad.gate_weight", {E, H}, r.d_gate_weight.data);
  add_f32(file, "grad.w13", {E, 2 * F, H}, stacked_transposed(r.expert_grads.dw13));
  add_f32(file, "grad.w2", {E, H, F}, stacked_transposed(r.expert_grads.dw2));
  file.metadata["producer"] = "moe-runtime";
  file.metadata["config"] = config.describe();
  return file;
}

}  // namespace moe
