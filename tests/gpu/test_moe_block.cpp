// MoEBlock on one GPU against the fp64 reference of the whole layer: output, losses, dx and every
// weight gradient, over router modes, losses, alignments and dtypes; hard routing; repeat steps;
// routing replay; bad use.
#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <thread>
#include <utility>

#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/catch.h"

using namespace moe;
using reference::Matrix;
using test::check_against_reference;
using test::finish_block;
using test::Pending;
using test::Results;
using test::run_block;
using test::start_block;

namespace {

MoEConfig base_config(DType dtype) {
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.dtype = dtype;
  // Under the sanitizers (the quick size) the heuristic's algorithms: every timing trial would be
  // instrumented too.
  c.gemm_autotune = test::run_size() != test::RunSize::kQuick;
  return c;
}

void run_case(MoEConfig c, std::int64_t tokens, std::mt19937_64& rng) {
  c.validate();
  INFO(c.describe() << " T=" << tokens);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  Matrix x;
  test::draw_separated(c, params, x, tokens, rng);
  const Matrix dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  const auto got = run_block(block, c, x, dy);
  check_against_reference(
      c, got, reference::run_layer(c, params, x, dy, test::kAsStored, test::kDprobInExperts));
}

}  // namespace

TEST_CASE("MoEBlock on one GPU equals the fp64 reference", "[gpu][block]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const int align : {0, 16, 128}) {
      for (const bool losses : {false, true}) {
        MoEConfig post = base_config(dtype);
        post.align_size = align;
        post.aux_loss_coeff = losses ? 0.05 : 0.0;
        post.z_loss_coeff = losses ? 0.01 : 0.0;
        run_case(post, 45, rng);

        MoEConfig pre = post;
        pre.pre_softmax = true;
        pre.topk = 3;
        run_case(pre, 33, rng);

        run_case(test::deepseek_like(post), 40, rng);
      }
    }
  }
  // bf16 weight gradients (fp32 accumulation, rounded once): within bf16 tolerance.
  MoEConfig half_grads = base_config(DType::kBF16);
  half_grads.grad_dtype = DType::kBF16;
  half_grads.align_size = 16;
  run_case(half_grads, 45, rng);
  // X kept for the backward, in its own buffer beside Y and dY (the default shares one).
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    MoEConfig kept = base_config(dtype);
    kept.keep_expert_input = true;
    kept.align_size = 16;
    kept.aux_loss_coeff = 0.05;
    run_case(kept, 45, rng);
  }
  // The SwiGLU output in chunks of 1 KiB (5 fp32 or 10 bf16 rows of F = 48, 64 rows of F = 8):
  // experts cut into pieces, several experts to a chunk, one row buffer and X kept.
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const bool keep : {false, true}) {
      MoEConfig chunked = base_config(dtype);
      chunked.activation_chunk_mib = 1.0 / 1024;
      chunked.align_size = keep ? 0 : 16;
      chunked.keep_expert_input = keep;
      chunked.grad_dtype = keep ? DType::kFP32 : dtype;
      run_case(chunked, 45, rng);
      chunked.ffn_hidden = 8;
      run_case(chunked, 45, rng);
    }
  }
}

TEST_CASE("MoEBlock with a shared expert, gated or not, equals the fp64 reference",
          "[gpu][block][shared]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const bool gated : {false, true}) {
      MoEConfig c = base_config(dtype);
      c.shared_ffn_hidden = 40;
      c.shared_gate = gated;
      c.align_size = 16;
      c.aux_loss_coeff = 0.05;
      run_case(c, 45, rng);
      run_case(c, 1, rng);
      run_case(c, 0, rng);
      // Chunks of the SwiGLU output smaller than the tokens, in the shared FFN too.
      c.activation_chunk_mib = 1.0 / 1024;
      run_case(c, 45, rng);
      // deepseek-v3's shape of it, scaled down: sigmoid + groups, a wide shared expert.
      MoEConfig ds = test::deepseek_like(c);
      ds.shared_ffn_hidden = 96;
      run_case(ds, 37, rng);
    }
  }
}

