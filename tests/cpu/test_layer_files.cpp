// The layer files read in parts: checking from the headers alone, each mesh rank's share, and the
// fp64 reference streaming its experts through the files. Each is compared with reading the
// files whole, which test_moe_run checks end to end.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "io/expert_streams.h"
#include "io/layer_files.h"
#include "io/rank_inputs.h"
#include "support/catch.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using test::error_from;
using test::file_bytes;

namespace {

// A fresh directory, removed with the object.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(std::uint64_t salt) {
    path = std::filesystem::temp_directory_path() /
           ("moe_layer_files_" + std::to_string(::getpid()) + "_" + std::to_string(salt));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// The message with its leading source (a path or "<memory>") cut off.
std::string without_source(std::string message, const std::string& source) {
  if (message.rfind(source, 0) == 0) message.erase(0, source.size());
  return message;
}

// The same file with every F32 tensor stored as BF16 (the values rounded).
TensorFile as_bf16(const TensorFile& file) {
  TensorFile out;
  for (const auto& [name, t] : file.tensors()) {
    if (t.dtype != FileDType::kF32) {
      out.add(name, t.dtype, t.shape, t.data.data());
      continue;
    }
    std::vector<BF16> values;
    for (const double v : file_values(t, name)) values.push_back(to_bf16(static_cast<float>(v)));
    out.add(name, FileDType::kBF16, t.shape, values.data());
  }
  return out;
}

// Elements [first, first + count) of a whole file tensor as a GPU tensor of `dtype` holds them:
// value to float, then to bf16 or kept as fp32 (what moe_run converted whole files with).
std::vector<std::byte> converted(const FileTensor& t, std::int64_t first, std::int64_t count,
                                 DType dtype) {
  const std::vector<double> values = file_values(t, "t");
  std::vector<std::byte> out(static_cast<std::size_t>(count) * dtype_size(dtype));
  for (std::int64_t i = 0; i < count; ++i) {
    const auto v = static_cast<float>(values[static_cast<std::size_t>(first + i)]);
    if (dtype == DType::kBF16) {
      const BF16 b = to_bf16(v);
      std::memcpy(out.data() + i * 2, &b, 2);
    } else {
      std::memcpy(out.data() + i * 4, &v, 4);
    }
  }
  return out;
}

struct Layer {
  MoEConfig config;
  reference::Params params;
  Matrix x, dy;
  std::vector<int> replay;  // empty: the router selects
  reference::LayerOptions options;
};

Layer random_layer(MoEConfig config, std::int64_t tokens, std::mt19937_64& rng) {
  config.validate();
  Layer l;
  l.config = config;
  // Values an F32 file holds exactly, and the layer too (rounded to its dtype, as the files'
  // reader rounds them), so the files and the direct computation see one number.
  l.params = test::round_params(test::random_params(config, rng), config.dtype);
  l.x = test::round_to(test::random_matrix(tokens, config.hidden, rng), config.dtype);
  l.dy = test::round_to(test::random_matrix(tokens, config.hidden, rng), config.dtype);
  return l;
}

}  // namespace

