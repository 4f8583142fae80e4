// MoEBlock on an EP×DP mesh: on every rank the output, dx, the losses and the reduced weight
// gradients equal the fp64 single run on the concatenated batch with the same weights.
#include <mpi.h>

#include <algorithm>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_util.h"
#include "support/catch.h"
#include "support/mesh_checks.h"
#include "support/test_main.h"

using namespace moe;
using reference::Matrix;

namespace {

// Under EP each case runs over every transport: NCCL, the peer exchange where the EP group has
// peer access (auto then picks it; the block reports which it took), and the copy exchange there.
std::vector<EpTransport> transports(int ep) {
  if (ep == 1) return {EpTransport::kAuto};
  return test::ep_transports();
}

// This rank's rows [first, first + T) of the global batch's x and dy, on the GPU.
struct RankRows {
  DeviceBuffer x, dy;
};
RankRows upload_rank_rows(const Matrix& x, const Matrix& dy, std::int64_t first, std::int64_t T,
                          DType dtype) {
  return {test::upload_as(reference::slice_rows(x, first, first + T), dtype),
          test::upload_as(reference::slice_rows(dy, first, first + T), dtype)};
}

// The block's out and dx against this rank's rows of the single run on the concatenated batch.
void check_rank_rows(const Tensor& out, const Tensor& dx, const reference::LayerResult& want,
                     std::int64_t first, std::int64_t T, std::int64_t hidden, double tolerance) {
  CHECK(test::relative_error(test::read(out, T, hidden),
                             reference::slice_rows(want.out, first, first + T)) <= tolerance);
  CHECK(test::relative_error(test::read(dx, T, hidden),
                             reference::slice_rows(want.dx, first, first + T)) <= tolerance);
}

void run_mesh_case(MoEConfig c, int ep, int dp, bool empty_rank, std::uint64_t seed) {
  const int world = test::world_size();
  const int rank = test::world_rank();
  c.ep = ep;
  c.dp = dp;
  c.validate();
  INFO(c.describe() << " rank " << rank << (empty_rank ? ", last rank without tokens" : ""));
  // Every rank draws the same global batch and weights, then takes its part.
  std::mt19937_64 rng(seed);
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  std::vector<std::int64_t> tokens(world);
  std::uniform_int_distribution<int> count(1, 40);
  for (auto& t : tokens) t = count(rng);
  if (empty_rank) tokens.back() = 0;
  const std::int64_t total = std::accumulate(tokens.begin(), tokens.end(), std::int64_t{0});
  Matrix x;
  test::draw_separated(c, params, x, total, rng);
  const Matrix dy = test::round_to(test::random_matrix(total, c.hidden, rng), c.dtype);
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, c.num_experts);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  const int E_loc = c.num_experts / ep;
  test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  const std::int64_t first =
      std::accumulate(tokens.begin(), tokens.begin() + rank, std::int64_t{0});
  const std::int64_t T = tokens[rank];
  const RankRows rows = upload_rank_rows(x, dy, first, T, c.dtype);
  const auto fwd = block.forward(Tensor(rows.x.data(), c.dtype, {T, c.hidden}));
  INFO("transport " << ep_transport_name(block.ep_transport()));
  if (c.ep_transport != EpTransport::kAuto) CHECK(block.ep_transport() == c.ep_transport);
  CHECK(block.probabilities_in_experts() ==
        (ep == 1 || block.ep_transport() == EpTransport::kPeer));
  const Tensor dx = block.backward(Tensor(rows.dy.data(), c.dtype, {T, c.hidden}));
  block.reduce_gradients();
  MOE_CHECK_CUDA(cudaDeviceSynchronize());

  const MoEConfig single = c.for_one_rank();  // node-limited: the mesh's nodes as plain groups
  const auto want =
      reference::run_layer(single, params, x, dy, test::kAsStored, test::dprob_path(block));
  const double tol = c.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  if (T > 0) check_rank_rows(fwd.out, dx, want, first, T, c.hidden, tol);
  CHECK(fwd.aux_loss == Approx(want.aux_loss).epsilon(1e-5).margin(1e-9));
  CHECK(fwd.z_loss == Approx(want.z_loss).epsilon(1e-5).margin(1e-9));
  const auto& g = block.gradients();
  test::check_rank_gradients(c, g, want, mesh.ep_index() * E_loc, E_loc, tol);
  if (c.shared_gate) {
    CHECK(test::relative_error(test::read(g.shared_gate_weight, 1, c.hidden),
                               want.shared_grads.dgate_weight) <= tol);
  }
}

}  // namespace

