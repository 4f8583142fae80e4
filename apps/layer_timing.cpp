#include "layer_timing.h"

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <memory>

#include "bench/bench_util.h"
#include "kernels/elementwise.cuh"
#include "kernels/gemm.h"
#include "moe/device.h"
#include "moe/error.h"

namespace moe::layer_timing {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double p2p_rate(const Mesh& mesh, cudaStream_t stream) {
  ncclComm_t ep = mesh.comm(MeshGroup::kExpertParallel);
  if (ep == nullptr) return 0.0;
  const std::size_t bytes = std::size_t{256} << 20;
  DeviceBuffer send(bytes * mesh.ep()), recv(bytes * mesh.ep());
  auto exchange = [&] {
    mesh.group_start();
    for (int peer = 0; peer < mesh.ep(); ++peer) {
      if (peer == mesh.ep_index()) continue;
      MOE_CHECK_NCCL(ncclSend(send.as<char>() + peer * bytes, bytes, ncclInt8, peer, ep, stream));
      MOE_CHECK_NCCL(ncclRecv(recv.as<char>() + peer * bytes, bytes, ncclInt8, peer, ep, stream));
    }
    mesh.group_end("the p2p bandwidth measurement");
  };
  const double ms = bench::median_ms([&](int) { exchange(); }, stream, 2, 5);
  return static_cast<double>(bytes) * (mesh.ep() - 1) / (ms * 1e-3);
}

SplitPhaseTimes time_split_phase(MoEBlock& block, const Tensor& x, const Tensor& dy,
                                 const ForwardOptions& options, int products, int iters,
                                 cudaStream_t stream) {
  const std::int64_t T = x.dim(0), H = x.dim(1);
  DeviceBuffer a(T * H * 2), w(H * H * 2), c(T * H * 2);
  init_normal(Tensor(a.data(), DType::kBF16, {T, H}), 3, 0, 1.0f, stream);
  init_normal(Tensor(w.data(), DType::kBF16, {H, H}), 4, 0, 1.0f, stream);
  GemmRunner gemm(std::size_t{32} << 20, std::make_shared<GemmTuning>());
  const GemmShape shape{T, H, H, false, true, DType::kBF16, DType::kBF16, DType::kBF16};
  const auto work = [&] {
    for (int i = 0; i < products; ++i) gemm.run(shape, a.data(), w.data(), c.data(), stream);
  };
  const auto phased = [&] {
    block.forward_dispatch(x, options);
    work();
    block.forward_experts();
    work();
    (void)block.forward_combine();
    work();
    block.backward_combine(dy);
    work();
    block.backward_experts();
    work();
    (void)block.backward_dispatch();
  };
  const auto serial = [&] {
    (void)block.forward(x, options);
    (void)block.backward(dy);
    for (int k = 0; k < 5; ++k) work();
  };
  const auto alone = [&] {
    for (int k = 0; k < 5; ++k) work();
  };
  const auto timed = [&](const auto& body) {
    Event start(true), stop(true);
    std::vector<double> times;
    for (int i = 0; i < iters + 2; ++i) {
      start.record(stream);
      body();
      stop.record(stream);
      MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
      double ms = stop.elapsed_ms_since(start);
      MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
      if (i >= 2) times.push_back(ms);  // the first two choose the products' algorithms
    }
    return median(times);
  };
  // In turns, so that a drift of the clocks touches each alike.
  std::vector<double> phased_ms, serial_ms, other_ms;
  for (int round = 0; round < 3; ++round) {
    phased_ms.push_back(timed(phased));
    serial_ms.push_back(timed(serial));
    other_ms.push_back(timed(alone));
  }
  return {median(phased_ms), median(serial_ms), median(other_ms)};
}

}  // namespace moe::layer_timing