TEST_CASE("layer files: checking from the headers rejects what reading them whole rejects",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::small_config(6, 4, 4, 2);
  c.score_function = ScoreFunction::kSigmoid;
  c.expert_bias = true;
  c.shared_ffn_hidden = 3;
  c.shared_gate = true;
  const Layer l = random_layer(c, 5, rng);
  const TensorFile weights = layer_weights_file(c, l.params);
  const TensorFile inputs = layer_inputs_file(l.x, l.dy);
  const auto f32 = [](TensorFile file, const std::string& name, std::vector<std::int64_t> shape) {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    const std::vector<float> zeros(static_cast<std::size_t>(n), 0.0f);
    file.add(name, FileDType::kF32, std::move(shape), zeros.data());
    return file;
  };
  const auto with = [](TensorFile file, const std::string& name, FileDType dtype,
                       std::vector<std::int64_t> shape, const void* data) {
    file.add(name, dtype, std::move(shape), data);
    return file;
  };
  const auto without = [&](const TensorFile& file, const std::string& name) {
    TensorFile out;
    for (const auto& [n, t] : file.tensors()) {
      if (n != name) out.add(n, t.dtype, t.shape, t.data.data());
    }
    return out;
  };
  MoEConfig unshared = c;
  unshared.shared_ffn_hidden = 0;
  unshared.shared_gate = false;
  MoEConfig unbiased = c;
  unbiased.expert_bias = false;
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  const std::int64_t overflow[3] = {1, max, max}, negative[2] = {6, -1}, short_split[2] = {1, 1};
  const std::int32_t ints[24] = {};
  const std::vector<std::int32_t> bad_expert = {0, 1, 2, 9, 3, 0, 1, 2, 0, 1};
  const std::vector<std::int32_t> twice = {0, 1, 2, 3, 3, 3, 1, 2, 0, 1};
  struct Case {
    MoEConfig config;
    TensorFile weights, inputs;
  };
  const std::vector<Case> cases = {
      {c, f32(weights, "w2", {4, 4, 6}), inputs},
      {c, with(weights, "gate_weight", FileDType::kI32, {4, 6}, ints), inputs},
      {c, f32(weights, "w1", {4, 4, 6}), inputs},
      {unbiased, weights, inputs},
      {unshared, weights, inputs},
      {c, without(weights, "shared_w2"), inputs},
      {c, f32(weights, "shared_w2", {3, 6}), inputs},
      {c, without(weights, "expert_bias"), inputs},
      {c, weights, without(inputs, "dy")},
      {c, weights, f32(inputs, "dy", {5, 5})},
      {c, weights, f32(inputs, "x", {5, 7})},
      {c, weights, f32(inputs, "labels", {5})},
      {c, weights, with(inputs, "tokens_per_rank", FileDType::kI64, {2}, short_split)},
      {c, weights, with(inputs, "tokens_per_rank", FileDType::kI64, {3}, overflow)},
      {c, weights, with(inputs, "tokens_per_rank", FileDType::kI64, {2}, negative)},
      {c, weights, with(inputs, "tokens_per_rank", FileDType::kI64, {0}, nullptr)},
      {c, weights, with(inputs, "tokens_per_rank", FileDType::kI32, {2}, ints)},
      {c, weights, with(inputs, "topk_idx", FileDType::kI32, {5, 2}, bad_expert.data())},
      {c, weights, with(inputs, "topk_idx", FileDType::kI32, {5, 2}, twice.data())},
      {c, weights, with(inputs, "topk_idx", FileDType::kI32, {2, 5}, bad_expert.data())},
      {c, weights, with(inputs, "topk_idx", FileDType::kF32, {5, 2}, bad_expert.data())},
  };
  const TempDir dir(seed);
  for (const auto& k : cases) {
    const std::string whole = error_from([&] { read_layer_inputs(k.config, k.weights, k.inputs); });
    INFO(whole);
    CHECK(whole != "(no error)");
    CHECK(error_from([&] { check_layer_files(k.config, k.weights, k.inputs); }) == whole);
    CHECK(error_from([&] { read_layer_inputs_without_experts(k.config, k.weights, k.inputs); }) ==
          whole);
    // From the files on disk, headers first: the same message, naming the path.
    k.weights.write(dir.path / "weights.safetensors");
    k.inputs.write(dir.path / "inputs.safetensors");
    const TensorFileReader w(dir.path / "weights.safetensors");
    const TensorFileReader in(dir.path / "inputs.safetensors");
    const std::string from_headers = error_from([&] { check_layer_files(k.config, w, in); });
    const bool about_weights = from_headers.rfind(w.source(), 0) == 0;
    CHECK(without_source(from_headers, about_weights ? w.source() : in.source()) ==
          without_source(whole, "<memory>"));
  }
  // The good files pass, and the check keeps what the plan of each rank needs.
  const std::vector<int> given = {0, 1, 2, 3, 3, 0, 1, 2, 2, 1};
  const std::int64_t split[3] = {2, 0, 3};
  const TensorFile planned =
      with(layer_inputs_file(l.x, l.dy, given, 2), "tokens_per_rank", FileDType::kI64, {3}, split);
  const CheckedLayerFiles checked = check_layer_files(c, weights, planned);
  CHECK(checked.tokens == 5);
  CHECK(checked.replay_experts == given);
  CHECK(checked.split(3) == std::vector<std::int64_t>{2, 0, 3});
  CHECK_THAT(error_from([&] { checked.split(2); }),
             test::contains_text(planned.source() +
                                 ": tensor 'tokens_per_rank' has 3 entries for 2 ranks"));
  CHECK(check_layer_files(c, weights, inputs).split(3) == std::vector<std::int64_t>{2, 2, 1});
}

