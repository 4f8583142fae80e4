// MoEBlock's split-phase calls on one GPU: the six phases give the whole calls' bits (and so the
// fp64 reference's results) with other work queued between them; two blocks interleave their
// phases over two micro-batches; a static-shape step's phases replay from a CUDA graph; calls out
// of turn, other calls mid-step, a second block on a held scratch and a capture of part of a step
// are refused, naming what is due, and the step goes on; a phase that fails leaves no step, a
// refused argument the step as it was, and a capture that ends between phases is dropped.
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>

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

// A step's inputs on the device.
struct Inputs {
  DeviceBuffer x_dev, dy_dev;
  Tensor x, dy;
  Inputs(const MoEConfig& c, const Matrix& x_host, const Matrix& dy_host)
      : x_dev(test::upload_as(x_host, c.dtype)),
        dy_dev(test::upload_as(dy_host, c.dtype)),
        x(x_dev.data(), c.dtype, {x_host.rows, c.hidden}),
        dy(dy_dev.data(), c.dtype, {dy_host.rows, c.hidden}) {}
};

test::Results read_results(const MoEBlock& block, const MoEConfig& c, const MoEForward& fwd,
                           const Tensor& dx, std::int64_t tokens) {
  test::Results r = test::read_step(block, c, fwd, dx, tokens);
  // The losses as the host learnt them where it waited (the device's copy otherwise).
  if (!std::isnan(fwd.aux_loss)) CHECK(test::same_bits(fwd.aux_loss, r.aux));
  return r;
}

void run_phases_case(MoEConfig c, std::int64_t tokens, std::mt19937_64& rng) {
  c.validate();
  INFO(c.describe() << " T=" << tokens);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  Matrix x;
  test::draw_separated(c, params, x, tokens, rng);
  const Matrix dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
  const Inputs in(c, x, dy);
  const ForwardOptions options;

  // Two whole steps (the first chooses the GEMM algorithms); the second is what the phases give.
  (void)block.forward(in.x, options);
  (void)block.backward(in.dy);
  MoEForward fwd = block.forward(in.x, options);
  Tensor dx = block.backward(in.dy);
  const test::Results whole = read_results(block, c, fwd, dx, tokens);
  if (!c.capacity_mode() && tokens > 0)
    test::check_against_reference(
        c, whole, reference::run_layer(c, params, x, dy, test::kAsStored, test::kDprobInExperts));

  const test::OtherWork other(stream.get());
  test::poison_step(block, fwd, dx, stream.get());
  const test::PhasedStep phased =
      test::run_phases(block, in.x, in.dy, options, [&] { other.queue(); });
  CHECK(phased.forward.out.data == fwd.out.data);
  test::check_identical(read_results(block, c, phased.forward, phased.dx, tokens), whole);
  // And the whole calls again after the phases.
  test::poison_step(block, fwd, dx, stream.get());
  fwd = block.forward(in.x, options);
  dx = block.backward(in.dy);
  test::check_identical(read_results(block, c, fwd, dx, tokens), whole);
}

MoEConfig base_config(DType dtype) {
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.dtype = dtype;
  c.aux_loss_coeff = 0.05;
  c.z_loss_coeff = 0.01;
  c.gemm_autotune = test::run_size() != test::RunSize::kQuick;
  return c;
}

}  // namespace

TEST_CASE("the split-phase calls give the whole calls' bits, with other work between them",
          "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    run_phases_case(base_config(dtype), 45, rng);
    run_phases_case(test::deepseek_like(base_config(dtype)), 37, rng);
    // A gated shared expert on its own stream across the phases; X kept.
    MoEConfig shared = base_config(dtype);
    shared.shared_ffn_hidden = 40;
    shared.shared_gate = true;
    shared.keep_expert_input = true;
    run_phases_case(shared, 29, rng);
    // Capacity mode with fixed blocks: no host wait anywhere in the step.
    MoEConfig padded = test::capacity_config(dtype, 1.25, DropPolicy::kProbs, 16);
    padded.pad_to_capacity = true;
    run_phases_case(padded, 40, rng);
  }
  run_phases_case(base_config(DType::kBF16), 0, rng);  // no tokens
}

