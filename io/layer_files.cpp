#include "io/layer_files.h"

#include <fmt/ranges.h>

#include <cstring>
#include <set>

#include "moe/error.h"

namespace moe {
namespace {

using reference::transpose;

TensorInfo expect(const TensorSource& file, const std::string& name,
                  const std::vector<std::int64_t>& shape, bool float_only = true) {
  TensorInfo t = file.info(name);
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
void expect_only(const TensorSource& file, const std::set<std::string>& known,
                 std::string_view what, std::string_view expected) {
  for (const auto& name : file.names()) {
    if (known.count(name) == 0) {
      fail("{}: tensor '{}' is not one of the {} tensors the layer reads ({})", file.source(), name,
           what, expected);
    }
  }
}

// The weights tensors this config reads; a tensor that only another config reads, or one that
// this config reads and the file lacks, is named with the setting that decides it.
std::vector<std::string> expected_weights(const MoEConfig& config, const TensorSource& weights) {
  std::vector<std::string> names = {"gate_weight", "w13", "w2"};
  const auto optional = [&](const char* name, bool read, const std::string& setting) {
    if (read) {
      if (!weights.contains(name))
        fail("{}: no tensor named '{}', which the config's {} reads", weights.source(), name,
             setting);
      names.push_back(name);
    } else if (weights.contains(name)) {
      fail("{}: tensor '{}' is given but the config has {}", weights.source(), name, setting);
    }
  };
  const std::string shared = fmt::format("shared_ffn_hidden: {}", config.shared_ffn_hidden);
  optional("expert_bias", config.expert_bias,
           config.expert_bias ? "expert_bias: true" : "expert_bias: false");
  optional("shared_w13", config.shared_experts(), shared);
  optional("shared_w2", config.shared_experts(), shared);
  optional("shared_gate_weight", config.shared_gate,
           config.shared_gate ? "shared_gate: true" : "shared_gate: false");
  return names;
}

std::vector<int> read_replay_experts(const MoEConfig& config, const TensorSource& inputs,
                                     std::int64_t tokens) {
  const TensorInfo t = inputs.info("topk_idx");
  const std::vector<std::int64_t> shape = {tokens, config.topk};
  if (t.dtype != FileDType::kI32 || t.shape != shape)
    fail("{}: tensor 'topk_idx' is {}[{}]; expected I32 [{}]", inputs.source(),
         file_dtype_name(t.dtype), fmt::join(t.shape, ", "), fmt::join(shape, ", "));
  const FileTensor idx = inputs.read_tensor("topk_idx");
  std::vector<std::int32_t> raw(static_cast<std::size_t>(t.numel));
  if (!raw.empty()) std::memcpy(raw.data(), idx.data.data(), raw.size() * 4);
  std::vector<int> experts(raw.begin(), raw.end());
  reference::check_given_experts(config, tokens, experts,
                                 fmt::format("{}: tensor 'topk_idx'", inputs.source()));
  return experts;
}

std::vector<std::int64_t> read_tokens_per_rank(const TensorSource& inputs, std::int64_t tokens) {
  const TensorInfo split = inputs.info("tokens_per_rank");
  if (split.dtype != FileDType::kI64 || split.shape.size() != 1) {
    fail("{}: tensor 'tokens_per_rank' is {}[{}]; expected I64 [world]", inputs.source(),
         file_dtype_name(split.dtype), fmt::join(split.shape, ", "));
  }
  // Empty means "not given" to the caller, so an empty tensor would be silently ignored.
  if (split.shape[0] == 0)
    fail("{}: tensor 'tokens_per_rank' has no entries; expected [world]", inputs.source());
  const FileTensor file = inputs.read_tensor("tokens_per_rank");
  std::vector<std::int64_t> counts(static_cast<std::size_t>(split.numel));
  std::memcpy(counts.data(), file.data.data(), counts.size() * 8);
  std::int64_t sum = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const std::int64_t count = counts[r];
    if (count < 0)
      fail("{}: tensor 'tokens_per_rank' holds a negative count {} at [{}]", inputs.source(), count,
           r);
    // The counts come from a file: their sum is checked, not left to overflow.
    if (__builtin_add_overflow(sum, count, &sum)) {
      fail("{}: tensor 'tokens_per_rank' sums past int64 at [{}] (count {})", inputs.source(), r,
           count);
    }
  }
  if (sum != tokens)
    fail("{}: tensor 'tokens_per_rank' sums to {} but x has {} tokens", inputs.source(), sum,
         tokens);
  return counts;
}

// A whole tensor's values as a [rows, cols] matrix (the shape was checked), as a layer holding
// it in `held` sees them.
reference::Matrix matrix(const TensorSource& file, const std::string& name, std::int64_t rows,
                         std::int64_t cols, DType held) {
  reference::Matrix m(rows, cols);
  m.data = file_values(file.read_tensor(name), name, held);
  return m;
}

// Rows [first_row, first_row + rows) of a row-major [·, cols] tensor's values.
reference::Matrix matrix(const std::vector<double>& values, std::int64_t rows, std::int64_t cols,
                         std::int64_t first_row) {
  reference::Matrix m(rows, cols);
  std::copy(values.begin() + first_row * cols, values.begin() + (first_row + rows) * cols,
            m.data.begin());
  return m;
}

LayerInputs read_layer_inputs(const MoEConfig& config, const TensorSource& weights,
                              const TensorSource& inputs, const TensorSource* routing,
                              bool with_experts) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const std::int64_t Fs = config.shared_ffn_hidden;
  CheckedLayerFiles checked = check_layer_files(config, weights, inputs, routing);
  const std::int64_t T = checked.tokens;
  // The values the GPU layer computes with: rounded to bf16 in a bf16 layer (the bias stays fp32).
  const DType held = config.dtype;
  LayerInputs in;
  in.params.gate_weight = matrix(weights, "gate_weight", E, H, held);
  if (with_experts) {  // each stack converted once
    const std::vector<double> w13 = file_values(weights.read_tensor("w13"), "w13", held);
    const std::vector<double> w2 = file_values(weights.read_tensor("w2"), "w2", held);
    for (std::int64_t e = 0; e < E; ++e) {
      in.params.experts.w13.push_back(transpose(matrix(w13, 2 * F, H, e * 2 * F)));
      in.params.experts.w2.push_back(transpose(matrix(w2, H, F, e * H)));
    }
  }
  if (config.expert_bias) {
    in.params.expert_bias = file_values(weights.read_tensor("expert_bias"), "expert_bias");
  } else {
    in.params.expert_bias.assign(E, 0.0);
  }
  if (config.shared_experts()) {
    in.params.shared.w13 = transpose(matrix(weights, "shared_w13", 2 * Fs, H, held));
    in.params.shared.w2 = transpose(matrix(weights, "shared_w2", H, Fs, held));
  }
  if (config.shared_gate)
    in.params.shared.gate_weight = matrix(weights, "shared_gate_weight", 1, H, held);
  in.x = matrix(inputs, "x", T, H, held);
  in.dy = matrix(inputs, "dy", T, H, held);
  in.tokens_per_rank = std::move(checked.tokens_per_rank);
  in.replay_experts = std::move(checked.replay_experts);
  return in;
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

// Every results tensor of `r` but the experts' weight gradients, handed to
// put(name, dtype, shape, data, bytes): the one list both ways of writing results share.
template <typename Put>
void put_results(const MoEConfig& config, const reference::LayerResult& r, Put&& put) {
  const std::int64_t E = config.num_experts, H = config.hidden, K = config.topk;
  const std::int64_t T = r.out.rows;
  // The values must fill the shape: a result of another batch or config is an error, not a file
  // whose header and data disagree.
  const auto check = [&](const char* name, const std::vector<std::int64_t>& shape,
                         std::size_t values) {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    if (static_cast<std::int64_t>(values) != n)
      fail("layer results: tensor '{}' has {} values for shape [{}]", name, values,
           fmt::join(shape, ", "));
  };
  const auto f32 = [&](const char* name, std::vector<std::int64_t> shape,
                       const std::vector<double>& values) {
    check(name, shape, values.size());
    const std::vector<float> data(values.begin(), values.end());
    put(name, FileDType::kF32, std::move(shape), data.data(), data.size() * 4);
  };
  const auto i32 = [&](const char* name, std::vector<std::int64_t> shape, const auto& values) {
    check(name, shape, values.size());
    const std::vector<std::int32_t> data(values.begin(), values.end());
    put(name, FileDType::kI32, std::move(shape), data.data(), data.size() * 4);
  };
  f32("out", {T, H}, r.out.data);
  f32("dx", {T, H}, r.dx.data);
  f32("topk_p", {T, K}, r.routing.prob);
  i32("topk_idx", {T, K}, r.routing.expert);
  f32("aux_loss", {1}, std::vector<double>{r.aux_loss});
  f32("z_loss", {1}, std::vector<double>{r.z_loss});
  i32("tokens_per_expert", {E}, r.tokens_per_expert);
  i32("kept", {T, K}, r.kept);
  i32("dropped_per_expert", {E}, r.dropped_per_expert);
  f32("grad.gate_weight", {E, H}, r.d_gate_weight.data);
  if (config.shared_experts()) {
    const std::int64_t Fs = config.shared_ffn_hidden;
    f32("grad.shared_w13", {2 * Fs, H}, transpose(r.shared_grads.dw13).data);
    f32("grad.shared_w2", {H, Fs}, transpose(r.shared_grads.dw2).data);
  }
  if (config.shared_gate) f32("grad.shared_gate_weight", {1, H}, r.shared_grads.dgate_weight.data);
}

}  // namespace

std::vector<std::int64_t> CheckedLayerFiles::split(int world) const {
  if (world < 1) fail("a mesh of {} ranks has no rank to take the tokens", world);
  if (tokens_per_rank.empty()) {  // an even split, the remainder to the first ranks
    std::vector<std::int64_t> counts;
    for (int r = 0; r < world; ++r) counts.push_back(tokens / world + (r < tokens % world ? 1 : 0));
    return counts;
  }
  if (std::ssize(tokens_per_rank) != world)
    fail("{}: tensor 'tokens_per_rank' has {} entries for {} ranks", tokens_per_rank_source,
         tokens_per_rank.size(), world);
  return tokens_per_rank;
}

CheckedLayerFiles check_layer_files(const MoEConfig& config, const TensorSource& weights,
                                    const TensorSource& inputs, const TensorSource* routing) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const std::int64_t Fs = config.shared_ffn_hidden;
  const std::vector<std::string> weight_names = expected_weights(config, weights);
  expect_only(weights, {weight_names.begin(), weight_names.end()}, "weights",
              fmt::format("{}", fmt::join(weight_names, ", ")));
  expect_only(inputs, {"x", "dy", "tokens_per_rank", "topk_idx"}, "inputs",
              "x, dy, tokens_per_rank, topk_idx");
  expect(weights, "gate_weight", {E, H});
  expect(weights, "w13", {E, 2 * F, H});
  expect(weights, "w2", {E, H, F});
  if (config.expert_bias) expect(weights, "expert_bias", {E});
  if (config.shared_experts()) {
    expect(weights, "shared_w13", {2 * Fs, H});
    expect(weights, "shared_w2", {H, Fs});
  }
  if (config.shared_gate) expect(weights, "shared_gate_weight", {1, H});
  const TensorInfo x = inputs.info("x");
  if (x.shape.size() != 2 || x.shape[1] != H)
    fail("{}: tensor 'x' has shape [{}]; expected [T, {}]", inputs.source(),
         fmt::join(x.shape, ", "), H);
  CheckedLayerFiles checked;
  checked.tokens = x.shape[0];
  expect(inputs, "x", {checked.tokens, H});
  expect(inputs, "dy", {checked.tokens, H});
  if (routing != nullptr) {
    if (inputs.contains("topk_idx"))
      fail(
          "{}: tensor 'topk_idx' gives a routing to replay, and so does {}: give the routing "
          "once",
          inputs.source(), routing->source());
    if (!routing->contains("topk_idx"))
      fail("{}: no tensor named 'topk_idx' (the routing to replay, I32 [{}, {}])",
           routing->source(), checked.tokens, config.topk);
    checked.replay_experts = read_replay_experts(config, *routing, checked.tokens);
  } else if (inputs.contains("topk_idx")) {
    checked.replay_experts = read_replay_experts(config, inputs, checked.tokens);
  }
  if (inputs.contains("tokens_per_rank")) {
    checked.tokens_per_rank = read_tokens_per_rank(inputs, checked.tokens);
    checked.tokens_per_rank_source = inputs.source();
  }
  return checked;
}