TEST_CASE("rank inputs: each rank reads its experts and tokens, converted as the GPU takes them",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const TempDir dir(seed);
  struct Mesh {
    int ep, dp;
  };
  for (const Mesh mesh : {Mesh{1, 1}, Mesh{2, 2}, Mesh{4, 1}, Mesh{2, 3}}) {
    for (const bool bf16_files : {false, true}) {
      MoEConfig c = test::small_config(6, 5, 4, 2);
      c.score_function = ScoreFunction::kSigmoid;
      c.expert_bias = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
      c.shared_ffn_hidden = std::uniform_int_distribution<int>(0, 3)(rng);
      c.shared_gate = c.shared_ffn_hidden > 0 && std::uniform_int_distribution<int>(0, 1)(rng);
      c.dtype = bf16_files ? DType::kFP32 : DType::kBF16;  // either conversion, both ways
      c.ep = mesh.ep;
      c.dp = mesh.dp;
      const int world = mesh.ep * mesh.dp;
      const std::int64_t T = std::uniform_int_distribution<std::int64_t>(0, 9)(rng);
      const Layer l = random_layer(c, T, rng);
      INFO("EP " << mesh.ep << " DP " << mesh.dp << " T " << T << " bf16 files " << bf16_files);
      std::vector<int> given;
      for (std::int64_t t = 0; t < T; ++t) given.insert(given.end(), {int(t % 4), int(3 - t % 4)});
      if (T % 4 == 2) given.clear();  // sometimes no replay
      TensorFile weights = layer_weights_file(c, l.params);
      TensorFile inputs =
          given.empty() ? layer_inputs_file(l.x, l.dy) : layer_inputs_file(l.x, l.dy, given, 2);
      if (bf16_files) weights = as_bf16(weights), inputs = as_bf16(inputs);
      weights.write(dir.path / "weights.safetensors");
      inputs.write(dir.path / "inputs.safetensors");
      const TensorFileReader w(dir.path / "weights.safetensors");
      const TensorFileReader in(dir.path / "inputs.safetensors");
      const CheckedLayerFiles checked = check_layer_files(c, w, in);
      const std::int64_t H = 6, F = 5, K = 2, E_loc = 4 / mesh.ep;
      std::int64_t next_token = 0;
      for (int rank = 0; rank < world; ++rank) {
        INFO("rank " << rank);
        const RankInputs r = read_rank_inputs(c, w, in, checked, rank, true);
        CHECK(r.first_token == next_token);
        next_token += r.tokens;
        const std::int64_t first_expert = rank % mesh.ep * E_loc;
        CHECK(r.gate_weight == converted(weights.get("gate_weight"), 0, 4 * H, c.dtype));
        CHECK(r.w13 ==
              converted(weights.get("w13"), first_expert * 2 * F * H, E_loc * 2 * F * H, c.dtype));
        CHECK(r.w2 == converted(weights.get("w2"), first_expert * H * F, E_loc * H * F, c.dtype));
        CHECK(r.x == converted(inputs.get("x"), r.first_token * H, r.tokens * H, c.dtype));
        CHECK(r.dy == converted(inputs.get("dy"), r.first_token * H, r.tokens * H, c.dtype));
        std::vector<float> bias(4, 0.0f);
        if (c.expert_bias) {
          const auto values = file_values(weights.get("expert_bias"));
          bias.assign(values.begin(), values.end());
        }
        CHECK(r.expert_bias == bias);
        const std::int64_t Fs = c.shared_ffn_hidden;
        CHECK(r.shared_w13 == (Fs > 0 ? converted(weights.get("shared_w13"), 0, 2 * Fs * H, c.dtype)
                                      : std::vector<std::byte>()));
        CHECK(r.shared_w2 == (Fs > 0 ? converted(weights.get("shared_w2"), 0, Fs * H, c.dtype)
                                     : std::vector<std::byte>()));
        CHECK(r.shared_gate_weight ==
              (c.shared_gate ? converted(weights.get("shared_gate_weight"), 0, H, c.dtype)
                             : std::vector<std::byte>()));
        const std::vector<std::int32_t> rows_given =
            given.empty()
                ? std::vector<std::int32_t>()
                : std::vector<std::int32_t>(given.begin() + r.first_token * K,
                                            given.begin() + (r.first_token + r.tokens) * K);
        CHECK(r.topk_idx == rows_given);
      }
      CHECK(next_token == T);  // the ranks' tokens tile the batch
    }
  }
}