TEST_CASE("MoEBlock on every mesh shape equals the single run on the concatenated batch",
          "[mpi][block]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  MoEConfig softmax = test::small_config(64, 48, 8, 2);
  softmax.aux_loss_coeff = 0.05;
  softmax.z_loss_coeff = 0.01;
  softmax.align_size = 16;
  MoEConfig deepseek = test::deepseek_like(softmax);
  int index = 0;
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    for (const EpTransport transport : transports(ep)) {
      for (const MoEConfig* base : {&softmax, &deepseek}) {
        for (const DType dtype : {DType::kFP32, DType::kBF16}) {
          MoEConfig c = *base;
          c.dtype = dtype;
          c.ep_transport = transport;
          // Every other case makes the SwiGLU output in chunks of ~10 rows (1 KiB): experts cut
          // into pieces, their dw2 summed over them.
          if (index % 2 == 1) c.activation_chunk_mib = 0.001;
          // X kept from the forward (else, under the peer exchange, stored again from x).
          c.keep_expert_input = index % 4 == 2;
          ++index;
          run_mesh_case(c, ep, world / ep, index % 3 == 0, seed + index);
        }
      }
      MoEConfig half_grads = softmax;  // bf16 weight gradients, summed over DP through fp32
      half_grads.dtype = DType::kBF16;
      half_grads.grad_dtype = DType::kBF16;
      half_grads.ep_transport = transport;
      ++index;
      run_mesh_case(half_grads, ep, world / ep, false, seed + index);
      if (ep >= 2) {  // node-limited routing, one EP rank to a node
        MoEConfig node_limited = deepseek;
        node_limited.num_groups = node_limited.group_topk = 0;
        node_limited.ep_ranks_per_node = 1;
        node_limited.max_nodes_per_token = std::max(1, ep / 2);
        node_limited.dtype = DType::kBF16;
        node_limited.ep_transport = transport;
        ++index;
        run_mesh_case(node_limited, ep, world / ep, false, seed + index);
      }
    }
  }
}

TEST_CASE("MoEBlock with a shared expert on every mesh shape equals the single run",
          "[mpi][block][shared]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.aux_loss_coeff = 0.05;
  c.align_size = 16;
  c.shared_ffn_hidden = 40;
  int index = 0;
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    for (const EpTransport transport : transports(ep)) {
      for (const bool gated : {false, true}) {
        c.shared_gate = gated;
        c.ep_transport = transport;
        c.dtype = index % 2 ? DType::kBF16 : DType::kFP32;
        run_mesh_case(c, ep, world / ep, index % 3 == 2, seed + index);
        ++index;
      }
    }
  }
}

TEST_CASE("hard routing on a mesh: every token to the experts of EP rank 0", "[mpi][block]") {
  const int world = test::world_size();
  const EpTransport transport =
      GENERATE(EpTransport::kNccl, EpTransport::kAuto, EpTransport::kCopy);
  if (transport == EpTransport::kCopy && !test::host_gpus_have_peer_access()) return;
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.ep_transport = transport;
  c.score_function = ScoreFunction::kSigmoid;
  c.expert_bias = true;
  c.aux_loss_coeff = 0.05;
  c.align_size = 8;
  // The bias pushes every token to experts 0 and 1, which live on EP rank 0 whatever the mesh.
  const auto seed = test::shared_seed();
  std::mt19937_64 rng(seed);
  c.ep = world;
  c.dp = 1;
  c.validate();
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  params.expert_bias = {30, 30, 0, 0, 0, 0, 0, 0};
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, c.num_experts);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  const int E_loc = 8 / world;
  test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  const std::int64_t T = 30;
  Matrix x = test::random_matrix(T * world, c.hidden, rng);
  const Matrix dy = test::random_matrix(T * world, c.hidden, rng);
  MoEConfig single = c;
  single.ep = 1;
  const auto want = reference::run_layer(single, params, x, dy, test::kAsStored);
  const std::int64_t first = T * test::world_rank();
  const RankRows rows = upload_rank_rows(x, dy, first, T, c.dtype);
  const auto fwd = block.forward(Tensor(rows.x.data(), c.dtype, {T, c.hidden}));
  INFO("transport " << ep_transport_name(block.ep_transport()));
  const Tensor dx = block.backward(Tensor(rows.dy.data(), c.dtype, {T, c.hidden}));
  block.reduce_gradients();
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  check_rank_rows(fwd.out, dx, want, first, T, c.hidden, 1e-5);
  CHECK(fwd.aux_loss == Approx(want.aux_loss).epsilon(1e-5));
}

