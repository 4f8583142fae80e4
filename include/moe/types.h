// Enumerations and limits that the layer's config shares with the kernels and the reference.
#pragma once

namespace moe {

enum class ScoreFunction { kSoftmax, kSigmoid, kSqrtSoftplus };

// Limits of the GPU kernels; the CPU reference has none.
inline constexpr int kMaxExperts = 2048;
inline constexpr int kMaxTopK = 16;
// The most EP ranks the peer exchange addresses (one host's GPUs); larger groups use NCCL.
inline constexpr int kMaxPeerRanks = 8;

}  // namespace moe
