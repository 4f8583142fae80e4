// moe_run: one forward and backward of the layer on tensors from safetensors files, every result
// written to a safetensors file, so the layer can be checked against PyTorch or any framework.
//
//   mpirun -np N build/apps/moe_run --config C.yaml --weights W.safetensors --inputs I.safetensors
//                                   --out R.safetensors [--ep E --dp D]
//   build/apps/moe_run ... --reference     # the fp64 CPU reference instead of the GPUs (the only
//                                          # one that runs capacity mode, shared experts, replay)
//   build/apps/moe_run ... --no-check-finite   # skip the NaN/Inf check of weights and inputs
//
// The files hold the global batch and all experts (names and layouts: io/layer_files.h).
// Under mpirun each rank takes its tokens (tokens_per_rank, or an even split) and its experts;
// rank 0 gathers the results into one file.
//
// Everything that can be checked on the files is checked before MPI starts, on every rank alike
// (each reads the same files), so that a bad file stops all ranks at once with one message.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <utility>

#include "comm/bootstrap.h"
#include "io/layer_files.h"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "reference/reference.h"

using namespace moe;

namespace {

// The results file must not be one of the inputs: opening it for writing would truncate that
// input. Checked as paths (after resolving `.`, `..` and symbolic links) and as files
// (std::filesystem::equivalent: also a hard link), before anything is read or written.
void refuse_overwriting_inputs(const std::string& out,
                               const std::vector<std::pair<std::string, std::string>>& inputs) {
  namespace fs = std::filesystem;
  std::error_code out_error;
  const fs::path out_path = fs::weakly_canonical(out, out_error);
  for (const auto& [option, path] : inputs) {
    std::error_code same_error, path_error;
    const bool same_file = fs::equivalent(out, path, same_error) && !same_error;
    const fs::path in_path = fs::weakly_canonical(path, path_error);
    const bool same_path = !out_error && !path_error && in_path == out_path;
    if (same_file || same_path)
      fail("--out '{}' is the {} file '{}': refusing to overwrite an input", out, option, path);
  }
}

// Elements [first, first + count) of a file tensor in `dtype` (bf16 or fp32), ready to copy.
std::vector<std::byte> host_bytes(const FileTensor& t, const std::string& name, std::int64_t first,
                                  std::int64_t count, DType dtype) {
  const auto values = file_values(t, name);
  // The range comes from the config and the rank; the tensor's size from its file.
  if (first < 0 || count < 0 || first > std::ssize(values) - count) {
    fail("moe_run: elements [{}, {} + {}) of tensor '{}' lie outside its {} elements", first, first,
         count, name, values.size());
  }
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

void upload(const Tensor& dst, const std::vector<std::byte>& bytes) {
  if (bytes.size() != dst.bytes()) fail("moe_run: {} bytes for {}", bytes.size(), dst.describe());
  copy_to_device(dst.data, bytes.data(), bytes.size());
}

std::vector<float> download_floats(const Tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype == DType::kBF16) {
    std::vector<BF16> raw(out.size());
    copy_to_host(raw.data(), t.data, raw.size() * 2);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = from_bf16(raw[i]);
  } else {
    copy_to_host(out.data(), t.data, out.size() * 4);
  }
  return out;
}

// Rank 0 receives every rank's `local` in rank order (other ranks get an empty vector). The
// sizes grow with the files (T·H per rank; E·2F·H for the gradients, 7.5e9 elements at
// deepseek-v3), past MPI's int counts and displacements, so the counts travel as int64 and the
// data point to point in pieces that an int always counts. Messages between two ranks arrive in
// the order sent, so the pieces land in order.
template <typename T>
std::vector<T> gather(const std::vector<T>& local, MPI_Datatype type, int world, int rank) {
  constexpr std::int64_t kPiece = std::int64_t{1} << 26;  // elements per message
  constexpr int kTag = 0;
  const auto mine = static_cast<std::int64_t>(local.size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(world));
  MOE_CHECK_MPI(
      MPI_Gather(&mine, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, 0, MPI_COMM_WORLD));
  if (rank != 0) {
    for (std::int64_t first = 0; first < mine; first += kPiece) {
      MOE_CHECK_MPI(MPI_Send(local.data() + first, static_cast<int>(std::min(kPiece, mine - first)),
                             type, 0, kTag, MPI_COMM_WORLD));
    }
    return {};
  }
  const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  std::vector<T> all(static_cast<std::size_t>(total));
  std::copy(local.begin(), local.end(), all.begin());
  std::int64_t offset = mine;
  for (int r = 1; r < world; ++r) {
    const std::int64_t count = counts[static_cast<std::size_t>(r)];
    for (std::int64_t first = 0; first < count; first += kPiece) {
      MOE_CHECK_MPI(MPI_Recv(all.data() + offset + first,
                             static_cast<int>(std::min(kPiece, count - first)), type, r, kTag,
                             MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    }
    offset += count;
  }
  return all;
}

int run_reference(const MoEConfig& config, const LayerInputs& in, const std::string& out_path) {
  reference::LayerOptions options;
  if (in.replay_experts) options.replay_experts = *in.replay_experts;
  const auto result = reference::run_layer(config, in.params, in.x, in.dy, options);
  layer_results_file(config, result).write(out_path);
  std::printf("moe_run: fp64 reference over %lld tokens written to %s\n",
              static_cast<long long>(in.x.rows), out_path.c_str());
  return 0;
}

int run_mesh(MoEConfig config, const TensorFile& weights, const TensorFile& inputs,
             const LayerInputs& in, const std::string& out_path) {
  const int world = config.ep * config.dp;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, config.ep, config.dp, config.num_experts);
  const int rank = mesh.rank();
  std::vector<std::int64_t> split = in.tokens_per_rank;
  if (split.empty()) {  // an even split, the remainder to the first ranks
    for (int r = 0; r < world; ++r)
      split.push_back(in.x.rows / world + (r < in.x.rows % world ? 1 : 0));
  }
  if (std::ssize(split) != world)
    fail("moe_run: tokens_per_rank has {} entries for {} ranks", split.size(), world);
  const std::int64_t first = std::accumulate(split.begin(), split.begin() + rank, std::int64_t{0});
  const std::int64_t T = split[rank];
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden,
                     K = config.topk;
  const std::int64_t E_loc = E / config.ep;

  Stream stream;
  MoEBlock block(config, mesh, stream.get());
  const auto& p = block.parameters();
  upload(p.gate_weight,
         host_bytes(weights.get("gate_weight"), "gate_weight", 0, E * H, config.dtype));
  upload(p.w13, host_bytes(weights.get("w13"), "w13", mesh.ep_index() * E_loc * 2 * F * H,
                           E_loc * 2 * F * H, config.dtype));
  upload(p.w2, host_bytes(weights.get("w2"), "w2", mesh.ep_index() * E_loc * H * F, E_loc * H * F,
                          config.dtype));
  const std::vector<float> bias(in.params.expert_bias.begin(), in.params.expert_bias.end());
  copy_to_device(p.expert_bias.data, bias.data(), bias.size() * 4);
  DeviceBuffer x(std::max<std::int64_t>(T * H, 1) * dtype_size(config.dtype)), dy(x.bytes());
  const Tensor x_t(x.data(), config.dtype, {T, H}), dy_t(dy.data(), config.dtype, {T, H});
  upload(x_t, host_bytes(inputs.get("x"), "x", first * H, T * H, config.dtype));
  upload(dy_t, host_bytes(inputs.get("dy"), "dy", first * H, T * H, config.dtype));

  const auto fwd = block.forward(x_t);
  const Tensor dx = block.backward(dy_t);
  block.reduce_gradients();
  stream.synchronize();

  const auto routing = block.routing();
  std::vector<std::int32_t> idx(static_cast<std::size_t>(T * K)), load(static_cast<std::size_t>(E));
  copy_to_host(idx.data(), routing.topk_idx.data, idx.size() * 4);
  copy_to_host(load.data(), routing.tokens_per_expert.data, load.size() * 4);
  const auto out_all = gather(download_floats(fwd.out), MPI_FLOAT, world, rank);
  const auto dx_all = gather(download_floats(dx), MPI_FLOAT, world, rank);
  const auto p_all = gather(download_floats(routing.topk_p), MPI_FLOAT, world, rank);
  const auto idx_all = gather(idx, MPI_INT32_T, world, rank);
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, load.data(), static_cast<int>(E), MPI_INT32_T, MPI_SUM,
                              MPI_COMM_WORLD));
  // Ranks 0 .. EP-1 (DP index 0) hold the DP-summed gradients of consecutive expert slices.
  const auto& g = block.gradients();
  const auto w13_all = gather(download_floats(g.w13), MPI_FLOAT, world, rank);
  const auto w2_all = gather(download_floats(g.w2), MPI_FLOAT, world, rank);
  const auto gate = download_floats(g.gate_weight);
  if (rank != 0) return 0;