TEST_CASE("steps of changing batch sizes on one EP block: buffers grow and are mapped again",
          "[mpi][block]") {
  // The peer exchange's buffers grow when a step routes more rows to a rank than any before; every
  // rank maps the grown buffer again. Each step is checked against its own single run.
  const int world = test::world_size();
  const EpTransport transport =
      GENERATE(EpTransport::kNccl, EpTransport::kAuto, EpTransport::kCopy);
  if (transport == EpTransport::kCopy && !test::host_gpus_have_peer_access()) return;
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.aux_loss_coeff = 0.05;
  c.align_size = 16;
  c.ep = world;
  c.dp = 1;
  c.ep_transport = transport;
  c.validate();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, c.num_experts);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  const int E_loc = c.num_experts / world;
  test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  MoEConfig single = c;
  single.ep = 1;
  for (const std::int64_t T :
       {std::int64_t{5}, std::int64_t{300}, std::int64_t{17}, std::int64_t{1200}}) {
    INFO("T " << T << " per rank");
    Matrix x;
    test::draw_separated(c, params, x, T * world, rng);
    const Matrix dy = test::random_matrix(T * world, c.hidden, rng);
    const auto want = reference::run_layer(single, params, x, dy, test::kAsStored);
    const std::int64_t first = T * test::world_rank();
    const RankRows rows = upload_rank_rows(x, dy, first, T, c.dtype);
    const auto fwd = block.forward(Tensor(rows.x.data(), c.dtype, {T, c.hidden}));
    INFO("transport " << ep_transport_name(block.ep_transport()));
    const Tensor dx = block.backward(Tensor(rows.dy.data(), c.dtype, {T, c.hidden}));
    MOE_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
    check_rank_rows(fwd.out, dx, want, first, T, c.hidden, 1e-5);
  }
}

TEST_CASE("two EP layers sharing a scratch: forward 1, forward 2, backward 2, backward 1",
          "[mpi][block]") {
  // Under the peer exchange the layers share Y through the scratch: each layer's rows must
  // survive the other's use of it, and a fast rank must not overwrite what a slow one still reads.
  const int world = test::world_size();
  const EpTransport transport =
      GENERATE(EpTransport::kNccl, EpTransport::kAuto, EpTransport::kCopy);
  if (transport == EpTransport::kCopy && !test::host_gpus_have_peer_access()) return;
  MoEConfig first_config = test::small_config(64, 48, 8, 2);
  first_config.align_size = 16;
  first_config.ep = world;
  first_config.ep_transport = transport;
  MoEConfig second_config = first_config;  // another shape: the shared buffers grow between
  second_config.num_experts = 16;
  second_config.topk = 4;
  second_config.ffn_hidden = 40;
  first_config.validate();
  second_config.validate();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, 8);
  Stream stream;
  const auto scratch = std::make_shared<MoEScratch>();
  const std::int64_t T = 64;
  const std::int64_t first = T * test::world_rank();
  struct Layer {
    MoEConfig config;
    reference::Params params;
    Matrix x, dy;
    reference::LayerResult want;
    RankRows rows;
    std::unique_ptr<MoEBlock> block;
    MoEForward fwd;
  };
  std::vector<Layer> layers(2);
  for (int l = 0; l < 2; ++l) {
    Layer& L = layers[l];
    L.config = l == 0 ? first_config : second_config;
    L.params = test::round_params(test::random_params(L.config, rng), L.config.dtype);
    test::draw_separated(L.config, L.params, L.x, T * world, rng);
    L.dy = test::random_matrix(T * world, L.config.hidden, rng);
    MoEConfig single = L.config;
    single.ep = 1;
    L.want = reference::run_layer(single, L.params, L.x, L.dy, test::kAsStored);
    L.rows = upload_rank_rows(L.x, L.dy, first, T, L.config.dtype);
    L.block = std::make_unique<MoEBlock>(L.config, mesh, stream.get(), scratch);
    const int E_loc = L.config.num_experts / world;
    test::load_params(*L.block, L.params, mesh.ep_index() * E_loc, E_loc);
  }
  for (auto& L : layers)
    L.fwd = L.block->forward(Tensor(L.rows.x.data(), L.config.dtype, {T, L.config.hidden}));
  std::vector<Tensor> dx(2);
  for (int l = 1; l >= 0; --l) {
    Layer& L = layers[l];
    dx[l] = L.block->backward(Tensor(L.rows.dy.data(), L.config.dtype, {T, L.config.hidden}));
  }
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
  for (int l = 0; l < 2; ++l) {
    const Layer& L = layers[l];
    INFO("layer " << l + 1 << ", transport " << ep_transport_name(L.block->ep_transport()));
    check_rank_rows(L.fwd.out, dx[l], L.want, first, T, L.config.hidden, 1e-5);
  }
}