TEST_CASE("the shared expert in series gives the overlapped step's results bit for bit",
          "[gpu][block][shared]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const bool gated : {false, true}) {
    MoEConfig c = base_config(DType::kBF16);
    c.shared_ffn_hidden = 40;
    c.shared_gate = gated;
    c.aux_loss_coeff = 0.05;
    c.gemm_autotune = false;  // two blocks timing on their own may pick different algorithms
    MoEConfig series = c;
    series.shared_expert_overlap = false;
    INFO(series.describe());
    const auto params = test::round_params(test::random_params(c, rng), c.dtype);
    Matrix x;
    test::draw_separated(c, params, x, 45, rng);
    const Matrix dy = test::round_to(test::random_matrix(45, c.hidden, rng), c.dtype);
    Stream stream;
    const Mesh mesh = Mesh::single();
    MoEBlock overlapped_block(c, mesh, stream.get());
    MoEBlock series_block(series, mesh, stream.get());
    test::load_params(overlapped_block, params, 0, c.num_experts);
    test::load_params(series_block, params, 0, c.num_experts);
    const Results overlapped = run_block(overlapped_block, c, x, dy);
    const Results in_series = run_block(series_block, series, x, dy);
    check_identical(in_series, overlapped);
  }
}

TEST_CASE("MoEBlock edge cases: T = 1, K = E, zero tokens, hard routing", "[gpu][block]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kFP32);
  c.aux_loss_coeff = 0.1;
  c.z_loss_coeff = 0.01;
  c.align_size = 16;
  run_case(c, 1, rng);
  MoEConfig all = c;
  all.topk = 8;  // K = E
  run_case(all, 9, rng);
  run_case(c, 0, rng);

  // Every token to experts 0 and 1: the other experts get no rows and zero gradients.
  MoEConfig hard = c;
  hard.score_function = ScoreFunction::kSigmoid;
  hard.expert_bias = true;
  hard.validate();
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(hard, mesh, stream.get());
  auto params = test::round_params(test::random_params(hard, rng), hard.dtype);
  params.expert_bias = {20, 20, 0, 0, 0, 0, 0, 0};
  Matrix x;
  test::draw_separated(hard, params, x, 50, rng);
  const Matrix dy = test::random_matrix(50, hard.hidden, rng);
  test::load_params(block, params, 0, 8);
  const auto got = run_block(block, hard, x, dy);
  const auto want =
      reference::run_layer(hard, params, x, dy, test::kAsStored, test::kDprobInExperts);
  for (int e = 0; e < 8; ++e) CHECK(want.tokens_per_expert[e] == (e < 2 ? 50 : 0));
  check_against_reference(hard, got, want);
  for (int e = 2; e < 8; ++e) {
    for (const double v : got.dw13[e].data) REQUIRE(v == 0.0);
  }
}

// The block's stream is held up by 300 ms of earlier work when the block is built, so that its
// initialisation stays queued while the test writes the weights with cudaMemcpy, which nothing
// orders against that stream. The constructor must have waited for its own writes: else they
// land after the test's and replace its weights.
TEST_CASE("weights written right after construction are the ones used", "[gpu][block]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kFP32);
  c.aux_loss_coeff = 0.05;
  c.validate();
  Stream stream;
  const auto hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); };
  MOE_CHECK_CUDA(cudaLaunchHostFunc(stream.get(), hold, nullptr));
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  auto params = test::random_params(c, rng);
  test::load_params(block, params, 0, c.num_experts);  // at once: no host work in between
  Matrix x;
  test::draw_separated(c, params, x, 40, rng);
  const Matrix dy = test::random_matrix(40, c.hidden, rng);
  check_against_reference(
      c, run_block(block, c, x, dy),
      reference::run_layer(c, params, x, dy, test::kAsStored, test::kDprobInExperts));
}