  const std::int64_t total = in.x.rows;
  TensorFile file;
  file.add("out", FileDType::kF32, {total, H}, out_all.data());
  file.add("dx", FileDType::kF32, {total, H}, dx_all.data());
  file.add("topk_p", FileDType::kF32, {total, K}, p_all.data());
  file.add("topk_idx", FileDType::kI32, {total, K}, idx_all.data());
  file.add("aux_loss", FileDType::kF32, {1}, &fwd.aux_loss);
  file.add("z_loss", FileDType::kF32, {1}, &fwd.z_loss);
  file.add("tokens_per_expert", FileDType::kI32, {E}, load.data());
  // The GPU layer runs dropless only (main refuses capacity mode): every slot kept.
  const std::vector<std::int32_t> kept(static_cast<std::size_t>(total * K), 1);
  const std::vector<std::int32_t> dropped(static_cast<std::size_t>(E), 0);
  file.add("kept", FileDType::kI32, {total, K}, kept.data());
  file.add("dropped_per_expert", FileDType::kI32, {E}, dropped.data());
  file.add("grad.gate_weight", FileDType::kF32, {E, H}, gate.data());
  file.add("grad.w13", FileDType::kF32, {E, 2 * F, H}, w13_all.data());  // ranks 0..EP-1 come first
  file.add("grad.w2", FileDType::kF32, {E, H, F}, w2_all.data());
  file.metadata["producer"] = "moe-runtime";
  file.metadata["config"] = config.describe();
  file.write(out_path);
  std::printf("moe_run: %d rank(s), EP=%d DP=%d, %lld tokens; results written to %s\n", world,
              config.ep, config.dp, static_cast<long long>(total), out_path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe_run: forward and backward of the MoE layer on tensors from safetensors files"};
  std::string config_path, weights_path, inputs_path, out_path;
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
  app.add_option("--ep", ep, "expert-parallel degree (default: world / dp, or all ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dp", dp, "data-parallel degree (default: world / ep)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--reference", use_reference, "run the fp64 CPU reference instead of the GPUs");
  app.add_flag("--check-finite,!--no-check-finite", check_finite_values,
               "refuse weights and inputs holding NaN or Inf, naming the tensor (default: on)");
  CLI11_PARSE(app, argc, argv);
  try {
    refuse_overwriting_inputs(
        out_path,
        {{"--config", config_path}, {"--weights", weights_path}, {"--inputs", inputs_path}});
    auto config = load_config(config_path);
    const auto weights = TensorFile::read(weights_path);
    const auto inputs = TensorFile::read(inputs_path);
    const auto in = read_layer_inputs(config, weights, inputs);
    if (check_finite_values) {
      check_finite(weights);
      check_finite(inputs);
    }
    if (use_reference) {
      config.ep = config.dp = 1;
      return run_reference(config, in, out_path);
    }
    // Refused before MPI starts, so that every rank stops at once with the same message.
    if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
    if (in.replay_experts) {
      fail(
          "topk_idx in '{}': routing replay is not implemented by the GPU layer yet; moe_run "
          "--reference runs it on the CPU",
          inputs_path);
    }
    comm::MpiSession mpi(&argc, &argv);
    if (cuda_device_count() == 0) fail("no CUDA GPU on this machine (--reference runs on the CPU)");
    if (ep == 0 && dp == 0) ep = mpi.size(), dp = 1;
    if (ep == 0) ep = mpi.size() / dp;
    if (dp == 0) dp = mpi.size() / ep;
    config.ep = ep;
    config.dp = dp;
    config.validate();
    return run_mesh(config, weights, inputs, in, out_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_run: %s\n", e.what());
    return 1;
  }
}