namespace {

// FNV-1a over a tensor's bytes: DP replicas compare their results through MPI with it.
std::uint64_t bytes_hash(const Tensor& t) {
  std::vector<unsigned char> host(t.bytes());
  copy_to_host(host.data(), t.data, host.size());
  std::uint64_t hash = 1469598103934665603ull;
  for (const unsigned char byte : host) hash = (hash ^ byte) * 1099511628211ull;
  return hash;
}

}  // namespace

TEST_CASE("DP replicas given the same rows agree bitwise once the GEMM algorithms are agreed",
          "[mpi][block]") {
  const int world = test::world_size();
  if (world < 2) {
    WARN("needs two ranks; one rank has no replica");
    return;
  }
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  for (const int ep : {1, 2}) {
    if (world % ep != 0 || world / ep < 2) continue;
    MoEConfig c = test::small_config(256, 512, 8, 2);
    c.ep = ep;
    c.dp = world / ep;
    c.gemm_autotune = true;
    c.validate();
    INFO(c.describe());
    const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, c.ep, c.dp, c.num_experts);
    Stream stream;
    MoEBlock block(c, mesh, stream.get());
    // The same rows on the ranks of each DP group (equal EP index), different across EP ranks.
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(mesh.ep_index()));
    const std::int64_t T = 700;
    const auto x = test::upload_as(test::random_matrix(T, c.hidden, rng), c.dtype);
    const auto dy = test::upload_as(test::random_matrix(T, c.hidden, rng), c.dtype);
    std::vector<std::uint64_t> hashes;
    for (int step = 0; step < 2; ++step) {
      const auto fwd = block.forward(Tensor(x.data(), c.dtype, {T, c.hidden}));
      const Tensor dx = block.backward(Tensor(dy.data(), c.dtype, {T, c.hidden}));
      if (step == 1) {
        block.synchronize();
        const auto& g = block.gradients();
        hashes = {bytes_hash(fwd.out), bytes_hash(dx), bytes_hash(g.w13), bytes_hash(g.w2)};
      }
      block.reduce_gradients();
      block.synchronize();
    }
    // Every rank's hashes; the ranks of one DP group (same EP index) must match.
    std::vector<std::uint64_t> all(hashes.size() * world);
    MOE_CHECK_MPI(MPI_Allgather(hashes.data(), static_cast<int>(hashes.size()), MPI_UINT64_T,
                                all.data(), static_cast<int>(hashes.size()), MPI_UINT64_T,
                                MPI_COMM_WORLD));
    for (int r = 0; r < world; ++r) {
      if (r % ep != mesh.ep_index()) continue;
      INFO("rank " << test::world_rank() << " against its DP replica " << r);
      for (std::size_t i = 0; i < hashes.size(); ++i)
        CHECK(all[r * hashes.size() + i] == hashes[i]);
    }
  }
}