TEST_CASE("rank inputs: a NaN or Inf is the error of the rank that reads it, named in the tensor",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const TempDir dir(seed);
  MoEConfig c = test::small_config(6, 5, 4, 2);
  c.ep = 2;
  c.dp = 2;
  const Layer l = random_layer(c, 8, rng);  // 2 tokens a rank
  for (const std::string name : {"w13", "w2", "x", "dy", "gate_weight"}) {
    const bool input = name == "x" || name == "dy";
    TensorFile weights = layer_weights_file(c, l.params), inputs = layer_inputs_file(l.x, l.dy);
    TensorFile& file = input ? inputs : weights;
    FileTensor& t = file.get(name);
    const std::int64_t n = t.numel();
    const auto at = std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng);
    const float inf = -std::numeric_limits<float>::infinity();
    std::memcpy(t.data.data() + at * 4, &inf, 4);
    weights.write(dir.path / "weights.safetensors");
    inputs.write(dir.path / "inputs.safetensors");
    const TensorFileReader w(dir.path / "weights.safetensors");
    const TensorFileReader in(dir.path / "inputs.safetensors");
    const CheckedLayerFiles checked = check_layer_files(c, w, in);
    // Which ranks read element `at`: a rank's part is 2 rows, 2 experts of w13 or w2 (E_loc) or 2
    // tokens of x or dy (8 tokens over 4 ranks).
    const std::int64_t row = n / t.shape[0], rows_per_part = 2;
    INFO("tensor " << name << " element " << at);
    std::string index;
    std::int64_t rest = at;
    for (std::size_t d = t.shape.size(); d-- > 0;) {
      index = std::to_string(rest % t.shape[d]) + (index.empty() ? "" : ", " + index);
      rest /= t.shape[d];
    }
    int failed = 0;
    for (int rank = 0; rank < 4; ++rank) {
      const std::string error =
          error_from([&] { read_rank_inputs(c, w, in, checked, rank, true); });
      const int part = name == "gate_weight" ? -1 : input ? rank : rank % 2;
      const bool reads = part < 0 || at / (row * rows_per_part) == part;
      INFO("rank " << rank << ": " << error);
      CHECK((error != "(no error)") == reads);
      if (!reads) continue;
      ++failed;
      const std::string among =
          part < 0 ? "of its " + std::to_string(n) + " elements"
                   : "of its elements [" + std::to_string(part * row * rows_per_part) + ", " +
                         std::to_string((part + 1) * row * rows_per_part) + ") read here";
      CHECK_THAT(error, test::contains_text((input ? in.source() : w.source()) + ": tensor '" +
                                            name + "' holds -inf at [" + index + "] (1 " + among +
                                            " are NaN or Inf)"));
      CHECK_NOTHROW(read_rank_inputs(c, w, in, checked, rank, false));
    }
    // The experts' slices are read by both DP replicas, the gate by every rank, a token by one.
    CHECK(failed == (name == "gate_weight" ? 4 : input ? 1 : 2));
  }
}

