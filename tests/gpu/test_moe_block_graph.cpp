// MoEBlock of static shapes (capacity_factor with pad_to_capacity, one GPU) in a CUDA graph: a
// captured forward + backward replays the eager step bitwise, follows new input written into the
// same buffers (and then equals the fp64 reference), and a step needs no host wait, FP8 experts
// included; capture is
// refused, naming why, where a step would wait or allocate.
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/capacity_check.h"
#include "support/catch.h"

using namespace moe;
using reference::Matrix;

namespace {

const ForwardOptions kOnDevice = test::losses_on_device();

MoEConfig static_config(DType dtype, double factor, DropPolicy policy, int align) {
  MoEConfig c = test::capacity_config(dtype, factor, policy, align);
  c.pad_to_capacity = true;
  c.validate();
  return c;
}

// Inputs drawn so that no routing or drop decision sits on a rounding boundary, and the
// reference's results for them.
struct Batch {
  Matrix x, dy;
  reference::LayerResult want;
};
Batch draw_batch(const MoEConfig& c, const reference::Params& params, std::int64_t tokens,
                 std::mt19937_64& rng) {
  Batch b;
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 50);
    test::draw_separated(c, params, b.x, tokens, rng);
    b.dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
    b.want = reference::run_layer(c, params, b.x, b.dy, test::kAsStored, test::kDprobInExperts);
    if (test::capacity_boundary_clear(c, tokens, b.want)) return b;
  }
}

// The eager step against the reference: FP8 experts within FP8's error of it (docs/design.md,
// "FP8"), anything else as every block test checks it.
void check_step(const MoEConfig& c, const test::Results& got, const reference::LayerResult& want) {
  if (!c.fp8) return test::check_against_reference(c, got, want);
  constexpr double kFp8Bound = 0.1;
  CHECK(test::relative_error(got.out, want.out) <= kFp8Bound);
  CHECK(test::relative_error(got.dx, want.dx) <= kFp8Bound);
  for (std::size_t e = 0; e < got.dw13.size(); ++e) {
    INFO("expert " << e);
    CHECK(test::relative_error(got.dw13[e], transpose(want.expert_grads.dw13[e])) <= kFp8Bound);
    CHECK(test::relative_error(got.dw2[e], transpose(want.expert_grads.dw2[e])) <= kFp8Bound);
  }
}

void run_graph_case(const MoEConfig& c, std::int64_t tokens, std::mt19937_64& rng) {
  INFO(c.describe() << " T=" << tokens);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  const Batch first = draw_batch(c, params, tokens, rng);
  const Batch second = draw_batch(c, params, tokens, rng);
  // The graph's inputs: fixed addresses, whose contents the trainer rewrites between replays.
  const auto x = test::upload_as(first.x, c.dtype);
  const auto dy = test::upload_as(first.dy, c.dtype);
  const Tensor x_view(x.data(), c.dtype, {tokens, c.hidden});
  const Tensor dy_view(dy.data(), c.dtype, {tokens, c.hidden});

  // A first eager step prepares the block (its buffers grow, its GEMM algorithms are timed). The
  // second is what the replay must equal, and it needs no host wait.
  (void)block.forward(x_view, kOnDevice);
  (void)block.backward(dy_view);
  const std::int64_t waits = mesh.host_waits();
  MoEForward eager_fwd = block.forward(x_view, kOnDevice);
  Tensor eager_dx = block.backward(dy_view);
  block.reduce_gradients();
  CHECK(mesh.host_waits() == waits);
  CHECK(std::isnan(eager_fwd.aux_loss));
  const test::Results eager = test::read_step(block, c, eager_fwd, eager_dx, tokens);
  check_step(c, eager, first.want);

  MoEForward captured_fwd;
  Tensor captured_dx;
  const std::int64_t allocations = buffer_allocations();
  CudaGraph step(stream.get(), [&] {
    captured_fwd = block.forward(x_view, kOnDevice);
    captured_dx = block.backward(dy_view);
    block.reduce_gradients();
  });
  CHECK(buffer_allocations() == allocations);
  CHECK(captured_fwd.out.data == eager_fwd.out.data);
  CHECK(captured_dx.data == eager_dx.data);

  // Replayed over poisoned outputs: the eager step, bitwise.
  test::poison_step(block, captured_fwd, captured_dx, stream.get());
  step.replay(stream.get());
  test::check_identical(test::read_step(block, c, captured_fwd, captured_dx, tokens), eager);

  // New input in the same buffers: the replay computes it, equal to the reference, and an eager
  // step on it equals the replay bitwise. Replays never wait on the host.
  copy_to_device(x.data(), test::upload_as(second.x, c.dtype).data(), x_view.bytes());
  copy_to_device(dy.data(), test::upload_as(second.dy, c.dtype).data(), dy_view.bytes());
  test::poison_step(block, captured_fwd, captured_dx, stream.get());
  const std::int64_t replay_waits = mesh.host_waits();
  step.replay(stream.get());
  step.replay(stream.get());  // twice: a replay leaves nothing the next one depends on
  CHECK(mesh.host_waits() == replay_waits);
  const test::Results replayed = test::read_step(block, c, captured_fwd, captured_dx, tokens);
  check_step(c, replayed, second.want);
  const MoEForward again_fwd = block.forward(x_view);  // losses on the host this time
  const Tensor again_dx = block.backward(dy_view);
  test::Results again = test::read_step(block, c, again_fwd, again_dx, tokens);
  CHECK(test::same_bits(again_fwd.aux_loss, again.aux));
  CHECK(test::same_bits(again_fwd.z_loss, again.z));
  test::check_identical(replayed, again);
}

}  // namespace