TEST_CASE("two blocks interleave their phases over two micro-batches", "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kBF16);
  c.shared_ffn_hidden = 32;
  c.gemm_autotune = false;  // the two blocks then take the same algorithms
  c.validate();
  Stream stream;
  const Mesh mesh = Mesh::single();
  // The same layer for two micro-batches in flight: one set of weights, a block (and a scratch)
  // per micro-batch, each with its own gradients.
  MoEBlock first(c, mesh, stream.get());
  MoEBlock second(c, mesh, stream.get());
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  test::load_params(first, params, 0, c.num_experts);
  test::load_params(second, params, 0, c.num_experts);
  Matrix x0, x1;
  test::draw_separated(c, params, x0, 41, rng);
  test::draw_separated(c, params, x1, 23, rng);
  const Inputs in0(c, x0, test::round_to(test::random_matrix(41, c.hidden, rng), c.dtype));
  const Inputs in1(c, x1, test::round_to(test::random_matrix(23, c.hidden, rng), c.dtype));

  MoEForward f0 = first.forward(in0.x);
  Tensor dx0 = first.backward(in0.dy);
  const test::Results want0 = read_results(first, c, f0, dx0, 41);
  MoEForward f1 = second.forward(in1.x);
  Tensor dx1 = second.backward(in1.dy);
  const test::Results want1 = read_results(second, c, f1, dx1, 23);
  test::poison_step(first, f0, dx0, stream.get());
  test::poison_step(second, f1, dx1, stream.get());

  // Each micro-batch's phases between the other's, as a trainer overlapping them queues them.
  first.forward_dispatch(in0.x);
  second.forward_dispatch(in1.x);
  first.forward_experts();
  second.forward_experts();
  f0 = first.forward_combine();
  first.backward_combine(in0.dy);
  f1 = second.forward_combine();
  first.backward_experts();
  second.backward_combine(in1.dy);
  dx0 = first.backward_dispatch();
  second.backward_experts();
  dx1 = second.backward_dispatch();
  test::check_identical(read_results(first, c, f0, dx0, 41), want0);
  test::check_identical(read_results(second, c, f1, dx1, 23), want1);
}

TEST_CASE("a static-shape step's phases replay from a CUDA graph bitwise", "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::capacity_config(DType::kBF16, 1.25, DropPolicy::kProbs, 16);
  c.pad_to_capacity = true;
  c.shared_ffn_hidden = 24;
  c.validate();
  const std::int64_t tokens = 36;
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  const Inputs in(c, test::random_matrix(tokens, c.hidden, rng),
                  test::random_matrix(tokens, c.hidden, rng));
  const ForwardOptions on_device = test::losses_on_device();
  const test::OtherWork other(stream.get());
  const auto between = [&] { other.queue(); };

  (void)test::run_phases(block, in.x, in.dy, on_device, between);  // prepares
  block.reduce_gradients();
  const test::PhasedStep eager = test::run_phases(block, in.x, in.dy, on_device, between);
  const test::Results want = read_results(block, c, eager.forward, eager.dx, tokens);

  test::PhasedStep captured;
  const CudaGraph graph(
      stream.get(), [&] { captured = test::run_phases(block, in.x, in.dy, on_device, between); });
  test::poison_step(block, captured.forward, captured.dx, stream.get());
  graph.replay(stream.get());
  test::check_identical(read_results(block, c, captured.forward, captured.dx, tokens), want);

  // Part of a step in a capture is refused: the forward's phases are captured all or none.
  block.forward_dispatch(in.x, on_device);
  CHECK_THROWS_WITH(
      CudaGraph(stream.get(), [&] { block.forward_experts(); }),
      test::contains_text("captured all or none") && test::contains_text("queued eagerly"));
  CHECK_FALSE(stream_is_capturing(stream.get()));
  block.forward_experts();
  const MoEForward fwd = block.forward_combine();
  const Tensor dx = block.backward(in.dy);
  test::check_identical(read_results(block, c, fwd, dx, tokens), want);
}

