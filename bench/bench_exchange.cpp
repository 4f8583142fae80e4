// Dispatch and combine across the EP group at the deepseek-v3 routing (T = 8192 tokens per rank,
// H = 7168, bf16, top-8 of 256 experts, uniform): the library's exchange against plain grouped
// ncclSend/ncclRecv of the same bytes (every peer, self included, as all_to_all_single does it),
// in the same run. Run under mpirun, one rank per GPU:
//   mpirun -np 2 build/bench/bench_exchange [--quick] [--json FILE]
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "bench/bench_util.h"
#include "comm/bootstrap.h"
#include "comm/exchange.h"
#include "kernels/permute.cuh"
#include "moe/mesh.h"

using namespace moe;

namespace {

// Rows this rank routes to each expert: every token to `topk` distinct experts drawn uniformly.
std::vector<std::int32_t> uniform_routing(std::int64_t tokens, int experts, int topk, int seed) {
  std::mt19937 rng(seed);
  std::vector<int> all(experts);
  std::iota(all.begin(), all.end(), 0);
  std::vector<std::int32_t> counts(experts, 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < topk; ++k) {  // a partial Fisher-Yates draw: k distinct experts
      std::uniform_int_distribution<int> pick(k, experts - 1);
      std::swap(all[k], all[pick(rng)]);
      ++counts[all[k]];
    }
  }
  return counts;
}

// The slowest rank's value: a collective finishes when its last member does.
double slowest(double value) {
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return value;
}

}  // namespace

