// moe_run: one forward and backward of the layer on tensors from safetensors files, every result
// written to a safetensors file, so the layer can be checked against PyTorch or any framework.
//
//   mpirun -np N build/apps/moe_run --config C.yaml --weights W.safetensors --inputs I.safetensors
//                                   --out R.safetensors [--ep E --dp D]
//   build/apps/moe_run ... --reference     # the fp64 CPU reference instead of the GPUs
//   build/apps/moe_run ... --no-check-finite   # no NaN/Inf (or bf16 overflow) check of the files
//   build/apps/moe_run ... --record-routing R.safetensors   # the step's topk_idx, alone, to R
//   build/apps/moe_run ... --replay-routing R.safetensors   # run with R's topk_idx as the routing
//
// In capacity mode each rank drops from its own tokens (C from its own T), while --reference
// runs the whole batch as one rank: with several ranks the two differ by design
// (docs/design.md, "Capacity mode").
//
// The files hold the global batch and all experts (names and layouts: io/layer_files.h). No rank
// reads them whole: the headers and the small tensors are checked first, then each rank reads its
// experts' slices and its tokens' rows (io/rank_inputs.h), and rank 0 writes the results file
// piece by piece as the ranks send their parts, so that a layer of deepseek-v3's size runs with a
// rank's share of host memory. --reference streams the experts one at a time (io/expert_streams.h).
//
// Failures and the mesh. MPI cannot cancel a collective, so a rank that fails alone between two
// collectives would leave the others waiting forever. Hence, in order:
//   1. everything that holds for the files as a whole (names, dtypes, shapes, tokens_per_rank,
//      topk_idx) is checked on every rank alike before MPI starts: a bad file stops all at once;
//   2. each rank reads and checks (NaN, Inf) its own share, then all ranks agree on the outcome in
//      one collective that every rank reaches (reading never waits on another rank): either all
//      go on, or all stop with the first failing rank's message, before NCCL starts;
//   3. after that, a rank that fails (a CUDA error, a full disk while rank 0 writes) prints its
//      error and ends the whole job with MPI_Abort, before tearing down anything its peers wait
//      on.
#include <mpi.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <utility>

#include "cli/checks.h"
#include "cli/output_file.h"
#include "cli/remove_on_signal.h"
#include "comm/bootstrap.h"
#include "io/expert_streams.h"
#include "io/layer_files.h"
#include "io/rank_inputs.h"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "reference/reference.h"

using namespace moe;