TEST_CASE("two steps in a row equal two fresh runs", "[gpu][block]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kBF16);
  c.aux_loss_coeff = 0.05;
  c.align_size = 16;
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  Matrix big, small;
  test::draw_separated(c, params, big, 60, rng);
  test::draw_separated(c, params, small, 20, rng);
  test::load_params(block, params, 0, c.num_experts);
  const Matrix dy_big = test::random_matrix(60, c.hidden, rng),
               dy_small = test::random_matrix(20, c.hidden, rng);
  const auto first_big = run_block(block, c, big, dy_big);
  const auto then_small = run_block(block, c, small, dy_small);  // smaller batch after a larger one
  const auto again_big = run_block(block, c, big, dy_big);
  CHECK(again_big.out.data == first_big.out.data);
  CHECK(again_big.dx.data == first_big.dx.data);
  CHECK(again_big.dgate.data == first_big.dgate.data);
  CHECK(again_big.dw13[3].data == first_big.dw13[3].data);
  check_against_reference(
      c, then_small,
      reference::run_layer(c, params, small, dy_small, test::kAsStored, test::kDprobInExperts));
}

TEST_CASE("layers sharing a scratch, run as a model runs them, each equal the reference",
          "[gpu][block]") {
  // Forward of layer 1, of layer 2 (a larger batch, so the scratch grows while layer 1's context
  // waits), backward of layer 2, then of layer 1: each layer's context must survive the others'
  // calls; only what lives inside one call is shared.
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const bool keep : {false, true}) {
    INFO("keep_expert_input " << keep);
    MoEConfig first = base_config(DType::kBF16);
    first.align_size = 16;
    first.aux_loss_coeff = 0.05;
    first.z_loss_coeff = 0.01;
    first.keep_expert_input = keep;
    MoEConfig second = first;  // another shape, as a model's layers may have
    second.num_experts = 16;
    second.topk = 4;
    second.ffn_hidden = 80;
    second.score_function = ScoreFunction::kSigmoid;
    second.expert_bias = true;
    second.validate();
    Stream stream;
    const Mesh mesh = Mesh::single();
    auto scratch = std::make_shared<MoEScratch>();
    MoEBlock layer1(first, mesh, stream.get(), scratch),
        layer2(second, mesh, stream.get(), scratch);
    auto params1 = test::round_params(test::random_params(first, rng), first.dtype);
    auto params2 = test::round_params(test::random_params(second, rng), second.dtype);
    Matrix x1, x2;
    test::draw_separated(first, params1, x1, 30, rng);
    test::draw_separated(second, params2, x2, 70, rng);
    test::load_params(layer1, params1, 0, first.num_experts);
    test::load_params(layer2, params2, 0, second.num_experts);
    const Matrix dy1 = test::round_to(test::random_matrix(30, first.hidden, rng), first.dtype);
    const Matrix dy2 = test::round_to(test::random_matrix(70, second.hidden, rng), second.dtype);

    Pending pending1 = start_block(layer1, first, x1);
    const std::size_t after_first = scratch->bytes();
    Pending pending2 = start_block(layer2, second, x2);
    CHECK(scratch->bytes() > after_first);  // grown for the larger layer, held once
    const Results got2 = finish_block(layer2, second, std::move(pending2), dy2);
    const Results got1 = finish_block(layer1, first, std::move(pending1), dy1);
    check_against_reference(
        second, got2,
        reference::run_layer(second, params2, x2, dy2, test::kAsStored, test::kDprobInExperts));
    check_against_reference(
        first, got1,
        reference::run_layer(first, params1, x1, dy1, test::kAsStored, test::kDprobInExperts));
  }

  // Blocks that share a scratch must share the stream that orders their calls.
  Stream one, other;
  auto scratch = std::make_shared<MoEScratch>();
  const MoEConfig c = base_config(DType::kBF16);
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, one.get(), scratch);
  CHECK_THROWS_WITH(MoEBlock(c, mesh, other.get(), scratch),
                    test::contains_text("must run in order on one stream"));
}

