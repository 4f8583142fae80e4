#include "io/layer_files.h"

#include <fmt/ranges.h>

#include <cmath>
#include <cstring>
#include <set>

#include "moe/error.h"

namespace moe {
namespace {

using reference::transpose;

const FileTensor& expect(const TensorFile& file, const std::string& name,
                         std::vector<std::int64_t> shape, bool float_only = true) {
  const FileTensor& t = file.get(name);
  if (float_only && t.dtype != FileDType::kBF16 && t.dtype != FileDType::kF32) {
    fail("{}: tensor '{}' is {}; expected BF16 or F32", file.source(), name,
         file_dtype_name(t.dtype));
  }
  if (t.shape != shape)
    fail("{}: tensor '{}' has shape [{}]; expected [{}]", file.source(), name,
         fmt::join(t.shape, ", "), fmt::join(shape, ", "));
  return t;
}

// Every tensor of `file` is one the layer reads: a misspelt or stray tensor (w1 and w3 instead of
// w13, an expert_bias the config does not use) is an error, not silently left out.
void expect_only(const TensorFile& file, const std::set<std::string>& known, std::string_view what,
                 std::string_view expected) {
  for (const auto& [name, tensor] : file.tensors()) {
    if (known.count(name) == 0) {
      fail("{}: tensor '{}' is not one of the {} tensors the layer reads ({})", file.source(), name,
           what, expected);
    }
  }
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

std::vector<double> file_values(const FileTensor& t, std::string_view name) {
  if (t.dtype != FileDType::kBF16 && t.dtype != FileDType::kF32)
    fail("tensor '{}' is {}, not a floating-point type", name, file_dtype_name(t.dtype));
  // FileTensor's fields are public: the bytes are checked against the shape before being read.
  const auto n = static_cast<std::size_t>(t.numel());
  const std::size_t element = file_dtype_size(t.dtype);
  if (t.data.size() % element != 0 || t.data.size() / element != n) {
    fail("tensor '{}' holds {} bytes but {}[{}] needs {} elements of {} bytes", name, t.data.size(),
         file_dtype_name(t.dtype), fmt::join(t.shape, ", "), n, element);
  }
  std::vector<double> values(n);
  for (std::size_t i = 0; i < n; ++i) {  // element-wise memcpy: no alignment assumed, no null
    if (t.dtype == FileDType::kBF16) {
      BF16 raw;
      std::memcpy(&raw, t.data.data() + i * 2, 2);
      values[i] = from_bf16(raw);
    } else {
      float raw = 0;
      std::memcpy(&raw, t.data.data() + i * 4, 4);
      values[i] = raw;
    }
  }
  return values;
}

void check_finite(const TensorFile& file) {
  for (const auto& [name, t] : file.tensors()) {
    if (t.dtype != FileDType::kBF16 && t.dtype != FileDType::kF32) continue;
    const std::vector<double> values = file_values(t, name);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i]) && bad++ == 0) first = i;
    }
    if (bad == 0) continue;
    // The first bad element by its index in every dimension, as a framework would print it.
    std::vector<std::int64_t> index(t.shape.size());
    std::size_t rest = first;
    for (std::size_t d = t.shape.size(); d-- > 0;) {
      const auto extent = static_cast<std::size_t>(t.shape[d]);
      index[d] = static_cast<std::int64_t>(rest % extent);
      rest /= extent;
    }
    fail("{}: tensor '{}' holds {} at [{}] ({} of its {} elements are NaN or Inf)", file.source(),
         name, values[first], fmt::join(index, ", "), bad, values.size());
  }
}

LayerInputs read_layer_inputs(const MoEConfig& config, const TensorFile& weights,
                              const TensorFile& inputs) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  LayerInputs in;
  if (config.expert_bias) {
    expect_only(weights, {"gate_weight", "w13", "w2", "expert_bias"}, "weights",
                "gate_weight, w13, w2, expert_bias");
  } else {
    if (weights.contains("expert_bias")) {
      fail("{}: tensor 'expert_bias' is given but the config has expert_bias: false",
           weights.source());
    }
    expect_only(weights, {"gate_weight", "w13", "w2"}, "weights", "gate_weight, w13, w2");
  }
  expect_only(inputs, {"x", "dy", "tokens_per_rank"}, "inputs", "x, dy, tokens_per_rank");
  in.params.gate_weight =
      matrix(file_values(expect(weights, "gate_weight", {E, H}), "gate_weight"), E, H);
  // Each stack converted once (values, not references into the file: a reference returned by
  // expect() beside its temporary arguments is what gcc 13's -Wdangling-reference flags).
  const std::vector<double> w13 = file_values(expect(weights, "w13", {E, 2 * F, H}), "w13");
  const std::vector<double> w2 = file_values(expect(weights, "w2", {E, H, F}), "w2");
  for (std::int64_t e = 0; e < E; ++e) {
    in.params.experts.w13.push_back(transpose(matrix(w13, 2 * F, H, e * 2 * F)));
    in.params.experts.w2.push_back(transpose(matrix(w2, H, F, e * H)));
  }
  if (config.expert_bias) {
    in.params.expert_bias = file_values(expect(weights, "expert_bias", {E}), "expert_bias");
  } else {
    in.params.expert_bias.assign(E, 0.0);
  }
  const auto& x = inputs.get("x");
  if (x.shape.size() != 2 || x.shape[1] != H)
    fail("{}: tensor 'x' has shape [{}]; expected [T, {}]", inputs.source(),
         fmt::join(x.shape, ", "), H);
  const std::int64_t T = x.shape[0];
  in.x = matrix(file_values(expect(inputs, "x", {T, H}), "x"), T, H);
  in.dy = matrix(file_values(expect(inputs, "dy", {T, H}), "dy"), T, H);
  if (inputs.contains("tokens_per_rank")) {
    const auto& split = inputs.get("tokens_per_rank");
    if (split.dtype != FileDType::kI64 || split.shape.size() != 1) {
      fail("{}: tensor 'tokens_per_rank' is {}[{}]; expected I64 [world]", inputs.source(),
           file_dtype_name(split.dtype), fmt::join(split.shape, ", "));
    }
    // Empty means "not given" to the caller, so an empty tensor would be silently ignored.
    if (split.shape[0] == 0)
      fail("{}: tensor 'tokens_per_rank' has no entries; expected [world]", inputs.source());
    const auto n = static_cast<std::size_t>(split.shape[0]);
    if (split.data.size() / 8 != n || split.data.size() % 8 != 0)
      fail("{}: tensor 'tokens_per_rank' holds {} bytes for {} counts", inputs.source(),
           split.data.size(), n);
    in.tokens_per_rank.resize(n);
    std::memcpy(in.tokens_per_rank.data(), split.data.data(), n * 8);
    std::int64_t sum = 0;
    for (std::size_t r = 0; r < n; ++r) {
      const std::int64_t count = in.tokens_per_rank[r];
      if (count < 0)
        fail("{}: tensor 'tokens_per_rank' holds a negative count {} at [{}]", inputs.source(),
             count, r);
      // The counts come from a file: their sum is checked, not left to overflow.
      if (__builtin_add_overflow(sum, count, &sum)) {
        fail("{}: tensor 'tokens_per_rank' sums past int64 at [{}] (count {})", inputs.source(), r,
             count);
      }
    }
    if (sum != T)
      fail("{}: tensor 'tokens_per_rank' sums to {} but x has {} tokens", inputs.source(), sum, T);
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