namespace {

void upload(const Tensor& dst, std::span<const std::byte> bytes) {
  if (bytes.size() != dst.bytes()) fail("moe_run: {} bytes for {}", bytes.size(), dst.describe());
  copy_to_device(dst.data, bytes.data(), bytes.size());
}

// Elements [first, first + count) of a device tensor as the results file stores them: F32 for a
// bf16 or fp32 tensor, the int32 values as I32.
std::vector<std::byte> download_piece(const Tensor& t, std::int64_t first, std::int64_t count) {
  const auto n = static_cast<std::size_t>(count);
  const auto* src = static_cast<const std::byte*>(t.data) + first * dtype_size(t.dtype);
  std::vector<std::byte> out(n * 4);
  if (t.dtype == DType::kBF16) {
    std::vector<BF16> raw(n);
    copy_to_host(raw.data(), src, n * 2);
    for (std::size_t i = 0; i < n; ++i) {
      const float v = from_bf16(raw[i]);
      std::memcpy(out.data() + i * 4, &v, 4);
    }
  } else {
    copy_to_host(out.data(), src, n * 4);
  }
  return out;
}

// The agreement before NCCL starts (see the file comment): every rank passes its own error (empty:
// none) and either all ranks return or all throw the first failing rank's message. Three
// collectives at most, reached by every rank.
void agree_on_errors(const std::string& error, int rank, int world) {
  if (world == 1) {
    if (!error.empty()) fail("{}", error);
    return;
  }
  int failed = error.empty() ? world : rank;
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (failed == world) return;
  constexpr std::size_t kMaxMessage = 4096;  // messages name a file and a tensor: short
  std::string message = rank == failed ? error.substr(0, kMaxMessage) : std::string();
  int length = static_cast<int>(message.size());
  MOE_CHECK_MPI(MPI_Bcast(&length, 1, MPI_INT, failed, MPI_COMM_WORLD));
  message.resize(static_cast<std::size_t>(length));
  MOE_CHECK_MPI(MPI_Bcast(message.data(), length, MPI_CHAR, failed, MPI_COMM_WORLD));
  fail("rank {} of {} failed reading its part of the files: {}", failed, world, message);
}

// A function giving elements [first, first + count) of this rank's part of a result tensor, as
// the file stores them (download_piece of a device tensor).
using PieceSource = std::function<std::vector<std::byte>(std::int64_t first, std::int64_t count)>;

// Result tensor `name`, spread over `owners` in the order their parts follow each other in the
// file (owner i holds counts[i] elements): rank 0 appends its own part and each other owner's as
// it arrives; the other owners send theirs. The parts travel in pieces of kPieceElements with
// 64-bit offsets, so no count passes MPI's int and no rank holds more than one piece of it in
// host memory. Every rank calls this for the same tensors in the same order, and rank 0 receives
// in exactly the order each sender sends: no wait can close a cycle.
void collect(TensorFileWriter* writer, const std::string& name, std::span<const int> owners,
             std::span<const std::int64_t> counts, int rank, int tag, const PieceSource& local) {
  const auto mine = std::find(owners.begin(), owners.end(), rank);
  if (rank != 0) {
    if (mine == owners.end()) return;
    const std::int64_t count = counts[mine - owners.begin()];
    for (std::int64_t first = 0; first < count; first += kPieceElements) {
      const std::int64_t n = std::min(kPieceElements, count - first);
      std::vector<std::byte> piece = local(first, n);
      if (piece.size() != static_cast<std::size_t>(n) * 4)
        fail("moe_run: rank {} has {} bytes of '{}' for {} elements", rank, piece.size(), name, n);
      MOE_CHECK_MPI(
          MPI_Send(piece.data(), static_cast<int>(piece.size()), MPI_BYTE, 0, tag, MPI_COMM_WORLD));
    }
    return;
  }
  for (std::size_t i = 0; i < owners.size(); ++i) {
    for (std::int64_t first = 0; first < counts[i]; first += kPieceElements) {
      const std::int64_t n = std::min(kPieceElements, counts[i] - first);
      std::vector<std::byte> piece(static_cast<std::size_t>(n) * 4);
      if (owners[i] == 0) {
        piece = local(first, n);
      } else {
        MPI_Status status;
        MOE_CHECK_MPI(MPI_Recv(piece.data(), static_cast<int>(piece.size()), MPI_BYTE, owners[i],
                               tag, MPI_COMM_WORLD, &status));
        int received = 0;
        MOE_CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &received));
        if (static_cast<std::size_t>(received) != piece.size())
          fail("moe_run: rank {} sent {} bytes of '{}', expected {}", owners[i], received, name,
               piece.size());
      }
      writer->append(name, piece);
    }
  }
}

// This rank's part of a result tensor: a device tensor of `count` elements.
PieceSource device_part(const std::string& name, const Tensor& t, std::int64_t count, int rank) {
  if (t.numel() != count)
    fail("moe_run: rank {} holds {} elements of '{}', expected {}", rank, t.numel(), name, count);
  return [t](std::int64_t first, std::int64_t n) { return download_piece(t, first, n); };
}