TEST_CASE("MoEBlock bad use gets clear errors and leaves the block usable", "[gpu][block]") {
  MoEConfig c = base_config(DType::kBF16);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  DeviceBuffer x(10 * 64 * 2), dy(10 * 64 * 2);
  MOE_CHECK_CUDA(cudaMemset(x.data(), 0, x.bytes()));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());  // the fill is on the legacy stream
  const Tensor good(x.data(), DType::kBF16, {10, 64});
  CHECK_THROWS_WITH(block.backward(Tensor(dy.data(), DType::kBF16, {10, 64})),
                    test::contains_text("no forward context"));
  CHECK_THROWS_WITH(block.forward(Tensor(x.data(), DType::kFP32, {10, 64})),
                    test::contains_text("x must be bf16[T, 64], got fp32[10, 64]"));
  CHECK_THROWS_WITH(block.forward(Tensor(x.data(), DType::kBF16, {10, 32})),
                    test::contains_text("got bf16[10, 32]"));
  // Rows that start off a 16-byte boundary: the GEMMs and the row kernels would refuse them.
  CHECK_THROWS_WITH(block.forward(Tensor(x.as<char>() + 8, DType::kBF16, {10, 64})),
                    test::contains_text("MoEBlock::forward x: data = 0x"));
  CHECK_THROWS_WITH(block.forward(Tensor(x.as<char>() + 8, DType::kBF16, {10, 64})),
                    test::contains_text("must be 16-byte aligned"));
  block.forward(good);
  CHECK_THROWS_WITH(block.backward(Tensor(dy.as<char>() + 2, DType::kBF16, {10, 64})),
                    test::contains_text("MoEBlock::backward dy: data = 0x"));
  CHECK_THROWS_WITH(block.backward(Tensor(dy.data(), DType::kBF16, {9, 64})),
                    test::contains_text("expected bf16[10, 64], got bf16[9, 64]"));
  MOE_CHECK_CUDA(cudaMemset(dy.data(), 0, dy.bytes()));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());  // the fill is on the legacy stream
  CHECK_NOTHROW(block.backward(Tensor(dy.data(), DType::kBF16, {10, 64})));
  CHECK_THROWS_WITH(block.backward(Tensor(dy.data(), DType::kBF16, {10, 64})),
                    test::contains_text("no forward context"));
  block.infer(good);
  CHECK_THROWS_WITH(block.backward(Tensor(dy.data(), DType::kBF16, {10, 64})),
                    test::contains_text("no forward context"));
  MoEParameters wrong = block.parameters();
  wrong.w2 = Tensor(wrong.w2.data, DType::kBF16, {8, 48, 64});
  CHECK_THROWS_WITH(block.bind(wrong, block.gradients()),
                    test::contains_text("w2: expected bf16[8, 64, 48], got bf16[8, 48, 64]"));
  MoEGradients shifted = block.gradients();
  shifted.w13 =
      Tensor(static_cast<char*>(shifted.w13.data) + 4, shifted.w13.dtype, shifted.w13.shape);
  CHECK_THROWS_WITH(block.bind(block.parameters(), shifted),
                    test::contains_text("gradient of w13: data = 0x"));
  CHECK_THROWS_WITH(block.update_expert_bias(0.1f), test::contains_text("expert_bias = false"));
  MoEConfig mismatched = c;
  mismatched.ep = 2;
  CHECK_THROWS_WITH(MoEBlock(mismatched, mesh, stream.get()),
                    test::contains_text("config has ep = 2, dp = 1 but the mesh is 1 x 1"));
}

TEST_CASE("check mode names the stage that produced a NaN", "[gpu][block]") {
  MoEConfig c = base_config(DType::kFP32);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  block.set_check_finite(true);
  std::vector<float> values(4 * 64, 0.5f);
  values[70] = std::nanf("");
  const auto x = test::upload(values);
  CHECK_THROWS_WITH(block.forward(Tensor(x.data(), DType::kFP32, {4, 64})),
                    test::contains_text("stage 'gate'"));
}

