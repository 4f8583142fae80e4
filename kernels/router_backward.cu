// The router's backward: dlogits from the probabilities' gradients and the aux and z losses, one
// kernel over the tokens, each token's row held by its team of lanes as in the forward.
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "router.cuh"
#include "router_device.cuh"
#include "router_launch.h"
#include "vector_access.cuh"

namespace moe {

using namespace router_detail;  // the code that the router_*.cu files share

namespace {

template <typename In>
struct BackwardKernelArgs {
  RouterParams p;
  const In* logits;
  std::int64_t tokens;
  bool vector_rows;
  const std::int32_t* topk_idx;
  const float* topk_p;
  const float* dprob;
  const std::int32_t* aux_tokens_per_expert;
  float aux_factor;
  float z_factor;
  const float* loss_factors;  // device {aux, z}, or null for the two above
  float* dlogits;
};

// The backward's shared memory: the aux gradients (kStridedLanes), then, with dprob, one row of
// E floats per team, where the selected entries' terms are added to the row's dense terms (aux,
// z) before the row is stored.
template <int S, int V>
std::size_t backward_shared_bytes(int experts, bool dprob) {
  constexpr int kTeams = kWarpSize / S;
  const std::size_t row = kStridedLanes<V> ? S * V : experts;
  return (kStridedLanes<V> ? S * V * 4 : 0) +
         (dprob ? static_cast<std::size_t>(kTeams) * kWarpsPerBlock * row * 4 : 0);
}

template <int S, int V, typename In>
__global__ void __launch_bounds__(kThreads, backward_blocks_per_sm<V>())
    router_backward_kernel(BackwardKernelArgs<In> a) {
  constexpr int kTeams = kWarpSize / S;
  constexpr int kSlots = (kMaxTopK + S - 1) / S;
  extern __shared__ __align__(16) unsigned char shared[];
  const RouterParams& p = a.p;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int rank = lane % S;
  const int team = lane / S;
  const int first = rank * V;
  const int E = p.num_experts;
  const int K = p.topk;
  const float c = p.scaling_factor;
  const float inv_c = 1.0f / c;
  const bool softmax = p.score_function == ScoreFunction::kSoftmax;
  const float aux_factor = a.loss_factors != nullptr ? a.loss_factors[0] : a.aux_factor;
  const float z_factor = a.loss_factors != nullptr ? a.loss_factors[1] : a.z_factor;
  const bool aux = aux_factor != 0.0f && a.aux_tokens_per_expert != nullptr;
  const bool z = z_factor != 0.0f;
  const bool need_row = (softmax && p.pre_softmax) || aux || z;
  const bool need_row_softmax = (softmax && (p.pre_softmax || aux)) || z;
  constexpr bool kStrided = kStridedLanes<V>;
  float* aux_grad_row = reinterpret_cast<float*>(shared);  // [S·V] when kStrided
  float* row =
      aux_grad_row + (kStrided ? S * V : 0) + (warp * kTeams + team) * (kStrided ? S * V : E);
  // 16-byte row moves when the lane's chunk starts on a 16-byte boundary and lies in the row.
  const bool vector_chunk = V % 4 == 0 && E % 4 == 0 && first + V <= E;

  // ∂L_aux/∂s_aux[t, e] = factor · f_e is the same for every token: held in registers, or in
  // shared memory from 32 entries per lane on (kStridedLanes).
  auto aux_grad_of = [&](int e) {
    return (aux && e < E) ? aux_factor * static_cast<float>(a.aux_tokens_per_expert[e]) : 0.0f;
  };
  float aux_grad[V];
  if constexpr (kStrided) {
    fill_shared_row<S * V>(aux_grad_row, S * V, aux_grad_of);
    __syncthreads();
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) aux_grad[j] = aux_grad_of(first + j);
  }
  auto lane_aux_grad = [&](int j) {
    if constexpr (kStrided) {
      // One 16-byte read per run serves its four entries (the loops are unrolled).
      const float4 run =
          reinterpret_cast<const float4*>(aux_grad_row)[(j / kBackwardRun) * S + rank];
      const int q = j % kBackwardRun;
      return q == 0 ? run.x : q == 1 ? run.y : q == 2 ? run.z : run.w;
    } else {
      return aux_grad[j];
    }
  };

  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock * kTeams;
  const std::int64_t start =
      (static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kTeams;
  for (std::int64_t base = start; base < a.tokens; base += step) {
    const std::int64_t t = base + team;
    const bool valid = t < a.tokens;
    // The token's slots (slot k on team lane k % S) and its row.
    int slot_expert[kSlots];
    float slot_p[kSlots], slot_dp[kSlots], l[V];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int k = i * S + rank;
      const bool active = valid && k < K && i * S < K;
      slot_expert[i] = active ? a.topk_idx[t * K + k] : 0;
      slot_p[i] = active ? a.topk_p[t * K + k] : 0.0f;
      slot_dp[i] = (active && a.dprob != nullptr) ? a.dprob[t * K + k] : 0.0f;
    }
    if (need_row) {
      load_entries<S, V, kBackwardRun>(l, a.logits, t, valid, rank, E, a.vector_rows);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) l[j] = -INFINITY;
    }

