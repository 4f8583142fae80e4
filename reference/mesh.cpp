// An EP×DP mesh in fp64, simulated exchange by exchange as docs/design.md describes it: the sender
// orders rows by global expert without padding, all-to-allv inside the EP group, the receiver sorts
// (source rank, local expert) chunks into the padded expert-major layout; then the mirror, and the
// gradient reductions (experts over the DP group, gate and shared experts over the world).
// Capacity mode drops on each sender before the exchange; with pad_to_capacity every
// (sender, expert) block crosses at the capacity's size. Under fp8 the experts run as the FP8
// experts form them, with the NCCL exchange's roles: the combine weighs the rows, so the experts
// get them, and dY, unweighed; fp8_dispatch rounds the rows toward the experts through FP8.
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>

#include "moe/error.h"
#include "reference/reference.h"
#include "stages.h"

namespace moe::reference {
namespace {

using CountTable = std::vector<std::vector<std::int64_t>>;  // [from][to] rows

// all-to-allv: send[i] holds the rows for peer 0, then peer 1, ...; recv[j] gets the rows from
// peer 0, then peer 1, ...
std::vector<Matrix> all_to_all(const std::vector<Matrix>& send, const CountTable& counts,
                               std::int64_t cols) {
  const std::size_t peers = send.size();
  std::vector<Matrix> recv(peers);
  for (std::size_t j = 0; j < peers; ++j) {
    std::vector<Matrix> parts;
    for (std::size_t i = 0; i < peers; ++i) {
      std::int64_t begin = 0;
      for (std::size_t before = 0; before < j; ++before) begin += counts[i][before];
      parts.push_back(slice_rows(send[i], begin, begin + counts[i][j]));
    }
    recv[j] = concat_rows(parts);
    recv[j].cols = cols;  // keeps the width when no rows arrive
  }
  return recv;
}

CountTable transpose(const CountTable& counts) {
  CountTable t(counts.size(), std::vector<std::int64_t>(counts.size()));
  for (std::size_t i = 0; i < counts.size(); ++i) {
    for (std::size_t j = 0; j < counts.size(); ++j) t[j][i] = counts[i][j];
  }
  return t;
}

ExpertWeights local_weights(const ExpertWeights& all, int first, int count) {
  ExpertWeights local;
  local.w13.assign(all.w13.begin() + first, all.w13.begin() + first + count);
  local.w2.assign(all.w2.begin() + first, all.w2.begin() + first + count);
  return local;
}

// One rank's local experts on its sorted rows X (rows [offsets[e], offsets[e + 1]) expert e's,
// padding included): exact, or under fp8 expert by expert as run_layer runs them (activations are
// quantized row by row and weights expert by expert, so an expert's rows give what they give
// among any others).
ExpertActivations local_forward(const MoEConfig& config, const Matrix& X,
                                std::span<const std::int64_t> offsets, const ExpertWeights& w) {
  if (!config.fp8) return experts_forward(X, offsets, w);
  const std::int64_t H = X.cols, F = config.ffn_hidden;
  std::vector<Matrix> hs, as, ys;
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    if (offsets[e] == offsets[e + 1]) {
      hs.emplace_back(0, 2 * F);
      as.emplace_back(0, F);
      ys.emplace_back(0, H);
      continue;
    }
    ExpertActivations act =
        fp8_expert_forward(slice_rows(X, offsets[e], offsets[e + 1]), w.w13[e], w.w2[e]);
    hs.push_back(std::move(act.h));
    as.push_back(std::move(act.a));
    ys.push_back(std::move(act.y));
  }
  return {concat_rows(hs), concat_rows(as), concat_rows(ys)};
}

ExpertGrads local_backward(const MoEConfig& config, const Matrix& X, const ExpertActivations& act,
                           const Matrix& dY, std::span<const std::int64_t> offsets,
                           const ExpertWeights& w) {
  if (!config.fp8) return experts_backward(X, act, dY, offsets, w);
  const std::int64_t H = X.cols, F = config.ffn_hidden;
  ExpertGrads grads;
  std::vector<Matrix> dXs;
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    const std::int64_t begin = offsets[e], end = offsets[e + 1];
    if (begin == end) {  // no rows: zero gradients
      dXs.emplace_back(0, H);
      grads.dw13.emplace_back(H, 2 * F);
      grads.dw2.emplace_back(F, H);
      continue;
    }
    Fp8ExpertBackward b =
        fp8_expert_backward(slice_rows(X, begin, end), slice_rows(act.h, begin, end), w.w13[e],
                            w.w2[e], slice_rows(dY, begin, end));
    dXs.push_back(std::move(b.dX));
    grads.dw13.push_back(std::move(b.dw13));
    grads.dw2.push_back(std::move(b.dw2));
  }
  grads.dX = concat_rows(dXs);
  grads.dX.cols = H;
  return grads;
}