TEST_CASE("a step whose capture ended between its phases is dropped at the block's next call",
          "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::capacity_config(DType::kFP32, 1.25, DropPolicy::kProbs, 16);
  c.pad_to_capacity = true;  // no stream forks on one GPU: the capture of one phase ends cleanly
  c.validate();
  const std::int64_t tokens = 21;
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  const Inputs in(c, test::random_matrix(tokens, c.hidden, rng),
                  test::random_matrix(tokens, c.hidden, rng));
  const ForwardOptions on_device = test::losses_on_device();
  (void)block.forward(in.x, on_device);  // prepares
  (void)block.backward(in.dy);
  MoEForward fwd = block.forward(in.x, on_device);
  Tensor dx = block.backward(in.dy);
  const test::Results want = read_results(block, c, fwd, dx, tokens);

  {
    const CudaGraph partial(stream.get(), [&] { block.forward_dispatch(in.x, on_device); });
  }
  CHECK_THROWS_WITH(block.forward_experts(), test::contains_text("forward_dispatch starts one"));
  CHECK_THROWS_WITH(block.backward(in.dy), test::contains_text("no forward context"));
  fwd = block.forward(in.x, on_device);
  dx = block.backward(in.dy);
  test::check_identical(read_results(block, c, fwd, dx, tokens), want);
}

TEST_CASE("split-phase calls out of turn are refused, naming what is due; the step goes on",
          "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kBF16);
  c.gemm_autotune = false;  // the blocks then take the same algorithms
  c.validate();
  const std::int64_t tokens = 30;
  Stream stream;
  const Mesh mesh = Mesh::single();
  auto scratch = std::make_shared<MoEScratch>();
  MoEBlock block(c, mesh, stream.get(), scratch);
  MoEBlock neighbour(c, mesh, stream.get(), scratch);  // another layer on the same scratch
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  test::load_params(neighbour, params, 0, c.num_experts);
  Matrix x;
  test::draw_separated(c, params, x, tokens, rng);
  const Inputs in(c, x, test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype));
  const auto refused = [](const std::function<void()>& call, const std::string& due) {
    INFO(due);
    CHECK_THROWS_WITH(call(), test::contains_text("out of turn") && test::contains_text(due));
  };
  const auto scratch_held = [](const std::function<void()>& call) {
    CHECK_THROWS_WITH(call(), test::contains_text("shares this block's MoEScratch"));
  };

  MoEForward fwd = block.forward(in.x);
  Tensor dx = block.backward(in.dy);
  const test::Results want = read_results(block, c, fwd, dx, tokens);

  // Idle: only a step's first phase may run.
  refused([&] { block.forward_experts(); }, "forward_dispatch starts one");
  refused([&] { (void)block.forward_combine(); }, "forward_dispatch starts one");
  refused([&] { block.backward_experts(); }, "backward_combine starts one");
  refused([&] { (void)block.backward_dispatch(); }, "backward_combine starts one");

  // Mid-forward: every other call of the block, and the neighbour's calls, wait for its end.
  block.forward_dispatch(in.x);
  refused([&] { (void)block.forward(in.x); }, "forward_experts is due");
  refused([&] { (void)block.forward_combine(); }, "forward_experts is due");
  refused([&] { block.forward_dispatch(in.x); }, "forward_experts is due");
  refused([&] { block.backward_combine(in.dy); }, "forward_experts is due");
  refused([&] { block.reduce_gradients(); }, "forward_experts is due");
  refused([&] { block.synchronize(); }, "forward_experts is due");
  refused([&] { block.initialize(3); }, "forward_experts is due");
  refused([&] { block.set_check_finite(true); }, "forward_experts is due");
  scratch_held([&] { (void)neighbour.forward(in.x); });
  scratch_held([&] { neighbour.reduce_gradients(); });
  // What does not touch the scratch runs: a new block on it, the neighbour's synchronize.
  const MoEBlock late(c, mesh, stream.get(), scratch);
  neighbour.synchronize();
  block.forward_experts();
  refused([&] { block.forward_experts(); }, "forward_combine is due");
  scratch_held([&] { neighbour.forward_dispatch(in.x); });
  fwd = block.forward_combine();

  // Between forward and backward the scratch is free: the neighbour runs a whole step.
  (void)neighbour.forward(in.x);
  (void)neighbour.backward(in.dy);

  block.backward_combine(in.dy);
  refused([&] { (void)block.backward_dispatch(); }, "backward_experts is due");
  refused([&] { (void)block.backward(in.dy); }, "backward_experts is due");
  scratch_held([&] { (void)neighbour.forward(in.x); });
  block.backward_experts();
  refused([&] { block.backward_experts(); }, "backward_dispatch is due");
  dx = block.backward_dispatch();
  test::check_identical(read_results(block, c, fwd, dx, tokens), want);
  CHECK_THROWS_WITH(block.backward_combine(in.dy), test::contains_text("no forward context"));

  // A block destroyed mid-step leaves the scratch to the others.
  {
    MoEBlock leaving(c, mesh, stream.get(), scratch);
    leaving.forward_dispatch(in.x);
  }
  fwd = neighbour.forward(in.x);
  dx = neighbour.backward(in.dy);
  test::check_identical(read_results(neighbour, c, fwd, dx, tokens), want);
}

