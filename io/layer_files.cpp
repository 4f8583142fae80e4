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

namespace {

// The weights tensors this config reads; a tensor that only another config reads is named with the
// setting that would read it.
std::vector<std::string> expected_weights(const MoEConfig& config, const TensorFile& weights) {
  std::vector<std::string> names = {"gate_weight", "w13", "w2"};
  const auto optional = [&](const char* name, bool read, const char* setting) {
    if (read) {
      names.push_back(name);
    } else if (weights.contains(name)) {
      fail("{}: tensor '{}' is given but the config has {}", weights.source(), name, setting);
    }
  };
  optional("expert_bias", config.expert_bias, "expert_bias: false");
  optional("shared_w13", config.shared_experts(), "shared_ffn_hidden: 0");
  optional("shared_w2", config.shared_experts(), "shared_ffn_hidden: 0");
  optional("shared_gate_weight", config.shared_gate, "shared_gate: false");
  return names;
}

std::vector<int> read_replay_experts(const MoEConfig& config, const TensorFile& inputs,
                                     std::int64_t tokens) {
  const FileTensor& t = inputs.get("topk_idx");
  const std::vector<std::int64_t> shape = {tokens, config.topk};
  if (t.dtype != FileDType::kI32 || t.shape != shape)
    fail("{}: tensor 'topk_idx' is {}[{}]; expected I32 [{}]", inputs.source(),
         file_dtype_name(t.dtype), fmt::join(t.shape, ", "), fmt::join(shape, ", "));
  const auto n = static_cast<std::size_t>(tokens * config.topk);
  if (t.data.size() != n * 4)
    fail("{}: tensor 'topk_idx' holds {} bytes for {} indices", inputs.source(), t.data.size(), n);
  std::vector<std::int32_t> raw(n);
  if (n > 0) std::memcpy(raw.data(), t.data.data(), n * 4);
  std::vector<int> experts(raw.begin(), raw.end());
  reference::check_given_experts(config, tokens, experts,
                                 fmt::format("{}: tensor 'topk_idx'", inputs.source()));
  return experts;
}

}  // namespace

LayerInputs read_layer_inputs(const MoEConfig& config, const TensorFile& weights,
                              const TensorFile& inputs) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const std::int64_t Fs = config.shared_ffn_hidden;
  LayerInputs in;
  const std::vector<std::string> weight_names = expected_weights(config, weights);
  expect_only(weights, {weight_names.begin(), weight_names.end()}, "weights",
              fmt::format("{}", fmt::join(weight_names, ", ")));
  expect_only(inputs, {"x", "dy", "tokens_per_rank", "topk_idx"}, "inputs",
              "x, dy, tokens_per_rank, topk_idx");
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
  if (config.shared_experts()) {
    in.params.shared.w13 = transpose(
        matrix(file_values(expect(weights, "shared_w13", {2 * Fs, H}), "shared_w13"), 2 * Fs, H));
    in.params.shared.w2 =
        transpose(matrix(file_values(expect(weights, "shared_w2", {H, Fs}), "shared_w2"), H, Fs));
  }
  if (config.shared_gate) {
    in.params.shared.gate_weight = matrix(
        file_values(expect(weights, "shared_gate_weight", {1, H}), "shared_gate_weight"), 1, H);
  }
  const auto& x = inputs.get("x");
  if (x.shape.size() != 2 || x.shape[1] != H)
    fail("{}: tensor 'x' has shape [{}]; expected [T, {}]", inputs.source(),
         fmt::join(x.shape, ", "), H);
  const std::int64_t T = x.shape[0];
  in.x = matrix(file_values(expect(inputs, "x", {T, H}), "x"), T, H);
  in.dy = matrix(file_values(expect(inputs, "dy", {T, H}), "dy"), T, H);
  if (inputs.contains("topk_idx")) in.replay_experts = read_replay_experts(config, inputs, T);
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
  if (config.shared_experts()) {
    const std::int64_t Fs = config.shared_ffn_hidden;
    add_f32(file, "shared_w13", {2 * Fs, H}, transpose(p.shared.w13).data);
    add_f32(file, "shared_w2", {H, Fs}, transpose(p.shared.w2).data);
  }
  if (config.shared_gate) add_f32(file, "shared_gate_weight", {1, H}, p.shared.gate_weight.data);
  return file;
}

TensorFile layer_inputs_file(const reference::Matrix& x, const reference::Matrix& dy) {
  TensorFile file;
  add_f32(file, "x", {x.rows, x.cols}, x.data);
  add_f32(file, "dy", {dy.rows, dy.cols}, dy.data);
  return file;
}

TensorFile layer_inputs_file(const reference::Matrix& x, const reference::Matrix& dy,
                             std::span<const int> replay_experts, int topk) {
  if (topk < 1 || std::ssize(replay_experts) != x.rows * topk)
    fail("layer_inputs_file: {} replayed experts for {} tokens of top-{}", replay_experts.size(),
         x.rows, topk);
  TensorFile file = layer_inputs_file(x, dy);
  const std::vector<std::int32_t> idx(replay_experts.begin(), replay_experts.end());
  file.add("topk_idx", FileDType::kI32, {x.rows, topk}, idx.data());
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
  const std::vector<std::int32_t> kept(r.kept.begin(), r.kept.end());
  file.add("kept", FileDType::kI32, {T, K}, kept.data());
  const std::vector<std::int32_t> dropped(r.dropped_per_expert.begin(), r.dropped_per_expert.end());
  file.add("dropped_per_expert", FileDType::kI32, {E}, dropped.data());
  add_f32(file, "grad.gate_weight", {E, H}, r.d_gate_weight.data);
  add_f32(file, "grad.w13", {E, 2 * F, H}, stacked_transposed(r.expert_grads.dw13));
  add_f32(file, "grad.w2", {E, H, F}, stacked_transposed(r.expert_grads.dw2));
  if (config.shared_experts()) {
    const std::int64_t Fs = config.shared_ffn_hidden;
    add_f32(file, "grad.shared_w13", {2 * Fs, H}, transpose(r.shared_grads.dw13).data);
    add_f32(file, "grad.shared_w2", {H, Fs}, transpose(r.shared_grads.dw2).data);
  }
  if (config.shared_gate)
    add_f32(file, "grad.shared_gate_weight", {1, H}, r.shared_grads.dgate_weight.data);
  file.metadata["producer"] = "moe-runtime";
  file.metadata["config"] = config.describe();
  return file;
}

}  // namespace moe