void add_grads(ExpertGrads& total, const ExpertGrads& part) {
  if (total.dw13.empty()) {
    total.dw13 = part.dw13;
    total.dw2 = part.dw2;
    return;
  }
  for (std::size_t e = 0; e < part.dw13.size(); ++e) {
    add_into(total.dw13[e], part.dw13[e]);
    add_into(total.dw2[e], part.dw2[e]);
  }
}

// pad_to_capacity: every rank of an EP group sends blocks of one size, so all hold one token count.
void check_equal_tokens_per_ep_group(const MoEConfig& config, std::span<const Matrix> x) {
  for (int dp_index = 0; dp_index < config.dp; ++dp_index) {
    std::vector<std::int64_t> tokens;
    for (int i = 0; i < config.ep; ++i) tokens.push_back(x[dp_index * config.ep + i].rows);
    if (std::adjacent_find(tokens.begin(), tokens.end(), std::not_equal_to<>()) != tokens.end())
      fail(
          "pad_to_capacity = true needs the same token count on every rank of an EP group; the "
          "ranks of DP index {} hold [{}]",
          dp_index, fmt::join(tokens, ", "));
  }
}

void add_shared_grads(SharedExpertGrads& total, const SharedExpertGrads& part) {
  if (total.dw13.data.empty() && total.dw2.data.empty()) {
    total = part;
    return;
  }
  add_into(total.dw13, part.dw13);
  add_into(total.dw2, part.dw2);
  if (!part.dgate_weight.data.empty()) {
    add_into(total.dgate_weight, part.dgate_weight);
    add_into(total.dgate_weight_magnitude, part.dgate_weight_magnitude);
  }
}

}  // namespace