namespace {

bool bitwise_equal(const Matrix& a, const Matrix& b) {
  return a.rows == b.rows && a.cols == b.cols && a.data == b.data;
}

}  // namespace

TEST_CASE("routing replay: a recorded step replays bitwise; other routings equal the reference",
          "[gpu][block][replay]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig post = base_config(DType::kBF16);
  post.aux_loss_coeff = 0.05;
  post.z_loss_coeff = 0.01;
  post.align_size = 16;
  MoEConfig pre = post;
  pre.pre_softmax = true;
  const MoEConfig grouped = test::deepseek_like(post);
  MoEConfig softplus = post;
  softplus.score_function = ScoreFunction::kSqrtSoftplus;
  softplus.topk = 3;
  for (MoEConfig c : {post, pre, grouped, softplus}) {
    for (const DType dtype : {DType::kFP32, DType::kBF16}) {
      c.dtype = dtype;
      c.validate();
      INFO(c.describe());
      const std::int64_t T = 57;
      const int K = c.topk;
      Stream stream;
      const Mesh mesh = Mesh::single();
      MoEBlock block(c, mesh, stream.get());
      auto params = test::round_params(test::random_params(c, rng), c.dtype);
      test::load_params(block, params, 0, c.num_experts);
      Matrix x;
      test::draw_separated(c, params, x, T, rng);
      const Matrix dy = test::round_to(test::random_matrix(T, c.hidden, rng), c.dtype);

      // Record, then replay the recorded routing: every result bitwise the same.
      DeviceBuffer recorded(static_cast<std::size_t>(T * K) * 4);
      test::poison(recorded);
      const Tensor recorded_idx(recorded.data(), DType::kInt32, {T, K});
      Pending first = start_block(block, c, x);
      block.record_routing(recorded_idx);
      const Results want = finish_block(block, c, std::move(first), dy);
      const Results again =
          finish_block(block, c, start_block(block, c, x, ForwardOptions{recorded_idx}), dy);
      CHECK(bitwise_equal(again.out, want.out));
      CHECK(bitwise_equal(again.dx, want.dx));
      CHECK(bitwise_equal(again.dgate, want.dgate));
      for (int e = 0; e < c.num_experts; ++e) {
        CHECK(bitwise_equal(again.dw13[e], want.dw13[e]));
        CHECK(bitwise_equal(again.dw2[e], want.dw2[e]));
      }
      CHECK(again.aux == want.aux);
      CHECK(again.z == want.z);

      // A routing the router would not choose: K distinct experts per token at random.
      std::vector<int> given(static_cast<std::size_t>(T * K));
      std::vector<int> experts(c.num_experts);
      for (std::int64_t t = 0; t < T; ++t) {
        std::iota(experts.begin(), experts.end(), 0);
        std::shuffle(experts.begin(), experts.end(), rng);
        std::copy_n(experts.begin(), K, given.begin() + t * K);
      }
      const auto given_dev = test::upload(std::vector<std::int32_t>(given.begin(), given.end()));
      const Tensor given_idx(given_dev.data(), DType::kInt32, {T, K});
      const Results replayed =
          finish_block(block, c, start_block(block, c, x, ForwardOptions{given_idx}), dy);
      reference::LayerOptions options;
      options.replay_experts = std::span<const int>(given);
      options.intermediates = test::kAsStored;
      options.dprob_from = test::kDprobInExperts;
      options.rounding_magnitudes = true;
      const auto reference_run = reference::run_layer(c, params, x, dy, options);
      check_against_reference(c, replayed, reference_run);
      std::vector<std::int32_t> counts(c.num_experts);
      copy_to_host(counts.data(), block.routing().tokens_per_expert.data, counts.size() * 4);
      for (int e = 0; e < c.num_experts; ++e)
        CHECK(counts[e] == static_cast<std::int32_t>(reference_run.tokens_per_expert[e]));

      // An expert outside [0, E) in token 3, slot 1: a clear error after the dispatch.
      given[3 * K + 1] = c.num_experts;
      const auto bad_dev = test::upload(std::vector<std::int32_t>(given.begin(), given.end()));
      const auto bad_x = test::upload_as(x, c.dtype);
      CHECK_THROWS_WITH(
          block.forward(Tensor(bad_x.data(), c.dtype, {T, c.hidden}),
                        ForwardOptions{Tensor(bad_dev.data(), DType::kInt32, {T, K})}),
          test::contains_text("token 3, slot 1: expert " + std::to_string(c.num_experts)));
    }
  }
}