// What the files ask for that the reference, one rank over the whole batch, does not do: said on
// stderr rather than left aside without a word (the run goes on).
void note_one_rank(const MoEConfig& config, const TensorSource& inputs) {
  std::vector<std::string> unused;
  if (config.ep > 1 || config.dp > 1)
    unused.push_back(
        fmt::format("the config's mesh (ep = {}, dp = {}){}", config.ep, config.dp,
                    config.node_limited_routing() ? " beyond its nodes' routing" : ""));
  if (inputs.contains("tokens_per_rank")) unused.push_back("the inputs' tokens_per_rank");
  if (unused.empty()) return;
  std::fprintf(
      stderr, "moe_run: note: --reference runs the batch as one rank, so %s %s no effect%s\n",
      fmt::format("{}", fmt::join(unused, " and ")).c_str(), unused.size() == 1 ? "has" : "have",
      config.capacity_mode() ? "; each expert's capacity comes from all the batch's "
                               "tokens, not a rank's (docs/design.md, \"Capacity mode\")"
                             : "");
}

int run_reference(const MoEConfig& config, const TensorSource& weights, const TensorSource& inputs,
                  const TensorSource* routing, bool check_finite_values,
                  const std::string& out_path) {
  const LayerInputs in = read_layer_inputs_without_experts(config, weights, inputs, routing);
  if (check_finite_values) {
    // As the layer holds them: bf16 may overflow; the expert bias stays fp32 (io/rank_inputs.cpp).
    constexpr std::string_view kHeldInFp32[] = {"expert_bias"};
    check_finite(weights, config.dtype, kHeldInFp32);
    check_finite(inputs, config.dtype);
  }
  reference::LayerOptions options;
  if (in.replay_experts) options.replay_experts = *in.replay_experts;
  auto metadata = layer_results_metadata(config);
  // Exact gradients, whatever grad_dtype says the GPU layer rounds them to.
  metadata["computed_by"] = "the fp64 reference on the CPU, rounded to F32 once";
  TensorFileWriter writer(out_path, layer_results_specs(config, in.x.rows), metadata);
  const cli::RemoveOnSignal remove_if_killed(writer.writing_path());
  if (check_finite_values) writer.refuse_non_finite();
  const FileExperts experts(config, weights);
  FileExpertGrads expert_grads(config, writer);
  const auto result =
      reference::run_layer(config, in.params, experts, in.x, in.dy, expert_grads, options);
  write_layer_results(writer, config, result);
  writer.finish();
  std::printf("moe_run: fp64 reference over %lld tokens written to %s\n",
              static_cast<long long>(in.x.rows), out_path.c_str());
  return 0;
}

// --record-routing: the step's routing, as the results file just written holds it, to a file of
// its own that --replay-routing reads back (rank 0, after the results).
void record_routing(const MoEConfig& config, const std::string& out_path,
                    const std::string& record_path) try {
  const TensorFileReader results(out_path);
  const FileTensor idx = results.read_tensor("topk_idx");
  std::vector<std::int32_t> experts(idx.data.size() / sizeof(std::int32_t));
  if (!experts.empty()) std::memcpy(experts.data(), idx.data.data(), idx.data.size());
  routing_file(config, experts).write(record_path);
  std::printf("moe_run: the step's routing (topk_idx) written to %s\n", record_path.c_str());
} catch (const Error& e) {
  fail("--record-routing: the results are in {}, but the routing was not written: {}", out_path,
       e.what());
}