std::vector<LayerResult> run_mesh(const MoEConfig& config, const Params& params,
                                  std::span<const Matrix> x, std::span<const Matrix> dy,
                                  std::span<const std::vector<int>> replay_experts) {
  const int EP = config.ep;
  const int DP = config.dp;
  const int world = EP * DP;
  const int E = config.num_experts;
  const int E_loc = config.local_experts();
  const int align = config.align_size;
  if (std::ssize(x) != world || std::ssize(dy) != world) {
    fail("run_mesh: {} batches and {} gradients for a mesh of {} ranks", x.size(), dy.size(),
         world);
  }
  if (!replay_experts.empty() && std::ssize(replay_experts) != world) {
    fail("run_mesh: {} replayed routings for a mesh of {} ranks", replay_experts.size(), world);
  }
  const std::int64_t H = params.gate_weight.cols;
  for (int r = 0; r < world; ++r) check_params(config, params, x[r].cols);
  if (config.pad_to_capacity) check_equal_tokens_per_ep_group(config, x);

  // Steps 1-3 on every rank; loss statistics are summed over the world. Capacity drops are each
  // sender's own decision, on its own tokens.
  std::vector<RouterFront> front(world);
  AuxStats global_aux;
  double global_z_sum = 0.0;
  for (int r = 0; r < world; ++r) {
    front[r] = router_front(config, params, x[r],
                            replay_experts.empty()
                                ? std::nullopt
                                : std::optional<std::span<const int>>(replay_experts[r]));
    global_aux += front[r].aux;
    global_z_sum += front[r].z_sum;
  }
  std::vector<LayerResult> result(world);
  for (int r = 0; r < world; ++r)
    fill_forward_result(config, front[r], global_aux, global_z_sum, result[r]);

  // Step 4, sender side: kept rows by global expert, unpadded (or in blocks of the capacity).
  std::vector<Layout> send_layout(world);
  std::vector<Matrix> send_rows(world);
  for (int r = 0; r < world; ++r) {
    send_layout[r] =
        make_layout(front[r].routing, front[r].kept, E, 1, capacity_block_rows(config, x[r].rows));
    send_rows[r] = permute(x[r], send_layout[r], front[r].routing);
    if (config.fp8_dispatch) send_rows[r] = round_rows_through_fp8(send_rows[r]);  // records
  }

  std::vector<ExpertGrads> local_grads(world);
  for (int dp_index = 0; dp_index < DP; ++dp_index) {
    auto rank = [&](int ep_index) { return dp_index * EP + ep_index; };

    // The counts exchange: what source i sends to each of j's local experts.
    CountTable counts(EP, std::vector<std::int64_t>(EP, 0));
    std::vector<ChunkLayout> chunks(EP);
    for (int j = 0; j < EP; ++j) {
      chunks[j] = ChunkLayout{EP, E_loc, std::vector<std::int64_t>(EP * E_loc)};
      for (int i = 0; i < EP; ++i) {
        for (int le = 0; le < E_loc; ++le) {
          const auto c = send_layout[rank(i)].group_rows(j * E_loc + le);
          chunks[j].counts[i * E_loc + le] = c;
          counts[i][j] += c;
        }
      }
    }
    std::vector<Matrix> group_send(EP);
    for (int i = 0; i < EP; ++i) group_send[i] = send_rows[rank(i)];

    // Dispatch, local sort, experts, local unsort, combine exchange.
    const auto received = all_to_all(group_send, counts, H);
    std::vector<Matrix> X(EP);
    std::vector<ExpertActivations> act(EP);
    std::vector<std::vector<std::int64_t>> offsets(EP);
    std::vector<Matrix> y_source_major(EP);
    for (int j = 0; j < EP; ++j) {
      X[j] = sort_chunks(received[j], chunks[j], align);
      result[rank(j)].expert_rows = X[j].rows;
      offsets[j] = padded_offsets(chunks[j].rows_per_expert(), align);
      act[j] =
          local_forward(config, X[j], offsets[j], local_weights(params.experts, j * E_loc, E_loc));
      y_source_major[j] = unsort_chunks(act[j].y, chunks[j], align);
    }
    const auto y_send_layout = all_to_all(y_source_major, transpose(counts), H);

    // Step 6 and the backward's first half on each sender.
    std::vector<Matrix> dy_send_layout(EP);
    std::vector<std::vector<double>> dprob(EP);
    for (int i = 0; i < EP; ++i) {
      const auto& routing = front[rank(i)].routing;
      result[rank(i)].out = unpermute_combine(y_send_layout[i], send_layout[rank(i)], routing);
      dy_send_layout[i] = combine_backward_rows(dy[rank(i)], send_layout[rank(i)], routing);
      // FP8 experts quantize the bf16 rows the sender stores (as records under fp8_dispatch).
      if (config.fp8) dy_send_layout[i] = round_to(dy_send_layout[i], DType::kBF16);
      if (config.fp8_dispatch) dy_send_layout[i] = round_rows_through_fp8(dy_send_layout[i]);
      // The combine consumed Y in the sender's layout: dp is taken there (docs/design.md, "Combine
      // backward").
      dprob[i] =
          combine_backward_prob(dy[rank(i)], y_send_layout[i], send_layout[rank(i)], routing);
    }

    // Backward through the exchange and the experts.
    const auto dy_received = all_to_all(dy_send_layout, counts, H);
    std::vector<Matrix> dx_source_major(EP);
    for (int j = 0; j < EP; ++j) {
      const Matrix dY = sort_chunks(dy_received[j], chunks[j], align);
      local_grads[rank(j)] = local_backward(config, X[j], act[j], dY, offsets[j],
                                            local_weights(params.experts, j * E_loc, E_loc));
      dx_source_major[j] = unsort_chunks(local_grads[rank(j)].dX, chunks[j], align);
    }
    const auto dx_send_layout = all_to_all(dx_source_major, transpose(counts), H);
    for (int i = 0; i < EP; ++i) {
      const int r = rank(i);
      result[r].dx = permute_backward(dx_send_layout[i], send_layout[r], front[r].routing);
      router_back(config, params, x[r], front[r], global_aux, dprob[i], result[r]);
    }
  }

  // Shared experts: each rank runs its own tokens through its replica.
  SharedExpertGrads shared_total;
  if (config.shared_experts()) {
    for (int r = 0; r < world; ++r) {
      const SharedForward shared = shared_forward(config, params.shared, x[r]);
      add_into(result[r].out, shared.out);
      add_shared_grads(shared_total,
                       shared_backward(config, params.shared, x[r], shared, dy[r], result[r].dx));
    }
  }

  // Gradient reductions: gate over the world, experts over each DP group (same EP index).
  Matrix gate_total(E, H);
  for (int r = 0; r < world; ++r) add_into(gate_total, result[r].d_gate_weight);
  for (int ep_index = 0; ep_index < EP; ++ep_index) {
    ExpertGrads total;
    for (int dp_index = 0; dp_index < DP; ++dp_index)
      add_grads(total, local_grads[dp_index * EP + ep_index]);
    for (int dp_index = 0; dp_index < DP; ++dp_index) {
      auto& r = result[dp_index * EP + ep_index];
      r.d_gate_weight = gate_total;
      r.shared_grads = shared_total;
      r.expert_grads.dw13 = total.dw13;
      r.expert_grads.dw2 = total.dw2;
      r.expert_grads.dX = local_grads[dp_index * EP + ep_index].dX;
    }
  }
  return result;
}

}  // namespace moe::reference
