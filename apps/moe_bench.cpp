// moe_bench: forward + backward of the MoE layer over an EP×DP mesh, one MPI rank per GPU.
//
//   mpirun -np N build/apps/moe_bench [--config configs/X.yaml] [--ep E --dp D] [--tokens T]
//                                      [--iters I] [--warmup W] [--grad-dtype bf16|fp32]
//                                      [--keep-expert-input] [--stage-lead-ms L]
//                                      [--capacity-factor C [--drop-policy P] [--pad-to-capacity]]
//                                      [--shared-ffn-hidden Fs] [--shared-in-series]
//                                      [--fp8 [--fp8-dispatch] [--micro-batches N]]
//                                      [--split-phase-products N] [--json FILE]
//   (and --ep-transport, --exchange-chunks, --align-size, --graph, --activation-chunk-mib,
//   --gemm-workspace-mib: --help lists every flag)
//
// Measures the ceilings first (dense bf16 GEMM rate under sustained load, copy bandwidth, p2p
// rate inside the EP group), then, after a warm-up as long as the GEMM rate's, times the layer
// with CUDA events: total, TFLOP/s, fractions of the GEMM and NVLink floors, device memory, and
// per-stage breakdown with each stage against its own floor. A table on rank 0; --json for the
// numbers.
//
// Each timed step starts on an idle GPU (the host waits for the step before), as the peer's steps
// do, so the step's first stages also hold the host's launch latency. The stages are timed in a
// second pass where the host queues each step behind a hold of --stage-lead-ms, as a layer inside
// a model is queued behind the layers before it: their times are the GPU's.
//
// --micro-batches N (with FP8) quantizes the expert weights on the first of every N steps only, the
// others passing weights_unchanged, as a trainer's micro-batches between two optimizer updates do;
// the step and its stages are then means over whole groups of N steps.
//
// --split-phase-products N also times what the split-phase calls hide: the step in its six calls
// with N dense [T, H] x [H, H] products of other work (a second micro-batch's attention) queued
// between each two, against the whole step followed by the same work.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <thread>
#include <tuple>

#include "bench/bench_util.h"
#include "bench/stage_floors.h"
#include "cli/checks.h"
#include "cli/output_file.h"
#include "comm/bootstrap.h"
#include "kernels/elementwise.cuh"
#include "kernels/fp8_quantize.cuh"
#include "layer_timing.h"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"

using namespace moe;
using layer_timing::median;