// The GPU layer uploads F32 file values in its own dtype; the reference reads them the same way,
// so that moe_run --reference and the GPUs compute with the same numbers.
TEST_CASE("a bf16 layer reads F32 files rounded to bf16, the expert bias kept in fp32",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const TempDir dir(seed);
  MoEConfig c = test::small_config(6, 4, 4, 2);
  c.score_function = ScoreFunction::kSigmoid;
  c.expert_bias = true;
  c.shared_ffn_hidden = 3;
  c.shared_gate = true;
  c.dtype = DType::kBF16;
  c.validate();
  const std::int64_t T = 5;
  // fp32 values, most of them not bf16 values.
  const reference::Params params = test::round_params(test::random_params(c, rng), DType::kFP32);
  const reference::Matrix x = test::round_to(test::random_matrix(T, c.hidden, rng), DType::kFP32);
  const reference::Matrix dy = test::round_to(test::random_matrix(T, c.hidden, rng), DType::kFP32);
  layer_weights_file(c, params).write(dir.path / "weights.safetensors");
  const TensorFileReader weights(dir.path / "weights.safetensors");
  const LayerInputs in = read_layer_inputs(c, weights, layer_inputs_file(x, dy));
  const reference::Params held = test::round_params(params, DType::kBF16);
  CHECK(in.x.data == test::round_to(x, DType::kBF16).data);
  CHECK(in.dy.data == test::round_to(dy, DType::kBF16).data);
  CHECK(in.x.data != x.data);
  CHECK(in.params.gate_weight.data == held.gate_weight.data);
  for (int e = 0; e < c.num_experts; ++e) {
    CHECK(in.params.experts.w13[e].data == held.experts.w13[e].data);
    CHECK(in.params.experts.w2[e].data == held.experts.w2[e].data);
    const reference::ExpertWeights streamed = FileExperts(c, weights).load(e);
    CHECK(streamed.w13[0].data == held.experts.w13[e].data);
    CHECK(streamed.w2[0].data == held.experts.w2[e].data);
  }
  CHECK(in.params.shared.w13.data == held.shared.w13.data);
  CHECK(in.params.shared.w2.data == held.shared.w2.data);
  CHECK(in.params.shared.gate_weight.data == held.shared.gate_weight.data);
  CHECK(in.params.expert_bias == params.expert_bias);  // fp32 on the GPU too
}

TEST_CASE("streamed reference: experts read from the weights file, gradients written as they come",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const TempDir dir(seed);
  const auto config = [](auto&& change) {
    MoEConfig c = test::small_config(6, 4, 8, 2);
    change(c);
    return c;
  };
  struct Case {
    const char* what;
    MoEConfig config;
    std::int64_t tokens;
    bool replay = false;
    reference::Intermediates intermediates = reference::Intermediates::kExact;
    reference::ProbabilityGradient dprob = reference::ProbabilityGradient::kCombine;
  };
  const std::vector<Case> cases = {
      {"dropless", config([](MoEConfig&) {}), 9},
      {"sigmoid, bias, groups, losses, align", config([](MoEConfig& c) {
         c.score_function = ScoreFunction::kSigmoid;
         c.expert_bias = true;
         c.num_groups = 4;
         c.group_topk = 2;
         c.aux_loss_coeff = 0.1;
         c.z_loss_coeff = 0.01;
         c.align_size = 4;
       }),
       9},
      {"capacity, position policy, padded blocks", config([](MoEConfig& c) {
         c.capacity_factor = 0.5;
         c.drop_policy = DropPolicy::kPosition;
         c.pad_to_capacity = true;
         c.align_size = 2;
       }),
       10},
      {"capacity, probs policy", config([](MoEConfig& c) { c.capacity_factor = 0.6; }), 10},
      {"shared experts with gate", config([](MoEConfig& c) {
         c.shared_ffn_hidden = 3;
         c.shared_gate = true;
         c.aux_loss_coeff = 0.1;
       }),
       7},
      {"replay", config([](MoEConfig&) {}), 8, true},
      {"experts without rows", config([](MoEConfig& c) { c.num_experts = 16; }), 2},
      {"as stored, dp in the experts, bf16", config([](MoEConfig& c) { c.dtype = DType::kBF16; }),
       6, false, reference::Intermediates::kAsStored, reference::ProbabilityGradient::kExperts},
  };
  for (const auto& k : cases) {
    INFO(k.what);
    Layer l = random_layer(k.config, k.tokens, rng);
    l.options.intermediates = k.intermediates;
    l.options.dprob_from = k.dprob;
    const MoEConfig& c = l.config;
    if (k.replay) {
      for (std::int64_t t = 0; t < k.tokens; ++t)
        l.replay.insert(l.replay.end(), {int(t % 8), int((t + 5) % 8)});
      l.options.replay_experts = l.replay;
    }
    layer_weights_file(c, l.params).write(dir.path / "weights.safetensors");
    const TensorFileReader weights(dir.path / "weights.safetensors");
    const TensorFile inputs = layer_inputs_file(l.x, l.dy);
    const LayerInputs in = read_layer_inputs_without_experts(c, weights, inputs);
    CHECK(in.params.experts.w13.empty());

    const auto out = dir.path / "streamed.safetensors";
    {
      TensorFileWriter writer(out, layer_results_specs(c, k.tokens), layer_results_metadata(c));
      const FileExperts experts(c, weights);
      FileExpertGrads grads(c, writer);
      const auto result =
          reference::run_layer(c, in.params, experts, in.x, in.dy, grads, l.options);
      CHECK(result.expert_grads.dw13.empty());
      write_layer_results(writer, c, result);
      writer.finish();
    }
    const TensorFile expected =
        layer_results_file(c, reference::run_layer(c, l.params, l.x, l.dy, l.options));
    CHECK(file_bytes(out) == expected.serialize());  // the same file, byte for byte
    std::vector<std::string> declared;
    for (const auto& spec : layer_results_specs(c, k.tokens)) {
      declared.push_back(spec.name);
      CHECK(expected.get(spec.name).shape == spec.shape);
      CHECK(expected.get(spec.name).dtype == spec.dtype);
    }
    std::sort(declared.begin(), declared.end());
    CHECK(declared == expected.names());
  }
}