TEST_CASE("a static-shape step captured in a CUDA graph replays the eager step bitwise",
          "[gpu][block][graph]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    run_graph_case(static_config(dtype, 1.25, DropPolicy::kProbs, 16), 45, rng);
    run_graph_case(static_config(dtype, 0.5, DropPolicy::kPosition, 0), 37, rng);
    // A gated shared expert on its own stream, X kept, the SwiGLU output in chunks.
    MoEConfig wide = static_config(dtype, 1.0, DropPolicy::kProbs, 8);
    wide.shared_ffn_hidden = 40;
    wide.shared_gate = true;
    wide.keep_expert_input = true;
    wide.activation_chunk_mib = 1.0 / 1024;
    run_graph_case(wide, 45, rng);
    run_graph_case(test::deepseek_like(static_config(dtype, 1.25, DropPolicy::kProbs, 0)), 40, rng);
    // Tokens over several layout blocks (128 each) and K = 4 at factor 0.5: many dropped slots,
    // none with a row.
    MoEConfig many = static_config(dtype, 0.5, DropPolicy::kPosition, 16);
    many.topk = 4;
    many.validate();
    run_graph_case(many, 300, rng);
  }
  // FP8 experts: the weights quantized inside the graph, the grouped products where the GPU runs
  // them; then with the rows rounded through FP8 as fp8_dispatch sends them.
  MoEConfig fp8 = static_config(DType::kBF16, 1.25, DropPolicy::kProbs, 16);
  fp8.fp8 = true;
  fp8.validate();
  run_graph_case(fp8, 45, rng);
  fp8.fp8_dispatch = true;
  fp8.topk = 4;
  fp8.validate();
  run_graph_case(fp8, 300, rng);
  // Rows of whole 128-value blocks: the permute writes X's and dY's codes inside the graph.
  MoEConfig wide = static_config(DType::kBF16, 1.25, DropPolicy::kProbs, 16);
  wide.fp8 = true;
  wide.hidden = 128;
  wide.validate();
  run_graph_case(wide, 45, rng);
}

TEST_CASE("capture is refused, naming why, where a step would wait on the host or allocate",
          "[gpu][block][graph]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig padded = static_config(DType::kBF16, 1.25, DropPolicy::kProbs, 16);
  MoEConfig dropless = padded;
  dropless.capacity_factor = 0.0;
  dropless.pad_to_capacity = false;
  const std::int64_t tokens = 24;
  const auto x = test::upload_as(test::random_matrix(tokens, padded.hidden, rng), padded.dtype);
  const auto dy = test::upload_as(test::random_matrix(tokens, padded.hidden, rng), padded.dtype);
  const Tensor x_view(x.data(), padded.dtype, {tokens, padded.hidden});
  const Tensor dy_view(dy.data(), padded.dtype, {tokens, padded.hidden});
  const Tensor x_fewer(x.data(), padded.dtype, {tokens - 4, padded.hidden});
  Stream stream;
  const Mesh mesh = Mesh::single();
  const auto refused = [&](const std::function<void()>& work, const std::string& why) {
    INFO(why);
    CHECK_THROWS_WITH(CudaGraph(stream.get(), work),
                      test::contains_text("capturing a CUDA graph") && test::contains_text(why));
    CHECK_FALSE(stream_is_capturing(stream.get()));
  };

  MoEBlock plain(dropless, mesh, stream.get());
  refused([&] { plain.forward(x_view, kOnDevice); }, "capacity_factor and pad_to_capacity");

  MoEBlock block(padded, mesh, stream.get());
  refused([&] { block.forward(x_view, kOnDevice); }, "has not run one eagerly yet");
  (void)block.forward(x_view, kOnDevice);
  refused([&] { block.backward(dy_view); }, "has not run one eagerly yet");
  (void)block.backward(dy_view);
  refused([&] { block.forward(x_fewer, kOnDevice); }, "last ran one eagerly at T = 24");
  refused([&] { block.forward(x_view); }, "losses_on_host");
  ForwardOptions replayed = kOnDevice;
  replayed.replay_topk_idx = block.routing().topk_idx;
  refused([&] { block.forward(x_view, replayed); }, "replay_topk_idx");
  refused([&] { block.synchronize(); }, "after the graph's replay");
  block.set_check_finite(true);
  refused([&] { block.forward(x_view, kOnDevice); }, "check mode");
  block.set_check_finite(false);
  block.set_stage_timing(true);
  refused([&] { block.forward(x_view, kOnDevice); }, "stage timing");
  block.set_stage_timing(false);

  // After every refusal the block still runs, eagerly and captured, and the two agree.
  const MoEForward eager_fwd = block.forward(x_view, kOnDevice);
  const Tensor eager_dx = block.backward(dy_view);
  const test::Results eager = test::read_step(block, padded, eager_fwd, eager_dx, tokens);
  MoEForward fwd;
  Tensor dx;
  CudaGraph step(stream.get(), [&] {
    fwd = block.forward(x_view, kOnDevice);
    dx = block.backward(dy_view);
  });
  CHECK(step.nodes() > 0);
  test::poison_step(block, fwd, dx, stream.get());
  step.replay(stream.get());
  test::check_identical(test::read_step(block, padded, fwd, dx, tokens), eager);

  CHECK_THROWS_WITH(CudaGraph(stream.get(), {}), test::contains_text("empty work"));
}
