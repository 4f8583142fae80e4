// Mesh and EP communication under mpirun: construction and validation, the counts and rows
// all-to-allv against MPI on the host, round trips, reductions against host sums.
#include <mpi.h>

#include <numeric>
#include <random>

#include "comm/exchange.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_main.h"
#include "support/test_util.h"

using namespace moe;

namespace {
std::uint64_t shared_seed() {
  std::uint64_t seed = test::world_rank() == 0 ? test::fresh_seed() : 0;
  MOE_CHECK_MPI(MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  return seed;
}
}  // namespace

TEST_CASE("meshes of every valid shape; invalid ones rejected on every rank", "[mpi][mesh]") {
  const int world = test::world_size();
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    const int dp = world / ep;
    INFO("EP " << ep << " x DP " << dp);
    const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, 8 * ep);
    CHECK(mesh.world_size() == world);
    CHECK(mesh.rank() == test::world_rank());
    CHECK(mesh.ep_index() == mesh.rank() % ep);
    CHECK(mesh.dp_index() == mesh.rank() / ep);
    CHECK(mesh.group_size(MeshGroup::kExpertParallel) == ep);
    CHECK(mesh.group_size(MeshGroup::kDataParallel) == dp);
  }
  CHECK_THROWS_WITH(Mesh::from_mpi(MPI_COMM_WORLD, world + 1, 1, 64),
                    test::contains_text("must equal the world size"));
  if (world > 1) {  // with one rank every expert count divides
    CHECK_THROWS_WITH(Mesh::from_mpi(MPI_COMM_WORLD, world, 1, 3 * world + 1),
                      test::contains_text("must divide num_experts"));
  }
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));  // every rank got here: nobody hung
}

TEST_CASE("dispatch and combine all-to-allv: skewed counts, zeros, round trip", "[mpi][mesh]") {
  const int world = test::world_size();
  const int rank = test::world_rank();
  const auto seed = shared_seed();
  INFO("seed " << seed << " rank " << rank);
  const int E_loc = 4, E = E_loc * world, H = 40;  // 40 bf16: rows of 80 bytes
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, E);
  ExpertExchange exchange(mesh, E);
  Stream stream;
  for (int round = 0; round < 3; ++round) {
    std::mt19937_64 rng(seed + 1000 * round + rank);
    std::vector<std::int32_t> counts(E);
    std::uniform_int_distribution<int> count(0, 30);
    for (int e = 0; e < E; ++e)
      counts[e] = (e + round) % 3 == 0 ? 0 : count(rng);         // zeros included
    if (round == 2) std::fill(counts.begin(), counts.end(), 0);  // a rank sends nothing
    if (round == 2 && rank == 0) counts[0] = 57;                 // one expert takes all
    const auto counts_dev = test::upload(counts);
    DeviceBuffer received_dev(E * 4);
    test::poison(received_dev);
    const auto& c =
        exchange.exchange_counts(counts_dev.as<std::int32_t>(), received_dev.as<std::int32_t>(),
                                 nullptr, nullptr, 0, stream.get());
    // Host reference: MPI all-to-all of the same counts.
    std::vector<std::int32_t> want(E);
    MOE_CHECK_MPI(MPI_Alltoall(counts.data(), E_loc, MPI_INT32_T, want.data(), E_loc, MPI_INT32_T,
                               MPI_COMM_WORLD));
    REQUIRE(c.received == want);
    REQUIRE(test::download<std::int32_t>(received_dev, E) == want);

    const std::int64_t sent_rows = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    std::vector<BF16> rows(static_cast<std::size_t>(sent_rows * H));
    for (auto& v : rows) v = to_bf16(std::normal_distribution<float>(0, 1)(rng));
    const auto send_dev = test::upload(rows);
    DeviceBuffer recv_dev(c.total_received() * H * 2 + 16), back_dev(sent_rows * H * 2 + 16);
    test::poison(recv_dev);
    test::poison(back_dev);
    exchange.exchange_rows(send_dev.data(), c.send_rows, recv_dev.data(), c.recv_rows, H * 2,
                           stream.get());
    exchange.exchange_rows(recv_dev.data(), c.recv_rows, back_dev.data(), c.send_rows, H * 2,
                           stream.get());
    stream.synchronize();

    std::vector<int> send_bytes(world), send_displ(world), recv_bytes(world), recv_displ(world);
    for (int p = 0, s = 0, r = 0; p < world; ++p) {
      send_bytes[p] = static_cast<int>(c.send_rows[p] * H * 2);
      recv_bytes[p] = static_cast<int>(c.recv_rows[p] * H * 2);
      send_displ[p] = s;
      recv_displ[p] = r;
      s += send_bytes[p];
      r += recv_bytes[p];
    }
    std::vector<BF16> want_rows(static_cast<std::size_t>(c.total_received() * H));
    MOE_CHECK_MPI(MPI_Alltoallv(rows.data(), send_bytes.data(), send_displ.data(), MPI_BYTE,
                                want_rows.data(), recv_bytes.data(), recv_displ.data(), MPI_BYTE,
                                MPI_COMM_WORLD));
    const auto got = test::download<BF16>(recv_dev, want_rows.size());
    REQUIRE(std::memcmp(got.data(), want_rows.data(), want_rows.size() * 2) == 0);
    const auto back = test::download<BF16>(back_dev, rows.size());
    REQUIRE(std::memcmp(back.data(), rows.data(), rows.size() * 2) == 0);
  }
}

TEST_CASE("reductions over world, EP and DP groups equal host sums", "[mpi][mesh]") {
  const int world = test::world_size();
  const int rank = test::world_rank();
  const auto seed = shared_seed();
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, world / ep, 8 * ep);
    mesh.connect(nullptr);  // every connection made up front; the sums below must still hold
    for (const MeshGroup group :
         {MeshGroup::kWorld, MeshGroup::kExpertParallel, MeshGroup::kDataParallel}) {
      std::mt19937_64 rng(seed + rank);
      std::vector<float> values(1000);
      for (auto& v : values) v = std::normal_distribution<float>(0, 1)(rng);
      const auto dev = test::upload(values);
      mesh.all_reduce_sum(dev.data(), values.size(), ncclFloat32, group, nullptr);
      MOE_CHECK_CUDA(cudaDeviceSynchronize());
      // Host reference: MPI over the same ranks (the group's color as in the mesh).
      const int color = group == MeshGroup::kWorld            ? 0
                        : group == MeshGroup::kExpertParallel ? mesh.dp_index()
                                                              : mesh.ep_index();
      MPI_Comm sub;
      MOE_CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, color, rank, &sub));
      std::vector<double> local(values.begin(), values.end()), want(values.size());
      MOE_CHECK_MPI(MPI_Allreduce(local.data(), want.data(), static_cast<int>(want.size()),
                                  MPI_DOUBLE, MPI_SUM, sub));
      MOE_CHECK_MPI(MPI_Comm_free(&sub));
      CHECK(test::relative_error(test::to_double(test::download<float>(dev, values.size())),
                                 want) <= 1e-6);
    }
  }
}