// After the agreement: this rank's share on its GPU, forward, backward, the results to rank
// 0's file.
void run_rank(const MoEConfig& config, RankInputs in, const CheckedLayerFiles& checked, int rank,
              int world, bool check_finite_values, const std::string& out_path, const Mesh& mesh,
              MoEBlock& block, const Stream& stream) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden,
                     K = config.topk, T = in.tokens;
  if (mesh.rank() != rank)
    fail("moe_run: the mesh has this process as rank {}, MPI as {}", mesh.rank(), rank);
  const auto& p = block.parameters();
  upload(p.gate_weight, in.gate_weight);
  upload(p.w13, in.w13);
  upload(p.w2, in.w2);
  upload(p.expert_bias, std::as_bytes(std::span(in.expert_bias)));
  if (config.shared_experts()) {
    upload(p.shared_w13, in.shared_w13);
    upload(p.shared_w2, in.shared_w2);
  }
  if (config.shared_gate) upload(p.shared_gate_weight, in.shared_gate_weight);
  DeviceBuffer x(std::max<std::int64_t>(T * H, 1) * dtype_size(config.dtype)), dy(x.bytes());
  const Tensor x_t(x.data(), config.dtype, {T, H}), dy_t(dy.data(), config.dtype, {T, H});
  upload(x_t, in.x);
  upload(dy_t, in.dy);
  ForwardOptions options;
  DeviceBuffer replay;
  if (checked.replay_experts) {
    replay.reserve(std::max<std::int64_t>(T * K, 1) * 4);
    options.replay_topk_idx = Tensor(replay.data(), DType::kInt32, {T, K});
    upload(options.replay_topk_idx, std::as_bytes(std::span(in.topk_idx)));
  }
  in = RankInputs{};  // on the GPU now: the host copies go

  const auto fwd = block.forward(x_t, options);
  const Tensor dx = block.backward(dy_t);
  block.reduce_gradients();
  stream.synchronize();

  const auto routing = block.routing();
  std::vector<std::int32_t> load(static_cast<std::size_t>(E));
  copy_to_host(load.data(), routing.tokens_per_expert.data, load.size() * 4);
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, load.data(), static_cast<int>(E), MPI_INT32_T, MPI_SUM,
                              MPI_COMM_WORLD));
  // Capacity mode: the drops summed over the ranks (each rank drops from its own tokens).
  std::vector<std::int32_t> dropped(static_cast<std::size_t>(E), 0);
  if (config.capacity_mode()) {
    copy_to_host(dropped.data(), routing.dropped_per_expert.data, dropped.size() * 4);
    MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, dropped.data(), static_cast<int>(E), MPI_INT32_T,
                                MPI_SUM, MPI_COMM_WORLD));
  }

  // Rank 0 writes the header now (every shape is known) and then each tensor as it comes.
  const std::vector<std::int64_t> split = checked.split(world);
  std::unique_ptr<TensorFileWriter> writer;
  std::optional<cli::RemoveOnSignal> remove_if_killed;  // mpirun ends the ranks with SIGTERM
  if (rank == 0) {
    writer = std::make_unique<TensorFileWriter>(
        out_path, layer_results_specs(config, checked.tokens), layer_results_metadata(config));
    remove_if_killed.emplace(writer->writing_path());
    if (check_finite_values) writer->refuse_non_finite();
  }
  std::vector<int> all_ranks(static_cast<std::size_t>(world));
  std::iota(all_ranks.begin(), all_ranks.end(), 0);
  std::vector<std::int64_t> rows_h, rows_k;
  for (const auto tokens : split) rows_h.push_back(tokens * H), rows_k.push_back(tokens * K);
  // Rank r's part of a tensor over all ranks: its tokens' rows.
  const auto tokens_part = [&](const char* name, const Tensor& t, std::int64_t width) {
    return device_part(name, t, split[static_cast<std::size_t>(rank)] * width, rank);
  };
  collect(writer.get(), "out", all_ranks, rows_h, rank, 1, tokens_part("out", fwd.out, H));
  collect(writer.get(), "dx", all_ranks, rows_h, rank, 2, tokens_part("dx", dx, H));
  collect(writer.get(), "topk_p", all_ranks, rows_k, rank, 3,
          tokens_part("topk_p", routing.topk_p, K));
  collect(writer.get(), "topk_idx", all_ranks, rows_k, rank, 4,
          tokens_part("topk_idx", routing.topk_idx, K));
  if (config.capacity_mode())
    collect(writer.get(), "kept", all_ranks, rows_k, rank, 7, tokens_part("kept", routing.kept, K));
  // Ranks 0 .. EP-1 (DP index 0) hold the DP-summed gradients of consecutive expert slices.
  const std::vector<int> ep_ranks(all_ranks.begin(), all_ranks.begin() + config.ep);
  const std::int64_t local = config.local_experts();
  const std::vector<std::int64_t> w13_counts(ep_ranks.size(), local * 2 * F * H),
      w2_counts(ep_ranks.size(), local * H * F);
  const auto& g = block.gradients();
  collect(writer.get(), "grad.w13", ep_ranks, w13_counts, rank, 5,
          device_part("grad.w13", g.w13, w13_counts.front(), rank));
  collect(writer.get(), "grad.w2", ep_ranks, w2_counts, rank, 6,
          device_part("grad.w2", g.w2, w2_counts.front(), rank));
  if (rank != 0) return;

  // Rank 0's own: the losses are mesh-wide, the gate's and the shared experts' gradients summed
  // over the world by reduce_gradients.
  const auto whole = [&](const char* name, const Tensor& t) {
    for (std::int64_t first = 0; first < t.numel(); first += kPieceElements)
      writer->append(name, download_piece(t, first, std::min(kPieceElements, t.numel() - first)));
  };
  writer->append("aux_loss", &fwd.aux_loss, 4);
  writer->append("z_loss", &fwd.z_loss, 4);
  writer->append("tokens_per_expert", load.data(), load.size() * 4);
  if (!config.capacity_mode()) {  // dropless: every slot kept
    const std::vector<std::int32_t> kept(static_cast<std::size_t>(checked.tokens * K), 1);
    writer->append("kept", kept.data(), kept.size() * 4);
  }
  writer->append("dropped_per_expert", dropped.data(), dropped.size() * 4);
  whole("grad.gate_weight", g.gate_weight);
  if (config.shared_experts()) {
    whole("grad.shared_w13", g.shared_w13);
    whole("grad.shared_w2", g.shared_w2);
  }
  if (config.shared_gate) whole("grad.shared_gate_weight", g.shared_gate_weight);
  writer->finish();
  std::printf("moe_run: %d rank(s), EP=%d DP=%d, %lld tokens; results written to %s\n", world,
              config.ep, config.dp, static_cast<long long>(checked.tokens), out_path.c_str());
}