TEST_CASE("an invalid replay index on one rank fails every rank in the same forward",
          "[mpi][block][replay]") {
  const int world = test::world_size();
  if (world < 2) {
    WARN("needs two ranks; one rank is the single-GPU test");
    return;
  }
  MoEConfig c = test::small_config(64, 48, 2 * world, 2);
  c.ep = world;
  c.gemm_autotune = false;
  c.validate();
  // A timeout far above what the check takes: a rank that waited it out would show.
  const auto timeout = std::chrono::seconds(60);
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, c.num_experts, timeout);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  std::mt19937_64 rng(11 + test::world_rank());
  const std::int64_t T = 16;
  const auto x = test::upload_as(test::random_matrix(T, c.hidden, rng), c.dtype);
  const Tensor x_t(x.data(), c.dtype, {T, c.hidden});
  (void)block.forward(x_t);
  DeviceBuffer recorded(static_cast<std::size_t>(T * c.topk) * 4);
  const Tensor idx(recorded.data(), DType::kInt32, {T, c.topk});
  block.record_routing(idx);
  block.synchronize();
  if (test::world_rank() == 1) {
    const std::int32_t outside = c.num_experts;
    copy_to_device(recorded.as<std::int32_t>() + 5, &outside, sizeof(outside));  // token 2, slot 1
  }
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(
      block.forward(x_t, ForwardOptions{idx}),
      test::world_rank() == 1
          ? test::contains_text("token 2, slot 1: expert " + std::to_string(c.num_experts))
          : test::contains_text("another rank's replay_topk_idx"));
  CHECK(std::chrono::steady_clock::now() - start < timeout / 2);
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

// Each rank records its step's routing, then replays it: outputs and every gradient (reduced over
// the DP group) bitwise the same, on every mesh shape (DP, EP × DP, EP) and over every transport
// (the replayed probabilities are recomputed by the forward's rule).
TEST_CASE("a recorded step replays bitwise on every mesh shape", "[mpi][block][replay]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0 || 8 % ep != 0) continue;
    for (const EpTransport transport : transports(ep)) {
      MoEConfig c = test::deepseek_like(test::small_config(64, 48, 8, 2));
      c.aux_loss_coeff = 0.05;
      c.align_size = 16;
      c.ep = ep;
      c.dp = world / ep;
      c.ep_transport = transport;
      c.gemm_autotune = false;
      c.validate();
      INFO(c.describe() << ", transport " << ep_transport_name(transport));
      std::mt19937_64 rng(seed + 1000);
      auto params = test::round_params(test::random_params(c, rng), c.dtype);
      const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, c.ep, c.dp, c.num_experts);
      Stream stream;
      MoEBlock block(c, mesh, stream.get());
      const int E_loc = c.num_experts / ep;
      test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
      std::mt19937_64 rank_rng(seed + 17 * static_cast<std::uint64_t>(test::world_rank()));
      const std::int64_t T = 29 + test::world_rank();
      Matrix x;
      test::draw_separated(c, params, x, T, rank_rng);
      const auto x_dev = test::upload_as(x, c.dtype);
      const auto dy_dev = test::upload_as(test::random_matrix(T, c.hidden, rank_rng), c.dtype);
      const Tensor x_t(x_dev.data(), c.dtype, {T, c.hidden});
      const Tensor dy_t(dy_dev.data(), c.dtype, {T, c.hidden});
      DeviceBuffer recorded(static_cast<std::size_t>(T * c.topk) * 4);
      const Tensor idx(recorded.data(), DType::kInt32, {T, c.topk});
      struct Step {
        Matrix out, dx, dgate, dw13, dw2;
        float aux = 0;
      };
      const auto run = [&](const ForwardOptions& options, bool record) {
        Step s;
        const auto fwd = block.forward(x_t, options);
        if (record) block.record_routing(idx);
        s.out = test::read(fwd.out, T, c.hidden);  // (read waits for the device)
        s.aux = fwd.aux_loss;
        s.dx = test::read(block.backward(dy_t), T, c.hidden);
        block.reduce_gradients();
        block.synchronize();
        const auto& g = block.gradients();
        s.dgate = test::read(g.gate_weight, c.num_experts, c.hidden);
        s.dw13 = test::read(g.w13, static_cast<std::int64_t>(E_loc) * 2 * c.ffn_hidden, c.hidden);
        s.dw2 = test::read(g.w2, static_cast<std::int64_t>(E_loc) * c.hidden, c.ffn_hidden);
        return s;
      };
      // The first step's reduce_gradients agrees the GEMM algorithms over the mesh: the recorded
      // step and its replay both come after it, so they run the same ones by construction.
      (void)run({}, false);
      const Step want = run({}, true);
      const Step again = run(ForwardOptions{idx}, false);
      CHECK(again.out.data == want.out.data);
      CHECK(again.dx.data == want.dx.data);
      CHECK(again.dgate.data == want.dgate.data);
      CHECK(again.dw13.data == want.dw13.data);
      CHECK(again.dw2.data == want.dw2.data);
      CHECK(again.aux == want.aux);
    }
  }
}