LayerInputs read_layer_inputs(const MoEConfig& config, const TensorSource& weights,
                              const TensorSource& inputs, const TensorSource* routing) {
  return read_layer_inputs(config, weights, inputs, routing, /*with_experts=*/true);
}

LayerInputs read_layer_inputs_without_experts(const MoEConfig& config, const TensorSource& weights,
                                              const TensorSource& inputs,
                                              const TensorSource* routing) {
  return read_layer_inputs(config, weights, inputs, routing, /*with_experts=*/false);
}

TensorFile routing_file(const MoEConfig& config, std::span<const std::int32_t> topk_idx) {
  const std::int64_t K = config.topk;
  if (K < 1 || std::ssize(topk_idx) % K != 0)
    fail("routing_file: {} experts are no whole number of tokens of top-{}", topk_idx.size(), K);
  TensorFile file;
  file.add("topk_idx", FileDType::kI32, {std::ssize(topk_idx) / K, K}, topk_idx.data());
  file.metadata = layer_results_metadata(config);
  file.metadata["content"] = "the routing of one step (topk_idx), for moe_run --replay-routing";
  return file;
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
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  TensorFile file;
  put_results(
      config, r,
      [&](const char* name, FileDType dtype, std::vector<std::int64_t> shape, const void* data,
          std::size_t) { file.add(name, dtype, std::move(shape), data); });
  add_f32(file, "grad.w13", {E, 2 * F, H}, stacked_transposed(r.expert_grads.dw13));
  add_f32(file, "grad.w2", {E, H, F}, stacked_transposed(r.expert_grads.dw2));
  file.metadata = layer_results_metadata(config);
  return file;
}