// Fixed blocks under EP take C from each rank's T: an EP group (ranks d·EP … d·EP + EP − 1) must
// hold one T. Known from the files on every rank, so all stop alike, before a GPU is looked for.
void check_ep_groups_hold_one_t(const MoEConfig& config, std::span<const std::int64_t> split) {
  if (!config.pad_to_capacity || config.ep <= 1) return;
  for (std::size_t first = 0; first < split.size(); first += static_cast<std::size_t>(config.ep)) {
    const auto group = split.subspan(first, static_cast<std::size_t>(config.ep));
    if (std::adjacent_find(group.begin(), group.end(), std::not_equal_to<>()) != group.end())
      fail(
          "pad_to_capacity under EP needs the same tokens on every rank of an EP group, but the "
          "tokens split gives ranks {}..{} {} tokens (tokens_per_rank, or the batch split evenly)",
          first, first + static_cast<std::size_t>(config.ep) - 1, fmt::join(group, ", "));
  }
}

// The ranks an MPI launcher started this process among (1 without one), as its environment says
// before MPI is initialised: Open MPI's OMPI_COMM_WORLD_SIZE, or a PMI launcher's PMI_SIZE
// (MPICH's Hydra).
int launched_ranks() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    int ranks = 0;
    const std::string_view text(value);
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), ranks);
    if (error == std::errc() && end == text.data() + text.size() && ranks > 1) return ranks;
  }
  return 1;
}