// docs/design.md, "Host synchronisations, counted": once warm, a step waits on the host once, in
// the forward's dispatch, and allocates nothing; the backward and the gradient reduction never
// wait. Static shapes (pad_to_capacity) with the losses left on the device never wait at all. The
// timing trials of gemm_autotune are off: they wait once per new GEMM size class.
TEST_CASE("a warm step waits on the host once, in the forward, and allocates nothing",
          "[gpu][block]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig dropless = base_config(DType::kBF16);
  dropless.gemm_autotune = false;
  dropless.aux_loss_coeff = 0.01;
  dropless.z_loss_coeff = 0.001;
  dropless.align_size = 16;
  MoEConfig capacity = dropless;
  capacity.capacity_factor = 1.0;
  MoEConfig padded = capacity;
  padded.pad_to_capacity = true;
  MoEConfig shared = dropless;
  shared.shared_ffn_hidden = 32;
  MoEConfig kept = dropless;
  kept.keep_expert_input = true;
  struct Variant {
    const char* name;
    MoEConfig config;
    bool losses_on_host;
    std::int64_t forward_waits;
  };
  const Variant variants[] = {{"dropless", dropless, false, 1},
                              {"capacity 1.0", capacity, false, 1},
                              {"capacity 1.0, padded, losses on the host", padded, true, 1},
                              {"capacity 1.0, padded, losses on the device", padded, false, 0},
                              {"shared expert", shared, true, 1},
                              {"keep_expert_input", kept, true, 1}};
  for (const auto& [name, c, losses_on_host, forward_waits] : variants) {
    INFO(name);
    c.validate();
    Stream stream;
    const Mesh mesh = Mesh::single();
    MoEBlock block(c, mesh, stream.get());
    test::load_params(block, test::round_params(test::random_params(c, rng), c.dtype), 0,
                      c.num_experts);
    const std::int64_t big = 48, small = 20;
    const auto x = test::upload_as(test::random_matrix(big, c.hidden, rng), c.dtype);
    const auto dy = test::upload_as(test::random_matrix(big, c.hidden, rng), c.dtype);
    // The warm-up: buffers grow, the first reduce_gradients agrees on the GEMM algorithms.
    (void)block.forward(Tensor(x.data(), c.dtype, {big, c.hidden}));
    (void)block.backward(Tensor(dy.data(), c.dtype, {big, c.hidden}));
    block.reduce_gradients();
    block.synchronize();
    for (const std::int64_t tokens : {big, small, big}) {
      INFO("T = " << tokens);
      const std::int64_t waits = mesh.host_waits();
      const std::int64_t allocations = buffer_allocations();
      ForwardOptions options;
      options.losses_on_host = losses_on_host;
      (void)block.forward(Tensor(x.data(), c.dtype, {tokens, c.hidden}), options);
      CHECK(mesh.host_waits() - waits == forward_waits);
      (void)block.backward(Tensor(dy.data(), c.dtype, {tokens, c.hidden}));
      block.reduce_gradients();
      CHECK(mesh.host_waits() - waits == forward_waits);
      block.synchronize();
      CHECK(mesh.host_waits() - waits == forward_waits + 1);  // synchronize() waits by definition
      CHECK(buffer_allocations() == allocations);
    }
  }
}