    // The selected entries' terms, slot_d, added through shared memory below; dense_dot, the
    // pre-softmax's Σ s·ds that every entry's term carries.
    float slot_d[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) slot_d[i] = 0.0f;
    float dense_dot = 0.0f;

    if (a.dprob != nullptr) {
      if (softmax && !p.pre_softmax) {
        // dl_m = c·q_m·(dp_m − Σ_j q_j dp_j) with q = p / c.
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) dot += (slot_p[i] * inv_c) * slot_dp[i];
        dot = team_sum<S>(dot);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) slot_d[i] = slot_p[i] * (slot_dp[i] - dot);
      } else if (softmax) {
        // ds = c·dp at the selected; dl = s ⊙ (ds − Σ s·ds), with s_m = p_m / c at the selected:
        // −s·Σ s·ds everywhere, and s_m·ds_m = p_m·dp_m at the selected.
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          dense_dot += (slot_p[i] * inv_c) * (c * slot_dp[i]);
          slot_d[i] = slot_p[i] * slot_dp[i];
        }
        dense_dot = team_sum<S>(dense_dot);
      } else {
        float s[kSlots], ds_dl[kSlots];
        float s_sum = 0.0f, dp_dot_p = 0.0f;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          s[i] = 0.0f;
          ds_dl[i] = 0.0f;
          if (i * S < K && valid && i * S + rank < K) {
            const float slot_logit = device::to_float(a.logits[t * E + slot_expert[i]]);
            s[i] = elementwise_score(p.score_function, slot_logit);
            ds_dl[i] = elementwise_score_derivative(p.score_function, slot_logit, s[i]);
          }
          s_sum += s[i];
          dp_dot_p += slot_dp[i] * slot_p[i];
        }
        if (K == 1) {
#pragma unroll
          for (int i = 0; i < kSlots; ++i) slot_d[i] = c * slot_dp[i] * ds_dl[i];
        } else {
          const float inv_norm = 1.0f / (team_sum<S>(s_sum) + kNormEpsilon);
          dp_dot_p = team_sum<S>(dp_dot_p);
#pragma unroll
          for (int i = 0; i < kSlots; ++i)
            slot_d[i] = (c * slot_dp[i] - dp_dot_p) * inv_norm * ds_dl[i];
        }
      }
    }

    // The dense terms of every entry (pre-softmax, aux, z), formed in one pass over the row: w
    // holds softmax(l) (softmax) or g(l) (elementwise, with the aux loss), and nothing else of
    // the row stays live beside it.
    float w[V];
    float row_max = 0.0f, row_sum = 1.0f, exp_neg_max = 0.0f;
    bool shifted = false;
    if (softmax) {
      if (need_row_softmax) {
        row_softmax<S>(l, w, row_max, row_sum);
        const float inv_row_sum = 1.0f / row_sum;
#pragma unroll
        for (int j = 0; j < V; ++j) w[j] *= inv_row_sum;
      }
    } else {
      // The shifted sigmoid when the row allows it: l then holds x = e^(l − m) (as row_softmax
      // forms it, so the z terms are the same to the bit) and w holds r = 1 / (x + e^−m), from
      // which σ = x·r and σ' = σ·(1 − σ) = x·r·e^−m·r.
      if (kShiftedSigmoid<V> && (aux || z) && p.score_function == ScoreFunction::kSigmoid) {
        row_max = row_max_of<S>(l);
        shifted = warp_takes_shifted_sigmoid(row_max, valid);
      }
      if (shifted) {
        exp_neg_max = fast_exp(-row_max);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          l[j] = fast_exp(l[j] - row_max);
          sum += l[j];
          w[j] = reciprocal(l[j] + exp_neg_max);  // ≥ e^−16: a normal float
        }
        if (z) row_sum = team_sum<S>(sum);
      } else {
        if (z) {
          float unused[V];
          row_softmax<S>(l, unused, row_max, row_sum);
        }
        if (aux) elementwise_scores(p.score_function, l, w);
      }
    }
    const float z_scale = z ? z_factor * 2.0f * (row_max + logf(row_sum)) : 0.0f;
    float g[V];
    if (softmax) {
      // Every dense term is softmax(l) times one coefficient of the token (plus f_e's factor):
      // −Σ s·ds (pre-softmax), −Σ s·∂L_aux/∂s (aux), 2β/T·lse (z).
      float coef = z_scale - dense_dot;
      if (aux) {
        float s_dot_g = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) s_dot_g += w[j] * lane_aux_grad(j);
        coef -= team_sum<S>(s_dot_g);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = need_row_softmax ? w[j] * (coef + lane_aux_grad(j)) : 0.0f;
    } else {
      // s_aux = u / S, u = g(l), S = Σu + ε:  du_m = g_m / S − Σ_i g_i u_i / S².
      float inv_norm = 0.0f, shift = 0.0f;
      // u = g(l): w (plain), x·r (shifted). One loop per score function and per term: choices
      // made per entry compiled to a test and a branch per entry.
      auto shifted_u = [&](int j) { return l[j] * w[j]; };
      if (aux) {
        float u_sum = 0.0f, g_dot_u = 0.0f;
        auto add_sums = [&](auto u_of) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float u = u_of(j);
            u_sum += u;  // g(−∞) = 0 past E
            g_dot_u += lane_aux_grad(j) * u;
          }
        };
        if (shifted) {
          add_sums(shifted_u);
        } else {
          add_sums([&](int j) { return w[j]; });
        }
        inv_norm = 1.0f / (team_sum<S>(u_sum) + kNormEpsilon);
        shift = team_sum<S>(g_dot_u) * inv_norm * inv_norm;
      }
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = 0.0f;
      if (aux) {
        auto add_aux_terms = [&](auto derivative) {
          for_entries_inside<S, V, kBackwardRun>(rank, E, [&](int j) {
            g[j] = (lane_aux_grad(j) * inv_norm - shift) * derivative(j);
          });
        };
        if (shifted) {
          add_aux_terms([&](int j) { return shifted_u(j) * (exp_neg_max * w[j]); });
        } else if (p.score_function == ScoreFunction::kSigmoid) {
          add_aux_terms([&](int j) { return sigmoid_derivative(l[j], w[j]); });
        } else {
          add_aux_terms([&](int j) { return sqrtsoftplus_derivative(l[j], w[j]); });
        }
      }
      if (z) {
        const float z_coef = z_scale / row_sum;
        if (shifted) {
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] += z_coef * l[j];
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] += z_coef * fast_exp(l[j] - row_max);
        }
      }
    }

    // The row through shared memory: the dense terms in, each selected entry's term added by
    // its slot's lane (the K experts of a token differ), the row out to dlogits. A lane's chunk
    // goes in and out as whole 16-byte packs where it can, or entry by entry (kStridedLanes).
    if (a.dprob != nullptr) {
      if constexpr (kStrided) {
        write_runs<S>(row, rank, g);
      } else if (vector_chunk) {
#pragma unroll
        for (int i = 0; i < V / 4; ++i)
          reinterpret_cast<float4*>(row + first)[i] =
              make_float4(g[4 * i], g[4 * i + 1], g[4 * i + 2], g[4 * i + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (first + j < E) row[first + j] = g[j];
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        // A token's K experts differ (the forward's top-K), so no two lanes add into one entry;
        // tokens past the end (all slots 0) add nothing.
        if (valid && i * S < K && i * S + rank < K) row[slot_expert[i]] += slot_d[i];
      }
      __syncwarp();
      if constexpr (kStrided) {
        read_runs<S>(row, rank, g);
      } else if (vector_chunk) {
#pragma unroll
        for (int i = 0; i < V / 4; ++i) {
          const float4 v = reinterpret_cast<const float4*>(row + first)[i];
          g[4 * i] = v.x;
          g[4 * i + 1] = v.y;
          g[4 * i + 2] = v.z;
          g[4 * i + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (first + j < E) g[j] = row[first + j];
        }
      }
      __syncwarp();  // the team's next token rewrites the row
    }
    if (valid) {
      if constexpr (kStrided) {
        float* out = a.dlogits + t * E;
        if (a.vector_rows && S * V <= E) {
          write_runs<S>(out, rank, g);
        } else {
          for_entries_inside<S, V, kBackwardRun>(
              rank, E, [&](int j) { out[expert_of<S, V, kBackwardRun>(rank, j)] = g[j]; });
        }
      } else {
        float* out = a.dlogits + t * E + first;
        if (vector_chunk && a.vector_rows) {
#pragma unroll
          for (int i = 0; i < V / 4; ++i)
            reinterpret_cast<float4*>(out)[i] =
                make_float4(g[4 * i], g[4 * i + 1], g[4 * i + 2], g[4 * i + 3]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if (first + j < E) out[j] = g[j];
          }
        }
      }
    }
  }
}

// ---- Launch -------------------------------------------------------------------------------------

template <typename In>
void launch_backward(const RouterParams& p, const RouterBackwardArgs& args, cudaStream_t stream) {
  BackwardKernelArgs<In> k{p,
                           static_cast<const In*>(args.logits),
                           args.tokens,
                           aligned_rows(args.logits, p.num_experts, sizeof(In)) &&
                               aligned_rows(args.dlogits, p.num_experts, sizeof(float)),
                           args.topk_idx,
                           args.topk_p,
                           args.dprob,
                           args.aux_tokens_per_expert,
                           args.aux_factor,
                           args.z_factor,
                           args.loss_factors,
                           args.dlogits};
  dispatch_layout(p.num_experts, [&]<int S, int V>() {
    constexpr int kTeams = kWarpSize / S;
    auto kernel = router_backward_kernel<S, V, In>;
    const std::size_t shared = backward_shared_bytes<S, V>(p.num_experts, args.dprob != nullptr);
    allow_shared_memory(kernel, shared);
    const int blocks = grid_size(reinterpret_cast<const void*>(kernel), shared, args.tokens,
                                 kWarpsPerBlock * kTeams);
    kernel<<<blocks, kThreads, shared, stream>>>(k);
    MOE_CHECK_LAUNCH();
  });
}

}  // namespace

void router_backward(const RouterParams& p, const RouterBackwardArgs& args, cudaStream_t stream) {
  check_params(p);
  check_logits_dtype(args.logits_dtype);
  if (args.tokens < 0)
    fail("router_backward: tokens = " + std::to_string(args.tokens) + " must be >= 0");
  if (args.tokens == 0) return;
  if (args.logits == nullptr || args.topk_idx == nullptr || args.topk_p == nullptr ||
      args.dlogits == nullptr) {
    fail("router_backward: logits, topk_idx, topk_p and dlogits are required");
  }
  if (args.aux_factor != 0.0f && args.aux_tokens_per_expert == nullptr) {
    fail("router_backward: aux_factor is set but aux_tokens_per_expert is null");
  }
  if (args.logits_dtype == DType::kBF16) {
    launch_backward<__nv_bfloat16>(p, args, stream);
  } else {
    launch_backward<float>(p, args, stream);
  }
}

}  // namespace moe