int main(int argc, char** argv) try {
  comm::MpiSession mpi(&argc, &argv);
  const auto options = bench::parse_options(argc, argv);
  const bool root = mpi.rank() == 0;
  if (mpi.size() < 2) {
    if (root) fmt::print("bench_exchange: needs two or more ranks (mpirun -np 2 ...); skipped\n");
    return 0;
  }
  const std::int64_t T = 8192, H = 7168;
  const int E = 256, K = 8;
  const std::size_t row_bytes = H * 2;  // bf16
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, mpi.size(), 1, E);
  const int EP = mesh.ep(), me = mesh.ep_index();
  Stream stream;
  ExpertExchange exchange(mesh, E);

  const auto counts = uniform_routing(T, E, K, 11 + mpi.rank());
  DeviceBuffer counts_dev(E * 4), received_dev(E * 4);
  copy_to_device(counts_dev.data(), counts.data(), E * 4);
  const ExchangeCounts c =
      exchange.exchange_counts(counts_dev.as<std::int32_t>(), received_dev.as<std::int32_t>(),
                               nullptr, nullptr, 0, stream.get());
  const std::int64_t sent = std::accumulate(c.send_rows.begin(), c.send_rows.end(), 0L);
  DeviceBuffer send(sent * row_bytes), recv(c.total_received() * row_bytes);
  MOE_CHECK_CUDA(cudaMemsetAsync(send.data(), 0x3c, send.bytes(), stream.get()));

  // Plain grouped send/recv of the same bytes, self included, as one all-to-allv call does it.
  ncclComm_t ep = mesh.comm(MeshGroup::kExpertParallel);
  auto plain = [&](const char* from, const std::vector<std::int64_t>& from_rows, char* to,
                   const std::vector<std::int64_t>& to_rows) {
    std::size_t send_at = 0, recv_at = 0;
    mesh.group_start();
    for (int peer = 0; peer < EP; ++peer) {
      MOE_CHECK_NCCL(
          ncclSend(from + send_at, from_rows[peer] * row_bytes, ncclInt8, peer, ep, stream.get()));
      MOE_CHECK_NCCL(
          ncclRecv(to + recv_at, to_rows[peer] * row_bytes, ncclInt8, peer, ep, stream.get()));
      send_at += from_rows[peer] * row_bytes;
      recv_at += to_rows[peer] * row_bytes;
    }
    mesh.group_end("the plain all-to-allv");
  };
  auto* send_rows = send.as<char>();
  auto* recv_rows = recv.as<char>();
  const int warmup = 3, repeats = options.quick ? 10 : 30;
  auto time = [&](const std::function<void()>& body) {
    return slowest(bench::median_ms([&](int) { body(); }, stream.get(), warmup, repeats));
  };
  const double dispatch_ms = time([&] {
    exchange.exchange_rows(send_rows, c.send_rows, recv_rows, c.recv_rows, row_bytes, stream.get());
  });
  const double dispatch_counts_ms = time([&] {
    exchange.exchange_counts(counts_dev.as<std::int32_t>(), received_dev.as<std::int32_t>(),
                             nullptr, nullptr, 0, stream.get());
    exchange.exchange_rows(send_rows, c.send_rows, recv_rows, c.recv_rows, row_bytes, stream.get());
  });
  const double combine_ms = time([&] {
    exchange.exchange_rows(recv_rows, c.recv_rows, send_rows, c.send_rows, row_bytes, stream.get());
  });
  const double plain_dispatch_ms =
      time([&] { plain(send_rows, c.send_rows, recv_rows, c.recv_rows); });
  const double plain_combine_ms =
      time([&] { plain(recv_rows, c.recv_rows, send_rows, c.send_rows); });

  // The whole stage as the layer runs it: rows per peer, then the chunk sort into the padded
  // expert-major layout the experts use (align 16), and its inverse before the combine.
  const int E_loc = E / EP, align = 16;
  std::vector<std::int64_t> expert_offsets(E_loc + 1, 0);
  for (int e = 0; e < E_loc; ++e) {
    std::int64_t rows = 0;
    for (int src = 0; src < EP; ++src) rows += c.received[src * E_loc + e];
    expert_offsets[e + 1] = expert_offsets[e] + (rows + align - 1) / align * align;
  }
  DeviceBuffer expert_rows(expert_offsets.back() * row_bytes),
      chunk_ws(chunk_workspace_bytes(EP, E_loc));
  const ChunkArgs chunks{received_dev.as<std::int32_t>(), EP, E_loc, align, chunk_ws.data()};
  const Tensor expert_major(expert_rows.data(), DType::kBF16, {expert_offsets.back(), H});
  const Tensor received_rows(recv.data(), DType::kBF16, {c.total_received(), H});
  const double sorted_dispatch_ms = time([&] {
    exchange.exchange_rows(send_rows, c.send_rows, recv_rows, c.recv_rows, row_bytes, stream.get());
    sort_chunks(chunks, received_rows, expert_major, stream.get());
  });
  const double sorted_combine_ms = time([&] {
    unsort_chunks(chunks, expert_major, received_rows, stream.get());
    exchange.exchange_rows(recv_rows, c.recv_rows, send_rows, c.send_rows, row_bytes, stream.get());
  });

  // Bytes over the links: rows to and from other ranks (own rows stay on the GPU).
  const double link_bytes =
      static_cast<double>(sent - c.send_rows[me]) * static_cast<double>(row_bytes);
  auto rate = [&](double ms) { return link_bytes / (ms * 1e-3) / 1e9; };
  const double ours = dispatch_ms + combine_ms, theirs = plain_dispatch_ms + plain_combine_ms;
  if (root) {
    fmt::print(
        "dispatch + combine, EP={} ranks, T={} per rank, H={}, bf16, top-{} of {} experts "
        "(uniform), {}\n",
        EP, T, H, K, E, bench::device_name());
    fmt::print("rows leaving rank 0: {} ({:.0f} MB); own rows copied on the GPU: {}\n",
               sent - c.send_rows[me], link_bytes / 1e6, c.send_rows[me]);
    fmt::print("{:<34} {:>9} {:>9} {:>12}\n", "", "ms", "GB/s", "vs plain");
    fmt::print("{:<34} {:>9.3f} {:>9.0f} {:>11.1f}%\n", "dispatch rows", dispatch_ms,
               rate(dispatch_ms), 100 * plain_dispatch_ms / dispatch_ms);
    fmt::print("{:<34} {:>9.3f} {:>9.0f} {:>11.1f}%\n", "dispatch incl. counts + host sync",
               dispatch_counts_ms, rate(dispatch_counts_ms),
               100 * plain_dispatch_ms / dispatch_counts_ms);
    fmt::print("{:<34} {:>9.3f} {:>9.0f} {:>11.1f}%\n", "combine rows", combine_ms,
               rate(combine_ms), 100 * plain_combine_ms / combine_ms);
    fmt::print("{:<34} {:>9.3f} {:>9.0f}\n", "plain send/recv, dispatch bytes", plain_dispatch_ms,
               rate(plain_dispatch_ms));
    fmt::print("{:<34} {:>9.3f} {:>9.0f}\n", "plain send/recv, combine bytes", plain_combine_ms,
               rate(plain_combine_ms));
    fmt::print("{:<34} {:>9.3f} {:>9.0f} {:>11.1f}%\n", "dispatch rows + chunk sort",
               sorted_dispatch_ms, rate(sorted_dispatch_ms),
               100 * plain_dispatch_ms / sorted_dispatch_ms);
    fmt::print("{:<34} {:>9.3f} {:>9.0f} {:>11.1f}%\n", "chunk unsort + combine rows",
               sorted_combine_ms, rate(sorted_combine_ms),
               100 * plain_combine_ms / sorted_combine_ms);
    fmt::print("dispatch + combine: {:.0f} GB/s = {:.1f}% of plain send/recv ({:.0f} GB/s)\n",
               2 * link_bytes / (ours * 1e-3) / 1e9, 100 * theirs / ours,
               2 * link_bytes / (theirs * 1e-3) / 1e9);
    bench::write_json(options, {{"bench", "exchange"},
                                {"device", bench::device_name()},
                                {"ranks", EP},
                                {"tokens", T},
                                {"hidden", H},
                                {"experts", E},
                                {"topk", K},
                                {"link_bytes", link_bytes},
                                {"dispatch_ms", dispatch_ms},
                                {"dispatch_with_counts_ms", dispatch_counts_ms},
                                {"combine_ms", combine_ms},
                                {"plain_dispatch_ms", plain_dispatch_ms},
                                {"plain_combine_ms", plain_combine_ms},
                                {"fraction_of_plain", theirs / ours},
                                {"sorted_dispatch_ms", sorted_dispatch_ms},
                                {"sorted_combine_ms", sorted_combine_ms}});
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_exchange: %s\n", e.what());
  return 1;
}