namespace {

// Holds the stream for the given milliseconds while the host runs ahead and queues what follows.
void CUDART_CB hold_stream(void* milliseconds) {
  std::this_thread::sleep_for(
      std::chrono::duration<double, std::milli>(*static_cast<const double*>(milliseconds)));
}

// The stages that move rows across the EP group.
constexpr const char* kExchangeStages[] = {"moe dispatch", "moe combine", "moe combine backward",
                                           "moe dispatch backward"};

std::size_t used_device_memory() {
  std::size_t free = 0, total = 0;
  MOE_CHECK_CUDA(cudaMemGetInfo(&free, &total));
  return total - free;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe_bench: forward and backward of the MoE layer over an EP x DP mesh"};
  cli::flags_take_no_value(app);
  std::string config_path = std::string(MOE_SOURCE_DIR) + "/configs/small.yaml";
  int ep = 0, dp = 0, tokens = 0, iters = 20, warmup = 5;
  std::string json_path, grad_dtype, ep_transport;
  bool keep_expert_input = false;
  double activation_chunk_mib = -1;
  int exchange_chunks = -1;
  int gemm_workspace_mib = -1;
  double stage_lead_ms = 1.0;
  double capacity_factor = -1;
  std::string drop_policy;
  bool pad_to_capacity = false;
  bool graph = false;
  bool fp8 = false;
  bool fp8_dispatch = false;
  int align_size = -1;
  int shared_ffn_hidden = -1;
  bool shared_in_series = false;
  int split_phase_products = 0;
  int micro_batches = 1;
  app.add_option("--config", config_path, "layer config (YAML)")->check(CLI::ExistingFile);
  app.add_option("--ep", ep, "expert-parallel degree (default: all ranks, or world / dp)")
      ->check(cli::count_in(1, 1 << 20));
  app.add_option("--dp", dp, "data-parallel degree (default: world / ep)")
      ->check(cli::count_in(1, 1 << 20));
  app.add_option("--tokens", tokens, "tokens per GPU (default: the config's)")
      ->check(cli::count_in(1, 1 << 30));
  app.add_option("--iters", iters, "timed iterations")->check(cli::count_in(1, 1000000));
  app.add_option("--warmup", warmup,
                 "untimed iterations first, then as many as reach the GPU's sustained clock (0: "
                 "none at all)")
      ->check(cli::count_in(0, 1000000));
  app.add_option("--grad-dtype", grad_dtype,
                 "expert weight gradients: bf16 or fp32 (default: the config's)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_flag("--keep-expert-input", keep_expert_input,
               "keep the experts' input X for the backward instead of permuting x again");
  app.add_option("--activation-chunk-mib", activation_chunk_mib,
                 "the SwiGLU output in chunks of at most this many MiB, 0: every row at once "
                 "(default: the config's)")
      ->check(cli::finite_in(0, 1048576));
  app.add_option("--gemm-workspace-mib", gemm_workspace_mib,
                 "cuBLASLt workspace per GEMM stream, MiB (default: the config's)")
      ->check(cli::count_in(0, 4096));
  app.add_option("--ep-transport", ep_transport,
                 "rows across the EP group: auto, nccl, peer or copy (default: the config's)")
      ->check(CLI::IsMember({"auto", "nccl", "peer", "copy"}));
  app.add_option("--exchange-chunks", exchange_chunks,
                 "the NCCL or copy exchange's pipeline in this many chunks of experts, 0: "
                 "automatic, 1: one piece (default: the config's)")
      ->check(cli::count_in(0, 1024));
  app.add_option("--stage-lead-ms", stage_lead_ms,
                 "time the stages with the host this many ms ahead of the GPU (0: behind it, as "
                 "in the timed steps)")
      ->check(cli::finite_in(0, 100));
  app.add_option("--capacity-factor", capacity_factor,
                 "capacity mode with this factor; 0 for dropless (default: the config's)")
      ->check(cli::finite_in(0, kMaxCapacityFactor));
  app.add_option("--drop-policy", drop_policy, "capacity mode's drop policy: probs or position")
      ->check(CLI::IsMember({"probs", "position"}));
  app.add_flag("--pad-to-capacity", pad_to_capacity,
               "capacity mode: every expert's block exactly C rows (fixed GEMM shapes)");
  app.add_flag("--fp8", fp8, "FP8 expert products (the config's fp8: true)");
  app.add_flag("--fp8-dispatch", fp8_dispatch,
               "with --fp8: E4M3 rows and scales toward the experts (the config's fp8_dispatch)");
  app.add_option("--shared-ffn-hidden", shared_ffn_hidden,
                 "shared experts of this width; 0 removes them and their gate (default: the "
                 "config's)")
      ->check(cli::count_in(0, 1 << 20));
  app.add_flag("--shared-in-series", shared_in_series,
               "the shared experts in series on the block's stream (shared_expert_overlap: "
               "false), to measure what their overlap hides");
  app.add_option("--align-size", align_size, "each expert's rows padded to a multiple of this")
      ->check(cli::count_in(0, kMaxAlignSize));
  app.add_flag("--graph", graph,
               "static shapes (--pad-to-capacity): the eager steps leave the losses on "
               "the device, then the step is captured in a CUDA graph and its replay timed too");
  app.add_option("--split-phase-products", split_phase_products,
                 "also time the split-phase step with N [T, H] x [H, H] products of other work "
                 "between each two of its calls, against the whole step and then that work")
      ->check(cli::count_in(0, 64));
  app.add_option("--micro-batches", micro_batches,
                 "with FP8: quantize the expert weights on the first of every N steps only, as "
                 "between two optimizer updates (the times then means over groups of N steps)")
      ->check(cli::count_in(1, 1024));
  app.add_option("--json", json_path, "write the numbers to this file (rank 0)");
  if (const auto exit_code = cli::parse_or_help(app, argc, argv)) return *exit_code;

  try {
    // The results are written after every step has run: what would make that fail is found now.
    if (app.count("--json") > 0)
      cli::check_output_file("--json", json_path, {{"--config", config_path}},
                             cli::Written::kInPlace);
    comm::MpiSession mpi(&argc, &argv);
    comm::require_same_settings(MPI_COMM_WORLD, cli::settings_text(argc, argv, config_path));
    const int world = mpi.size();
    const bool root = mpi.rank() == 0;
    auto config = load_config(config_path);
    std::tie(ep, dp) = cli::mesh_shape(ep, dp, world);
    config.ep = ep;
    config.dp = dp;
    if (tokens > 0) config.bench_tokens = tokens;
    if (!grad_dtype.empty()) config.grad_dtype = parse_dtype(grad_dtype, "--grad-dtype");
    if (keep_expert_input) config.keep_expert_input = true;
    if (activation_chunk_mib >= 0) config.activation_chunk_mib = activation_chunk_mib;
    if (gemm_workspace_mib >= 0) config.gemm_workspace_mib = gemm_workspace_mib;
    if (!ep_transport.empty()) config.ep_transport = parse_ep_transport(ep_transport);
    if (exchange_chunks >= 0) config.exchange_chunks = exchange_chunks;
    if (capacity_factor == 0 && pad_to_capacity)
      fail("--pad-to-capacity needs capacity mode, but --capacity-factor is 0");
    cli::apply_capacity_factor(config, capacity_factor);
    if (!drop_policy.empty()) config.drop_policy = parse_drop_policy(drop_policy);
    if (pad_to_capacity) config.pad_to_capacity = true;
    if (fp8) config.fp8 = true;
    if (fp8_dispatch) config.fp8_dispatch = true;
    if (align_size >= 0) config.align_size = align_size;
    if (shared_ffn_hidden >= 0) config.shared_ffn_hidden = shared_ffn_hidden;
    if (config.shared_ffn_hidden == 0) config.shared_gate = false;
    if (shared_in_series) {
      if (!config.shared_experts())
        fail("--shared-in-series: the layer has no shared experts (shared_ffn_hidden = 0)");
      config.shared_expert_overlap = false;
    }
    if (!drop_policy.empty() && !config.capacity_mode())
      fail("--drop-policy {} needs capacity mode (--capacity-factor, or the config's)",
           drop_policy);
    // The flags named where they ask for what the config's rules refuse.
    if (pad_to_capacity && !config.capacity_mode())
      fail("--pad-to-capacity needs capacity mode (--capacity-factor, or the config's)");
    if (fp8_dispatch && !config.fp8)
      fail("--fp8-dispatch needs FP8 experts (--fp8, or the config's fp8: true)");
    if (fp8 && (config.align_size <= 0 || config.align_size % 16 != 0))
      fail("--fp8 needs align_size a multiple of 16 (--align-size 16), {} is {}",
           align_size >= 0 ? "--align-size" : "the config's", config.align_size);
    if (fp8 && config.dtype != DType::kBF16)
      fail("--fp8 needs a bf16 layer; the config's dtype is {}", dtype_name(config.dtype));
    if (config.bench_tokens <= 0) fail("the config sets no token count; pass --tokens");
    cli::check_slots_fit(config.bench_tokens, config.topk);
    config.validate();
    if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
    if (graph && !config.pad_to_capacity)
      fail("--graph needs static shapes: capacity mode with pad_to_capacity (--pad-to-capacity)");
    if (micro_batches > 1) {
      if (!config.fp8)
        fail("--micro-batches {}: without fp8 (--fp8) a step quantizes no weights", micro_batches);
      if (graph || split_phase_products > 0)
        fail("--micro-batches {} times the eager step alone: drop {}", micro_batches,
             graph ? "--graph" : "--split-phase-products");
      if (iters % micro_batches != 0)
        fail("--iters {} is not a whole number of --micro-batches {}", iters, micro_batches);
    }
    // Every setting is checked first, on any machine.
    if (cuda_device_count() == 0) {
      if (root)
        std::fprintf(stderr, "moe_bench: no CUDA GPU on this machine; it needs at least one.\n");
      return 2;
    }

    const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, config.num_experts);
    Stream stream;
    const bench::GemmRate dense = bench::dense_gemm_rate(stream.get());
    const double gemm_rate = dense.sustained;
    const double copy_rate = bench::copy_bandwidth(stream.get());
    const double link_rate = layer_timing::p2p_rate(mesh, stream.get());

    // The communicators' buffers belong to the mesh (every layer and the trainer's reductions
    // share them; PyTorch's allocator statistics do not see them either): connected first.
    const std::size_t memory_unconnected = used_device_memory();
    mesh.connect(stream.get());
    const std::size_t memory_before = used_device_memory();
    const std::size_t mesh_memory = memory_before - memory_unconnected;
    const auto scratch = std::make_shared<MoEScratch>();  // what a model's layers would share
    MoEBlock block(config, mesh, stream.get(), scratch);
    block.initialize(1234);
    block.set_stage_timing(true);
    const std::int64_t T = config.bench_tokens, H = config.hidden;
    DeviceBuffer x(T * H * dtype_size(config.dtype)), dy(T * H * dtype_size(config.dtype));
    const Tensor x_t(x.data(), config.dtype, {T, H}), dy_t(dy.data(), config.dtype, {T, H});
    init_normal(x_t, 100 + mpi.rank(), 0, 1.0f, stream.get());
    init_normal(dy_t, 200 + mpi.rank(), 0, 1e-2f, stream.get());

    // With --graph the eager steps are the graph's: the losses stay on the device.
    ForwardOptions options;
    options.losses_on_host = !graph;
    // With --micro-batches N, the steps counted from `micro_batch` = 0 quantize the expert
    // weights on the first of every N.
    int micro_batch = 0;
    const auto next_options = [&] {
      options.weights_unchanged = micro_batch++ % micro_batches != 0;
      return options;
    };
    auto step = [&] {
      block.forward(x_t, next_options());
      block.backward(dy_t);
    };
    // Warm-up: `warmup` steps, then as many more as bring the GPU to its clock under sustained
    // load (bench::kSteadyStateMs), the state its GEMM ceiling was measured in. Every rank runs
    // the slowest rank's count, as the steps hold collectives.
    Event warm_start(true), warm_stop(true);
    warm_start.record(stream.get());
    for (int i = 0; i < warmup; ++i) step();
    warm_stop.record(stream.get());
    stream.synchronize();
    const std::size_t memory_peak = used_device_memory() - memory_before;
    const double warm_step_ms = warm_stop.elapsed_ms_since(warm_start) / std::max(warmup, 1);
    // As a trainer's first reduce_gradients does: the ranks agree on the GEMM algorithms, so the
    // steps timed run as a trainer's later steps do (docs/design.md, "Pipelined exchange").
    block.reduce_gradients();
    // --warmup 0 asks for none: its "step time" would be two events' gap, and the steady state's
    // count from it tens of thousands of steps.
    int more_steps = warmup > 0 && warm_step_ms > 0
                         ? static_cast<int>(std::min(bench::kSteadyStateMs / warm_step_ms, 1e5))
                         : 0;
    MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &more_steps, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    for (int i = 0; i < more_steps; ++i) step();

    // `iters` steps, each queued behind a hold of lead_ms (none at 0): their times (the slowest
    // rank's), and with `stages` the stage times added up.
    std::map<std::string, double> stage_sum;
    std::vector<std::string> stage_order;
    Event start(true), stop(true);
    // The host's side of the unheld steps: the time inside forward() (its one wait for the row
    // counts included) and inside backward() (queueing alone), and the host waits per step.
    std::vector<double> host_forward_ms, host_backward_ms;
    const std::int64_t waits_before = mesh.host_waits();
    const auto host_ms = [](auto from, auto to) {
      return std::chrono::duration<double, std::milli>(to - from).count();
    };
    auto timed_steps = [&](double lead_ms, bool stages) {
      std::vector<double> times;
      micro_batch = 0;
      for (int i = 0; i < iters; ++i) {
        if (lead_ms > 0) MOE_CHECK_CUDA(cudaLaunchHostFunc(stream.get(), hold_stream, &lead_ms));
        start.record(stream.get());
        const auto called = std::chrono::steady_clock::now();
        block.forward(x_t, next_options());
        const auto forwarded = std::chrono::steady_clock::now();
        block.backward(dy_t);
        const auto queued = std::chrono::steady_clock::now();
        if (lead_ms == 0) {
          host_forward_ms.push_back(host_ms(called, forwarded));
          host_backward_ms.push_back(host_ms(forwarded, queued));
        }
        stop.record(stream.get());
        MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
        double ms = stop.elapsed_ms_since(start);
        MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX,
                                    MPI_COMM_WORLD));  // the slowest rank
        times.push_back(ms);
        for (const auto& s : stages ? block.stage_times() : std::vector<MoEBlock::StageTime>{}) {
          if (!stage_sum.count(s.name)) stage_order.push_back(s.name);
          stage_sum[s.name] += s.ms;
        }
        if (root && iters > 20 && (i + 1) % 10 == 0)
          std::fprintf(stderr, "moe_bench: %d / %d iterations\n", i + 1, iters);
      }
      return times;
    };
    const std::vector<double> totals = timed_steps(0.0, stage_lead_ms == 0.0);
    const double host_waits_per_step =
        static_cast<double>(mesh.host_waits() - waits_before) / std::max(iters, 1);
    const std::vector<double> led_totals =
        stage_lead_ms > 0.0 ? timed_steps(stage_lead_ms, true) : totals;
    // The same step captured once and replayed: its GPU time and the host's time to launch it.
    // Each replay is timed beside an eager step, the two alternating, so that a clock that drifts
    // over the run (a GPU that heats under sustained load) weighs on both alike: the comparison
    // takes these eager steps, not the ones above.
    std::vector<double> graph_ms, graph_host_ms, paired_eager_ms;
    std::size_t graph_nodes = 0;  // what the host's launch time grows with
    // The fastest launch: the graph's own cost, which the host's noise only adds to.
    double fastest_launch_ms = 0.0;
    // The forwards the load statistics add on the device beyond those the host counts: every
    // replay, less the captured call, which the host counts and the device never ran.
    std::int64_t replays_uncounted = 0;
    if (graph) {
      block.set_stage_timing(false);
      const CudaGraph captured(stream.get(), step);
      graph_nodes = captured.nodes();
      for (int i = 0; i < warmup; ++i) captured.replay(stream.get());
      replays_uncounted = warmup + iters - 1;
      const auto timed = [&](auto&& run) {
        start.record(stream.get());
        run();
        stop.record(stream.get());
        MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
        double ms = stop.elapsed_ms_since(start);
        MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
        return ms;
      };
      for (int i = 0; i < iters; ++i) {
        paired_eager_ms.push_back(timed(step));
        graph_ms.push_back(timed([&] {
          const auto called = std::chrono::steady_clock::now();
          captured.replay(stream.get());
          graph_host_ms.push_back(host_ms(called, std::chrono::steady_clock::now()));
        }));
      }
      fastest_launch_ms = *std::min_element(graph_host_ms.begin(), graph_host_ms.end());
    }
    ForwardOptions split_options = options;  // quantizing every step's weights, if FP8
    split_options.weights_unchanged = false;
    const layer_timing::SplitPhaseTimes split =
        split_phase_products > 0
            ? layer_timing::time_split_phase(block, x_t, dy_t, split_options, split_phase_products,
                                             iters, stream.get())
            : layer_timing::SplitPhaseTimes{};
    const double reduce_ms = bench::median_ms([&](int) { block.reduce_gradients(); }, stream.get(),
                                              1, std::max(3, iters / 4));
    // The routing's balance over every step run (the mesh's loads, counted on the device).
    block.synchronize();
    const MoELoadStatistics load_stats = block.load_statistics();
    std::vector<std::int64_t> load(static_cast<std::size_t>(config.num_experts));
    copy_to_host(load.data(), load_stats.tokens_per_expert.data, load.size() * sizeof(load[0]));
    const LoadImbalance imbalance = load_imbalance(load, ep);
    // Capacity mode: the share of the mesh's slots dropped over the same steps.
    double dropped_fraction = 0.0;
    if (config.capacity_mode()) {
      std::vector<std::int64_t> dropped(load.size());
      copy_to_host(dropped.data(), load_stats.dropped_per_expert.data,
                   dropped.size() * sizeof(dropped[0]));
      const double routed = std::accumulate(load.begin(), load.end(), 0.0);
      if (routed > 0)
        dropped_fraction = std::accumulate(dropped.begin(), dropped.end(), 0.0) / routed;
    }

    // Useful work: gate 6·T·E·H, experts 18·(T·K)·H·F (forward + backward, padding excluded).
    const double E = config.num_experts, K = config.topk, F = config.ffn_hidden;
    const double flops = 6.0 * T * E * H + 18.0 * T * K * H * F;
    // A group of micro-batches holds one quantization: its mean, not the median step.
    const auto step_ms = [&](const std::vector<double>& times) {
      return micro_batches > 1 ? std::accumulate(times.begin(), times.end(), 0.0) / times.size()
                               : median(times);
    };
    const double total_ms = step_ms(totals);
    const double tflops = flops / (total_ms * 1e-3) / 1e12;
    // Rows leaving this rank per step (uniform routing): dispatch and combine, forward and
    // backward.
    // fp8_dispatch: the rows toward the experts go as E4M3 records.
    const double row_bytes = static_cast<double>(H * dtype_size(config.dtype));
    const double toward_experts_bytes =
        config.fp8_dispatch ? static_cast<double>(fp8_row_bytes(H)) : row_bytes;
    const double link_bytes = 2.0 * T * K * (row_bytes + toward_experts_bytes) * (ep - 1) / ep;
    const double link_floor_ms = link_rate > 0 ? link_bytes / link_rate * 1e3 : 0.0;

    // Each stage's roofline floor at this run's ceilings (bench/stage_floors.h): FLOPs at the
    // sustained GEMM rate, the bytes it must read and write (weights, weight gradients,
    // activations) at the copy rate, the rows it must send at the p2p rate. The step's floor adds
    // them up; the gradient reduction is timed, and judged, apart.
    const bench::Rates rates{gemm_rate, copy_rate, link_rate};
    const auto work = bench::stage_work(config, T, block.probabilities_in_experts());
    std::map<std::string, double> floors;
    for (const auto& stage : work) {
      if (stage.flops > 0 || stage.bytes > 0) floors[stage.name] = stage.floor_ms(rates);
    }
    const double step_floor_ms = bench::step_floor_ms(work, rates);
    const double reduce_floor_ms = bench::gradient_reduction_work(config).floor_ms(rates);

    if (root) {
      fmt::print("moe_bench {} on {} rank(s), EP={} DP={}, {} tokens per GPU{}\n",
                 std::filesystem::path(config_path).filename().string(), world, ep, dp, T,
                 ep > 1 ? fmt::format(", EP rows over {}", ep_transport_name(block.ep_transport()))
                        : std::string());
      fmt::print("{}\n{}", config.describe(), describe_devices());
      fmt::print(
          "ceilings per GPU: dense bf16 GEMM {:.0f} TFLOP/s sustained ({:.0f} in a burst), copy "
          "{:.0f} GB/s, p2p {:.0f} GB/s\n",
          gemm_rate / 1e12, dense.burst / 1e12, copy_rate / 1e9, link_rate / 1e9);
      if (stage_lead_ms > 0)
        fmt::print("stages timed with the host {:.1f} ms ahead (the step {:.3f} ms there)\n",
                   stage_lead_ms, step_ms(led_totals));
      if (micro_batches > 1)
        fmt::print(
            "expert weights quantized on one step in {}: the step and stage times are means\n",
            micro_batches);
      fmt::print("{:<26} {:>10} {:>7} {:>10} {:>9}\n", "stage (rank 0, mean)", "ms", "share",
                 "floor ms", "of floor");
      for (const auto& name : stage_order) {
        const double ms = stage_sum[name] / iters;
        const auto floor = floors.find(name);
        if (floor == floors.end()) {
          fmt::print("{:<26} {:>10.3f} {:>6.1f}%\n", name, ms, 100.0 * ms / total_ms);
        } else {
          fmt::print("{:<26} {:>10.3f} {:>6.1f}% {:>10.3f} {:>8.0f}%\n", name, ms,
                     100.0 * ms / total_ms, floor->second, 100.0 * floor->second / ms);
        }
      }
      fmt::print("{:<26} {:>10.3f} {:>7} {:>10.3f} {:>8.0f}%\n", "forward + backward", total_ms, "",
                 step_floor_ms, 100.0 * step_floor_ms / total_ms);
      if (reduce_floor_ms > 0) {
        fmt::print("{:<26} {:>10.3f} {:>7} {:>10.3f} {:>8.0f}%\n", "gradient reduction", reduce_ms,
                   "", reduce_floor_ms, 100.0 * reduce_floor_ms / reduce_ms);
      } else {
        fmt::print("{:<26} {:>10.3f}\n", "gradient reduction", reduce_ms);
      }
      fmt::print(
          "throughput: {:.0f} TFLOP/s per GPU, {:.0f}% of the dense GEMM rate; {:.0f} tokens/s per "
          "GPU\n",
          tflops, 100.0 * tflops * 1e12 / gemm_rate, T / (total_ms * 1e-3));
      fmt::print(
          "host per step: {:.3f} ms in forward() (its wait for the row counts included), {:.3f} ms "
          "queueing backward(); {:.2f} host waits\n",
          median(host_forward_ms), median(host_backward_ms), host_waits_per_step);
      if (graph) {
        fmt::print(
            "CUDA graph replay: {:.3f} ms per step against {:.3f} eager (the steps alternating), "
            "the host {:.1f} us to launch its {} nodes (fastest {:.1f} us; {:.1f} us to queue the "
            "eager step)\n",
            median(graph_ms), median(paired_eager_ms), 1e3 * median(graph_host_ms), graph_nodes,
            1e3 * fastest_launch_ms, 1e3 * (median(host_forward_ms) + median(host_backward_ms)));
      }
      if (split_phase_products > 0) {
        double exchange_ms = 0.0;
        for (const char* name : kExchangeStages)
          exchange_ms += stage_sum.count(name) > 0 ? stage_sum[name] / iters : 0.0;
        const double saved = split.serial_ms - split.phased_ms;
        fmt::print(
            "split-phase calls, {} products of other work between each two: {:.3f} ms, against "
            "{:.3f} ms for the whole step then the work ({:.3f} ms alone): {:.3f} ms hidden, "
            "{:.0f}% "
            "of the exchange stages' {:.3f} ms\n",
            5 * split_phase_products, split.phased_ms, split.serial_ms, split.other_ms, saved,
            exchange_ms > 0 ? 100.0 * saved / exchange_ms : 0.0, exchange_ms);
      }
      if (link_floor_ms > 0)
        fmt::print("NVLink floor {:.3f} ms ({:.0f}% of the step)\n", link_floor_ms,
                   100 * link_floor_ms / total_ms);
      fmt::print("load over {} steps: max/mean {:.2f} per expert, {:.2f} per EP rank\n",
                 load_stats.steps + replays_uncounted, imbalance.expert, imbalance.ep_rank);
      if (config.capacity_mode())
        fmt::print("capacity mode: {:.2f}% of the slots dropped over those steps\n",
                   100.0 * dropped_fraction);
      fmt::print(
          "device memory of the layer: {:.2f} GiB ({:.1f} KiB per token), of which {:.2f} GiB "
          "scratch that a model's layers share; the mesh's communicators took {:.2f} GiB "
          "before\n",
          static_cast<double>(memory_peak) / (1 << 30), static_cast<double>(memory_peak) / 1024 / T,
          static_cast<double>(scratch->bytes()) / (1 << 30),
          static_cast<double>(mesh_memory) / (1 << 30));
      if (!json_path.empty()) {
        nlohmann::json report = {
            {"config", config.describe()},
            {"config_file", std::filesystem::path(config_path).filename().string()},
            {"device", bench::device_name()},
            {"ranks", world},
            {"ep", ep},
            {"dp", dp},
            {"ep_transport", ep_transport_name(block.ep_transport())},
            {"exchange_chunks", block.ep_transport() == EpTransport::kNccl ||
                                        block.ep_transport() == EpTransport::kCopy
                                    ? config.effective_exchange_chunks()
                                    : 1},
            {"activation_chunk_mib", config.activation_chunk_mib},
            {"gemm_workspace_mib", config.gemm_workspace_mib},
            {"tokens_per_gpu", T},
            {"dense_TFLOPs", gemm_rate / 1e12},
            {"dense_TFLOPs_burst", dense.burst / 1e12},
            {"copy_GBps", copy_rate / 1e9},
            {"p2p_GBps", link_rate / 1e9},
            {"total_ms", total_ms},
            // Every run's mean too, so that runs with and without --micro-batches compare alike.
            {"total_ms_mean", std::accumulate(totals.begin(), totals.end(), 0.0) /
                                  static_cast<double>(std::max<std::size_t>(totals.size(), 1))},
            {"stage_lead_ms", stage_lead_ms},
            {"total_ms_host_ahead", step_ms(led_totals)},
            {"reduce_ms", reduce_ms},
            {"host_forward_ms", median(host_forward_ms)},
            {"host_backward_ms", median(host_backward_ms)},
            {"host_waits_per_step", host_waits_per_step},
            {"step_floor_ms", step_floor_ms},
            {"reduce_floor_ms", reduce_floor_ms},
            {"load_imbalance_expert", imbalance.expert},
            {"load_imbalance_ep_rank", imbalance.ep_rank},
            {"load_steps", load_stats.steps + replays_uncounted},
            {"capacity_factor", config.capacity_factor},
            {"pad_to_capacity", config.pad_to_capacity},
            {"dropped_fraction", dropped_fraction},
            {"grad_dtype", dtype_name(config.grad_dtype)},
            {"fp8", config.fp8},
            {"fp8_dispatch", config.fp8_dispatch},
            {"micro_batches", micro_batches},
            {"align_size", config.align_size},
            {"shared_ffn_hidden", config.shared_ffn_hidden},
            {"shared_gate", config.shared_gate},
            {"shared_expert_overlap", config.shared_expert_overlap},
            {"keep_expert_input", config.keep_expert_input},
            {"TFLOPs_per_gpu", tflops},
            {"fraction_of_dense", tflops * 1e12 / gemm_rate},
            {"fraction_of_dense_burst", tflops * 1e12 / dense.burst},
            {"link_floor_ms", link_floor_ms},
            {"memory_bytes", memory_peak},
            {"scratch_bytes", scratch->bytes()},
            {"mesh_memory_bytes", mesh_memory}};
        if (split_phase_products > 0) {
          report["split_phase_products"] = 5 * split_phase_products;
          report["split_phase_ms"] = split.phased_ms;
          report["split_phase_serial_ms"] = split.serial_ms;
          report["split_phase_other_ms"] = split.other_ms;
        }
        if (graph) {
          report["graph_ms"] = median(graph_ms);
          report["graph_paired_eager_ms"] = median(paired_eager_ms);
          report["graph_host_launch_ms"] = median(graph_host_ms);
          report["graph_host_launch_min_ms"] = fastest_launch_ms;
          report["graph_nodes"] = graph_nodes;
        }
        for (const auto& name : stage_order) {
          report["stages_ms"][name] = stage_sum[name] / iters;
          if (floors.count(name)) report["stages_floor_ms"][name] = floors.at(name);
        }
        std::ofstream json(json_path);
        json << report.dump(2) << "\n";
        json.close();
        if (!json) fail("cannot write --json '{}'", json_path);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 1;
  }
}