TEST_CASE("streamed reference: one expert at a time, each read once a pass, none without rows",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::small_config(6, 4, 16, 2);
  const Layer l = random_layer(c, 3, rng);  // at most 6 of the 16 experts get rows

  // Counts the loads and checks that no two experts' weights are alive at once.
  struct Counting final : reference::ExpertSource {
    const reference::ExpertsInMemory& inner;
    mutable std::vector<int> loads;
    explicit Counting(const reference::ExpertsInMemory& experts)
        : inner(experts), loads(static_cast<std::size_t>(experts.num_experts()), 0) {}
    int num_experts() const override { return inner.num_experts(); }
    reference::ExpertWeights load(int expert) const override {
      ++loads[static_cast<std::size_t>(expert)];
      return inner.load(expert);
    }
  };
  const reference::ExpertsInMemory memory(l.params.experts);
  const Counting experts(memory);
  reference::ExpertGradsInMemory grads;
  const auto result = reference::run_layer(c, l.params, experts, l.x, l.dy, grads);
  const auto whole = reference::run_layer(c, l.params, l.x, l.dy);
  for (int e = 0; e < 16; ++e) {
    INFO("expert " << e);
    const bool has_rows = whole.tokens_per_expert[e] > 0;
    CHECK(experts.loads[e] == (has_rows ? 2 : 0));  // forward and backward, or never
    CHECK(grads.dw13[e].data == whole.expert_grads.dw13[e].data);
    CHECK(grads.dw2[e].data == whole.expert_grads.dw2[e].data);
  }
  CHECK(result.dx.data == whole.dx.data);
  // A sink gets the experts in order; a source of the wrong shape is named.
  reference::ExpertGradsInMemory sink;
  CHECK_THROWS_WITH(sink.take(1, Matrix(6, 8), Matrix(4, 6)),
                    test::contains_text("gradients of expert 1 after 0 experts"));
  const int used = whole.routing.expert_of(0, 0);  // an expert with rows: it is loaded
  reference::ExpertWeights wrong = l.params.experts;
  wrong.w2[used] = Matrix(3, 6);
  reference::ExpertGradsInMemory unused;
  CHECK_THROWS_WITH(
      reference::run_layer(c, l.params, reference::ExpertsInMemory(wrong), l.x, l.dy, unused),
      test::contains_text("expert " + std::to_string(used) +
                          " was loaded as 1 w13 and 1 w2 matrices of [6,8] and "
                          "[3,6]; expected one [6,8] and one [4,6]"));
}
