// Router logits for the GPU tests: drawn without near-ties, with exact ties, and moved to the
// ranges where the router's arithmetic takes another path. Host-side, against the reference.
#pragma once

#include <random>
#include <vector>

#include "moe/tensor.h"
#include "reference/reference.h"

namespace moe::test {

// Logits drawn without near-ties: each row a random permutation of an evenly spaced grid, shifted
// by a random offset, then rounded to the dtype (exact ties after rounding are fine: both sides
// see the same values and break them by index).
reference::Matrix draw_logits(std::int64_t tokens, int experts, DType dtype, std::mt19937_64& rng);

// Biases in bands 2 apart: a biased score never lands within rounding of another band's.
std::vector<double> draw_bias(int experts, std::mt19937_64& rng);

// Rows whose top holds `tied` exactly equal largest logits (1 to 48 of them at random places, the
// rest spaced below): ties go to the lower index, whether the selection keeps a few survivors of
// its pre-filter or falls back to K rounds (more than 32 survivors).
reference::Matrix draw_tied_logits(std::int64_t tokens, int experts, std::mt19937_64& rng);

// Rows outside the range where the backward takes the shifted sigmoid (largest logit in
// [−80, 16], kernels/router_device.cuh): every third row has its largest logit raised to 17, every
// third one (t % 3 == 1) is lowered by 84 as a whole; the others stay. Raised rows keep their top K
// apart in fp32 (17, then the grid's largest, ≤ 5), unlike a whole row near 17, where σ rounds
// to 1. Lowered rows stay above −87.3 at E = 8, where the selection under biases can reach any
// entry: below it the sigmoid's fast division flushes to 0, and the reference's tiny scores there
// would be near-ties (seen at −86).
void move_rows_to_the_sigmoid_fallback(reference::Matrix& logits);

// Rows whose largest entries crowd into one lane of the strided layout (from 32 entries per lane,
// lane r holds experts r, r + 32, ...): every other row's values rearranged so that its largest
// sit on the experts ≡ t (mod 32), the rest on the other experts at random. More than 32 entries
// then reach the threshold selection's bound without any tie, and it takes the rounds instead
// (strided_top_k in kernels/router_select.cuh). The values themselves, and so their gaps, are
// unchanged.
void crowd_rows_into_one_lane(reference::Matrix& logits, std::mt19937_64& rng);

// Logits of ±1e4 (fp32), where every exponential of the router over- or underflows: rows with
// t % 3 == 0 are −1e4 everywhere but K random experts at +1e4; rows with t % 3 == 1 are ±1e4 at
// random (ties go to the lower index on both sides); the others keep their values but for a
// quarter of the experts at −1e4.
void move_rows_to_the_extremes(reference::Matrix& logits, int topk, std::mt19937_64& rng);

}  // namespace moe::test