TEST_CASE("a phase that fails leaves no step under way", "[gpu][block][phases]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(DType::kFP32);
  c.gemm_autotune = false;
  c.validate();
  const std::int64_t tokens = 19;
  Stream stream;
  const Mesh mesh = Mesh::single();
  auto scratch = std::make_shared<MoEScratch>();
  MoEBlock block(c, mesh, stream.get(), scratch);
  MoEBlock neighbour(c, mesh, stream.get(), scratch);
  Matrix x = test::random_matrix(tokens, c.hidden, rng);
  const Inputs good(c, x, test::random_matrix(tokens, c.hidden, rng));
  x.data[5] = std::nan("");
  const Inputs bad(c, x, test::random_matrix(tokens, c.hidden, rng));

  // A bad argument is refused before a step begins: the last forward's context stays.
  (void)block.forward(good.x);
  const Tensor wrong(good.x.data, c.dtype, {tokens, c.hidden + 1});
  CHECK_THROWS_WITH(block.forward_dispatch(wrong), test::contains_text("x must be"));
  CHECK_THROWS_WITH(block.forward_experts(), test::contains_text("forward_dispatch starts one"));
  CHECK_THROWS_WITH(block.backward_combine(wrong), test::contains_text("dy"));
  (void)block.backward(good.dy);

  // Check mode names the stage whose output holds the NaN; the block is idle after it, and its
  // scratch free.
  block.set_check_finite(true);
  CHECK_THROWS_WITH(block.forward_dispatch(bad.x), test::contains_text("stage 'gate'"));
  CHECK_THROWS_WITH(block.forward_experts(), test::contains_text("forward_dispatch starts one"));
  CHECK_THROWS_WITH(block.backward_combine(good.dy), test::contains_text("no forward context"));
  (void)neighbour.forward(good.x);  // the scratch is free
  (void)neighbour.backward(good.dy);

  // A NaN in dy: the backward's phase that fails ends it; a new step runs.
  block.set_check_finite(false);
  (void)block.forward(good.x);
  block.set_check_finite(true);
  CHECK_THROWS_WITH(block.backward_combine(bad.x), test::contains_text("NaN"));
  CHECK_THROWS_WITH(block.backward_experts(), test::contains_text("backward_combine starts one"));
  block.set_check_finite(false);
  const MoEForward fwd = block.forward(good.x);
  const Tensor dx = block.backward(good.dy);
  const MoEForward again_fwd = neighbour.forward(good.x);
  const Tensor again_dx = neighbour.backward(good.dy);
  test::check_identical(read_results(block, c, fwd, dx, tokens),
                        read_results(neighbour, c, again_fwd, again_dx, tokens));
}