int run_mesh(const MoEConfig& config, const TensorSource& weights, const TensorSource& inputs,
             const CheckedLayerFiles& checked, bool check_finite_values,
             const std::string& out_path) {
  int rank = 0, world = 1;
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MOE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
  if (world != config.ep * config.dp)  // the same on every rank: all fail alike
    fail("EP {} × DP {} is {} ranks, but MPI started {}", config.ep, config.dp,
         config.ep * config.dp, world);
  const std::vector<std::int64_t> split = checked.split(world);  // alike on every rank

  std::string error;
  RankInputs in;
  try {
    in = read_rank_inputs(config, weights, inputs, checked, rank, check_finite_values);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on_errors(error, rank, world);

  // Declared outside the try: a failing rank aborts the job while its mesh and block still stand,
  // before their teardown could wait on peers.
  std::optional<Mesh> mesh;
  std::optional<Stream> stream;
  std::optional<MoEBlock> block;
  try {
    mesh.emplace(Mesh::from_mpi(MPI_COMM_WORLD, config.ep, config.dp, config.num_experts));
    stream.emplace();
    block.emplace(config, *mesh, stream->get());
    run_rank(config, std::move(in), checked, rank, world, check_finite_values, out_path, *mesh,
             *block, *stream);
  } catch (const std::exception& e) {
    if (world == 1) throw;
    std::fprintf(stderr, "moe_run: rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;  // not reached: MPI_Abort ends every rank
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe_run: forward and backward of the MoE layer on tensors from safetensors files"};
  cli::flags_take_no_value(app);
  std::string config_path, weights_path, inputs_path, out_path, record_path, replay_path;
  int ep = 0, dp = 0;
  bool use_reference = false;
  bool check_finite_values = true;
  app.add_option("--config", config_path, "layer config (YAML)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--weights", weights_path,
                 "gate_weight, w13, w2[, expert_bias][, shared_w13, shared_w2[, "
                 "shared_gate_weight]]")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--inputs", inputs_path, "x, dy[, tokens_per_rank][, topk_idx (replay)]")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--out", out_path, "results file to write")->required();
  CLI::Option* record_option =
      app.add_option("--record-routing", record_path,
                     "also write the step's routing, topk_idx [T, K] (I32) alone, to this file");
  app.add_option("--replay-routing", replay_path,
                 "run with the routing of this file's topk_idx [T, K] (I32): a --record-routing "
                 "file or a results file (the inputs then hold no topk_idx)")
      ->check(CLI::ExistingFile);
  app.add_option("--ep", ep, "expert-parallel degree (default: world / dp, or all ranks)")
      ->check(cli::count_in(1, 1 << 20));
  app.add_option("--dp", dp, "data-parallel degree (default: world / ep)")
      ->check(cli::count_in(1, 1 << 20));
  app.add_flag("--reference", use_reference, "run the fp64 CPU reference instead of the GPUs");
  app.add_flag(
      "--check-finite,!--no-check-finite", check_finite_values,
      "refuse weights, inputs and results holding NaN or Inf (as the layer holds them: an F32 "
      "value beyond bf16's range under dtype bf16 too), naming the tensor (default: on)");
  if (const auto exit_code = cli::parse_or_help(app, argc, argv)) return *exit_code;
  // Given, even empty (which check_output_file names), the routing is recorded.
  const bool record = record_option->count() > 0;
  try {
    std::vector<std::pair<std::string, std::string>> read_files = {
        {"--config", config_path}, {"--weights", weights_path}, {"--inputs", inputs_path}};
    if (!replay_path.empty()) read_files.emplace_back("--replay-routing", replay_path);
    cli::check_output_file("--out", out_path, read_files);
    if (record) {
      cli::check_output_file("--record-routing", record_path, read_files);
      if (cli::same_file(record_path, out_path))
        fail(
            "--record-routing '{}' is the --out file '{}': the routing and the results need two "
            "files",
            record_path, out_path);
    }
    auto config = load_config(config_path);
    // Headers only: the data are read where they are needed, a rank's share or an expert at a time.
    const TensorFileReader weights(weights_path);
    const TensorFileReader inputs(inputs_path);
    std::optional<TensorFileReader> replay;
    if (!replay_path.empty()) replay.emplace(replay_path);
    const TensorSource* routing = replay ? &*replay : nullptr;
    if (use_reference) {
      // One process runs the reference: copies under mpirun would each compute the whole batch
      // and write the same files.
      if (const int ranks = launched_ranks(); ranks > 1)
        fail(
            "--reference runs the whole batch on the CPU in one process, but an MPI launcher "
            "started {} of them; run it without mpirun",
            ranks);
      // The reference runs the whole batch as one rank: a mesh asked for would be ignored.
      // --ep 1 --dp 1 names that one rank, and is taken.
      if (ep > 1 || dp > 1) {
        const std::string given = ep != 0 && dp != 0 ? fmt::format("--ep {} --dp {}", ep, dp)
                                  : ep != 0          ? fmt::format("--ep {}", ep)
                                                     : fmt::format("--dp {}", dp);
        fail("{}: --reference runs the whole batch on the CPU as one rank; drop {}", given,
             ep != 0 && dp != 0 ? "them" : "it");
      }
      // Routed as the config's mesh routes: node-limited routing depends on its ep, which only
      // the file can give here.
      if (config.node_limited_routing() && config.ep == 1)
        fail(
            "max_nodes_per_token = {} depends on the mesh: set `ep:` in the config to the EP size "
            "the reference stands for (--reference runs the batch as one rank)",
            config.max_nodes_per_token);
      // The files checked first: a note that calls a tensor ineffective must not precede the
      // error that the same tensor is malformed.
      (void)check_layer_files(config, weights, inputs, routing);
      note_one_rank(config, inputs);
      const int status = run_reference(config.for_one_rank(), weights, inputs, routing,
                                       check_finite_values, out_path);
      if (status == 0 && record) record_routing(config, out_path, record_path);
      return status;
    }
    const CheckedLayerFiles checked = check_layer_files(config, weights, inputs, routing);
    // Refused before MPI starts, so that every rank stops at once with the same message: with the
    // mesh asked for where --ep / --dp give it (the world size is known only under MPI).
    MoEConfig asked = config;
    asked.ep = ep != 0 ? ep : 1;
    asked.dp = dp != 0 ? dp : 1;
    if (const std::string why = asked.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
    // The file's ep decides node-limited routing (as under --reference): a mesh of another EP
    // size would route otherwise.
    const int file_ep = config.ep, file_dp = config.dp;
    comm::MpiSession mpi(&argc, &argv);
    std::tie(ep, dp) = cli::mesh_shape(ep, dp, mpi.size());
    if (config.node_limited_routing() && file_ep != 1 && file_ep != ep)
      fail(
          "the config's ep = {} sets the nodes of max_nodes_per_token = {}, but the mesh has "
          "EP {}; give --ep {} (and as many ranks) or change the file",
          file_ep, config.max_nodes_per_token, ep, file_ep);
    if (mpi.rank() == 0 && (file_ep > 1 || file_dp > 1) && (file_ep != ep || file_dp != dp)) {
      std::fprintf(stderr,
                   "moe_run: note: the config's mesh (ep = %d, dp = %d) gives way to the mesh of "
                   "the ranks started and --ep / --dp: EP %d, DP %d\n",
                   file_ep, file_dp, ep, dp);
    }
    config.ep = ep;
    config.dp = dp;
    config.validate();
    // Each rank's tokens: as many counts as ranks, each within the slots' int32 row index.
    const std::vector<std::int64_t> split = checked.split(mpi.size());
    for (const std::int64_t rank_tokens : split) cli::check_slots_fit(rank_tokens, config.topk);
    check_ep_groups_hold_one_t(config, split);
    // Again with the mesh's shape (capacity mode runs on one EP rank): the same on every rank, so
    // all stop alike before any collective.
    if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
    // Every setting is checked first, on any machine.
    if (cuda_device_count() == 0) fail("no CUDA GPU on this machine (--reference runs on the CPU)");
    const int status = run_mesh(config, weights, inputs, checked, check_finite_values, out_path);
    if (status == 0 && mpi.rank() == 0 && record) record_routing(config, out_path, record_path);
    return status;
  } catch (const std::bad_alloc&) {
    if (use_reference)
      std::fprintf(stderr,
                   "moe_run: out of host memory; --reference holds x, dy, the weights it reads "
                   "and the results in fp64 (about twice their files' bytes each for F32 files)\n");
    else
      std::fprintf(stderr,
                   "moe_run: out of host memory reading the files' headers or this rank's share "
                   "of their tensors\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_run: %s\n", e.what());
    return 1;
  }
}