std::vector<TensorSpec> layer_results_specs(const MoEConfig& config, std::int64_t tokens) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden,
                     K = config.topk, T = tokens;
  constexpr FileDType f32 = FileDType::kF32, i32 = FileDType::kI32;
  std::vector<TensorSpec> specs = {{"out", f32, {T, H}},
                                   {"dx", f32, {T, H}},
                                   {"topk_p", f32, {T, K}},
                                   {"topk_idx", i32, {T, K}},
                                   {"aux_loss", f32, {1}},
                                   {"z_loss", f32, {1}},
                                   {"tokens_per_expert", i32, {E}},
                                   {"kept", i32, {T, K}},
                                   {"dropped_per_expert", i32, {E}},
                                   {"grad.gate_weight", f32, {E, H}},
                                   {"grad.w13", f32, {E, 2 * F, H}},
                                   {"grad.w2", f32, {E, H, F}}};
  if (config.shared_experts()) {
    const std::int64_t Fs = config.shared_ffn_hidden;
    specs.push_back({"grad.shared_w13", f32, {2 * Fs, H}});
    specs.push_back({"grad.shared_w2", f32, {H, Fs}});
  }
  if (config.shared_gate) specs.push_back({"grad.shared_gate_weight", f32, {1, H}});
  return specs;
}

std::map<std::string, std::string> layer_results_metadata(const MoEConfig& config) {
  return {{"producer", "moe-runtime"}, {"config", config.describe()}};
}

void write_layer_results(TensorFileWriter& writer, const MoEConfig& config,
                         const reference::LayerResult& result) {
  put_results(config, result,
              [&](const char* name, FileDType, std::vector<std::int64_t>, const void* data,
                  std::size_t bytes) { writer.append(name, data, bytes); });
}

}  // namespace moe
