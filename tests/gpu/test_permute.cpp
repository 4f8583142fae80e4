// Layout, permute, unpermute-combine, their backward, and the EP chunk sort against the fp64
// reference: outputs poisoned before each launch, every element checked, padding rows zero.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>

#include "kernels/fp8_quantize.cuh"
#include "kernels/permute.cuh"
#include "permute_routing.h"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

using test::draw_routing;

using test::download_matrix;

struct Case {
  std::int64_t tokens;
  int hidden, experts, topk, align;
  bool skewed;
  DType dtype;
  // The share of slots dropped (capacity mode on one GPU): they name group E, which has no rows.
  double dropped = 0.0;
  std::string describe() const {
    std::ostringstream s;
    s << "T=" << tokens << " H=" << hidden << " E=" << experts << " K=" << topk
      << " align=" << align << (skewed ? " skewed" : " uniform") << " " << dtype_name(dtype)
      << " dropped " << dropped;
    return s.str();
  }
};

Matrix absolute(Matrix m) {
  for (auto& v : m.data) v = std::fabs(v);
  return m;
}

void run_case(const Case& c, std::mt19937_64& rng) {
  INFO(c.describe());
  const auto T = c.tokens;
  const int H = c.hidden, E = c.experts, K = c.topk;
  const auto routing = draw_routing(T, E, K, c.skewed, rng);
  const auto [kept, topk_idx] = test::drop_slots(routing, E, c.dropped, rng);
  const auto layout = reference::make_layout(routing, kept, E, c.align);
  const std::int64_t rows = layout.rows();
  // Inputs rounded to the dtype, so the reference sees exactly what the GPU does.
  const Matrix x = test::round_to(test::random_matrix(T, H, rng), c.dtype);
  const Matrix y = test::round_to(test::random_matrix(rows, H, rng), c.dtype);
  const Matrix dy = test::round_to(test::random_matrix(T, H, rng), c.dtype);
  const double tolerance = c.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  Stream stream;

  // Layout.
  const auto idx_dev = test::upload(topk_idx);
  DeviceBuffer counts(E * 4 + 16), offsets((E + 1) * 4 + 16),
      row_map(static_cast<std::size_t>(T * K) * 4 + 16), workspace(layout_workspace_bytes(T, K, E));
  for (const auto* b : {&counts, &offsets}) test::poison(*b);
  // Not the poison: its -1 is a dropped slot's row.
  MOE_CHECK_CUDA(cudaMemset(row_map.data(), 0x7F, row_map.bytes()));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  build_layout({idx_dev.as<std::int32_t>(), T, K, E, c.align, counts.as<std::int32_t>(),
                offsets.as<std::int32_t>(), row_map.as<std::int32_t>(), workspace.data()},
               stream.get());
  stream.synchronize();
  const auto got_counts = test::download<std::int32_t>(counts, E);
  const auto got_offsets = test::download<std::int32_t>(offsets, E + 1);
  const auto got_rows = test::download<std::int32_t>(row_map, static_cast<std::size_t>(T * K));
  REQUIRE(std::equal(layout.counts.begin(), layout.counts.end(), got_counts.begin()));
  REQUIRE(std::equal(layout.offsets.begin(), layout.offsets.end(), got_offsets.begin()));
  REQUIRE(std::equal(layout.row.begin(), layout.row.end(), got_rows.begin()));

  const auto prob_dev = test::upload(std::vector<float>(routing.prob.begin(), routing.prob.end()));
  // The reference combines with the probabilities the GPU holds (fp32).
  reference::Routing routing32 = routing;
  for (auto& p : routing32.prob) p = static_cast<float>(p);
  const auto x_dev = test::upload_as(x, c.dtype);
  const auto y_dev = test::upload_as(y, c.dtype);
  const auto dy_dev = test::upload_as(dy, c.dtype);
  const std::size_t elem = dtype_size(c.dtype);
  DeviceBuffer X(static_cast<std::size_t>(rows * H) * elem + 16),
      out(static_cast<std::size_t>(T * H) * elem + 16),
      dY(static_cast<std::size_t>(rows * H) * elem + 16),
      dprob(static_cast<std::size_t>(T * K) * 4 + 16),
      dx(static_cast<std::size_t>(T * H) * elem + 16);
  for (const auto* b : {&X, &out, &dY, &dprob, &dx}) test::poison(*b);
  const Tensor x_t(x_dev.data(), c.dtype, {T, H}), X_t(X.data(), c.dtype, {rows, H}),
      y_t(y_dev.data(), c.dtype, {rows, H}), out_t(out.data(), c.dtype, {T, H}),
      dy_t(dy_dev.data(), c.dtype, {T, H}), dY_t(dY.data(), c.dtype, {rows, H}),
      dx_t(dx.data(), c.dtype, {T, H});
  const auto* rm = row_map.as<std::int32_t>();
  permute_rows(x_t, rm, K, offsets.as<std::int32_t>(), counts.as<std::int32_t>(), E, X_t,
               stream.get());
  unpermute_combine(y_t, rm, prob_dev.as<float>(), K, out_t, stream.get());
  combine_backward(dy_t, y_t, rm, prob_dev.as<float>(), K, offsets.as<std::int32_t>(),
                   counts.as<std::int32_t>(), E, dY_t, dprob.as<float>(), stream.get());
  unpermute_combine(y_t, rm, nullptr, K, dx_t, stream.get());  // the permute backward: plain sum
  stream.synchronize();

  // Permute is a copy: exact, padding rows exactly zero.
  const Matrix got_X = download_matrix(X, rows, H, c.dtype);
  CHECK(got_X.data == reference::permute(x, layout, routing).data);
  CHECK(test::relative_error(download_matrix(out, T, H, c.dtype),
                             reference::unpermute_combine(y, layout, routing32)) <= tolerance);
  const Matrix want_dY = reference::combine_backward_rows(dy, layout, routing32);
  const Matrix got_dY = download_matrix(dY, rows, H, c.dtype);
  CHECK(test::relative_error(got_dY, want_dY) <= tolerance);
  for (std::int64_t i = 0; i < rows * H; ++i) {
    if (want_dY.data[i] == 0.0 && got_dY.data[i] != 0.0)
      FAIL("a padding row of dY is not zero at " << i);
  }
  // dprob[t, k] = Σ_h dy·y: its terms cancel, so its error is measured against the size of what
  // was added, Σ_h |dy·y|, not against the result, which can lie near zero (T·K = 1 failed that
  // at 1.4·10⁻⁵, seed 17669418228028844059).
  {
    const auto got = test::to_double(test::download<float>(dprob, static_cast<std::size_t>(T * K)));
    const auto want = reference::combine_backward_prob(dy, y, layout, routing32);
    const auto scale =
        reference::combine_backward_prob(absolute(dy), absolute(y), layout, routing32);
    double diff = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      diff += (got[i] - want[i]) * (got[i] - want[i]);
      norm += scale[i] * scale[i];
    }
    CHECK(std::sqrt(diff) <= 1e-5 * std::sqrt(norm));
  }
  CHECK(test::relative_error(download_matrix(dx, T, H, c.dtype),
                             reference::permute_backward(y, layout, routing)) <= tolerance);

  // In place, as MoEBlock runs it on one GPU: dY over y, bitwise what the separate buffers gave.
  const auto y_then_dY = test::upload_as(y, c.dtype);
  DeviceBuffer dprob_in_place(static_cast<std::size_t>(T * K) * 4 + 16);
  test::poison(dprob_in_place);
  const Tensor shared(y_then_dY.data(), c.dtype, {rows, H});
  combine_backward(dy_t, shared, rm, prob_dev.as<float>(), K, offsets.as<std::int32_t>(),
                   counts.as<std::int32_t>(), E, shared, dprob_in_place.as<float>(), stream.get());
  stream.synchronize();
  CHECK(download_matrix(y_then_dY, rows, H, c.dtype).data == got_dY.data);
  CHECK(test::download<float>(dprob_in_place, static_cast<std::size_t>(T * K)) ==
        test::download<float>(dprob, static_cast<std::size_t>(T * K)));

  // fp8_dispatch: the combine backward writing records in one pass. Each slot's record is that
  // of the bf16 dY row above (its quantization in a pass of its own), a padding row's record is
  // zero bytes, and dprob is the same bits.
  if (c.dtype != DType::kBF16 || H % 16 != 0) return;
  const std::int64_t record = fp8_row_bytes(H);
  const auto record_buffer = [&] {
    return DeviceBuffer(static_cast<std::size_t>(rows * record) + 16);
  };
  DeviceBuffer records = record_buffer(), want_records = record_buffer(),
               dprob_records(static_cast<std::size_t>(T * K) * 4 + 16);
  for (const auto* b : {&records, &want_records, &dprob_records}) test::poison(*b);
  combine_backward_records(dy_t, y_t, rm, prob_dev.as<float>(), K, offsets.as<std::int32_t>(),
                           counts.as<std::int32_t>(), E, records.data(), dprob_records.as<float>(),
                           stream.get());
  quantize_row_records(dY.data(), rows, H, want_records.data(), stream.get());
  stream.synchronize();
  const auto bytes = test::download<std::uint8_t>(records, static_cast<std::size_t>(rows * record));
  const auto want_bytes =
      test::download<std::uint8_t>(want_records, static_cast<std::size_t>(rows * record));
  std::vector<bool> slot_row(static_cast<std::size_t>(rows), false);
  for (const auto row : layout.row)
    if (row != reference::Layout::kDroppedRow) slot_row[static_cast<std::size_t>(row)] = true;
  std::int64_t wrong_slot_bytes = 0, wrong_padding_bytes = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t b = r * record; b < (r + 1) * record; ++b) {
      const auto i = static_cast<std::size_t>(b);
      if (slot_row[static_cast<std::size_t>(r)]) {
        wrong_slot_bytes += bytes[i] != want_bytes[i];
      } else {
        wrong_padding_bytes += bytes[i] != 0;
      }
    }
  }
  CHECK(wrong_slot_bytes == 0);
  CHECK(wrong_padding_bytes == 0);
  CHECK(test::download<float>(dprob_records, static_cast<std::size_t>(T * K)) ==
        test::download<float>(dprob, static_cast<std::size_t>(T * K)));

  // FP8 experts on one rank: the permute that writes each row's codes and scales beside it. The
  // bf16 rows and the probabilities beside them are those of permute_rows; codes and scales those
  // of the reference's quantizer over the permuted rows (a padding row's: codes 0, scales 1),
  // each group's scales where a product over that group reads them.
  if (H % kFP8Block != 0) return;
  const std::int64_t blocks = H / kFP8Block;
  DeviceBuffer X8(static_cast<std::size_t>(rows * H) * 2 + 16), codes(rows * H + 16),
      scales(static_cast<std::size_t>(rows * blocks) * 4 + 16), beside(rows * 4 + 16),
      beside8(rows * 4 + 16);
  for (const auto* b : {&X8, &codes, &scales, &beside, &beside8}) test::poison(*b);
  const Tensor X8_t(X8.data(), c.dtype, {rows, H});
  REQUIRE(permute_rows_fp8_applies(x_t, X8_t));
  permute_rows(x_t, rm, K, offsets.as<std::int32_t>(), counts.as<std::int32_t>(), E, X_t,
               stream.get(), prob_dev.as<float>(), beside.as<float>());
  permute_rows_fp8(x_t, rm, idx_dev.as<std::int32_t>(), K, offsets.as<std::int32_t>(),
                   counts.as<std::int32_t>(), E, X8_t,
                   {codes.as<std::uint8_t>(), scales.as<float>()}, stream.get(),
                   prob_dev.as<float>(), beside8.as<float>());
  stream.synchronize();
  CHECK(download_matrix(X8, rows, H, c.dtype).data == got_X.data);
  CHECK(test::download<float>(beside8, static_cast<std::size_t>(rows)) ==
        test::download<float>(beside, static_cast<std::size_t>(rows)));
  const reference::BlockQuantized want = reference::quantize_row_blocks(got_X);
  const auto got_codes = test::download<std::uint8_t>(codes, static_cast<std::size_t>(rows * H));
  const auto got_scales = test::download<float>(scales, static_cast<std::size_t>(rows * blocks));
  CHECK(got_codes == want.codes);
  std::int64_t wrong_scales = 0;
  for (int g = 0; g < E; ++g) {
    const std::int64_t first = layout.offsets[g], group = layout.group_rows(g);
    for (std::int64_t i = 0; i < group; ++i) {
      for (std::int64_t b = 0; b < blocks; ++b) {
        const auto at = static_cast<std::size_t>(first * blocks + b * group + i);
        wrong_scales +=
            got_scales[at] != want.scales[static_cast<std::size_t>((first + i) * blocks + b)];
      }
    }
  }
  CHECK(wrong_scales == 0);
}

}  // namespace

TEST_CASE("layout, permute, combine and their backward over the grid", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::int64_t token_counts[] = {0, 1, 7, test::by_run_size(300, 1024, 4096)};
  const int hiddens[] = {128, 2048, 7168,
                         100};  // 100: bf16 rows of 200 bytes take the element path
  int index = 0;
  for (const int E : {1, 8, 128, 256}) {
    for (const int K : {1, 2, 8}) {
      if (K > E) continue;
      for (const int align : {0, 1, 8, 16, 32, 64, 128}) {
        for (const bool skewed : {false, true}) {
          ++index;
          const std::int64_t T = token_counts[index % 4];
          int H = hiddens[(index / 4) % 4];
          while (H > 128 && T * K * H > (std::int64_t{1} << 24))
            H /= 2;  // keep the fp64 reference small
          const DType dtype = index % 3 == 0 ? DType::kFP32 : DType::kBF16;
          run_case({T, H, E, K, align, skewed, dtype}, rng);
        }
      }
    }
  }
}

// Capacity mode on one GPU: dropped slots name group E, past the layout's groups. They get row -1
// and count nowhere; the permute stores nothing for them, the combines add nothing from them, the
// combine backward stores no dY row and gives them dprob 0, over the grid's shapes and paths
// (test_permute_dropped.cpp guards row -1 itself and the probabilities beside the rows).
TEST_CASE("dropped slots have no row in the layout or the row kernels", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const double share : {0.2, 0.7, 1.0}) {
    run_case({301, 256, 8, 2, 16, false, DType::kBF16, share}, rng);
    run_case({1000, 128, 128, 8, 128, false, DType::kBF16, share}, rng);
    run_case({77, 100, 16, 4, 8, true, DType::kBF16, share}, rng);  // element path
    run_case({129, 64, 32, 8, 0, true, DType::kFP32, share}, rng);
  }
  run_case({test::by_run_size(4096, 16384, 65536), 128, 256, 8, 128, false, DType::kBF16, 0.1},
           rng);
}

TEST_CASE("permute at many tokens and odd widths", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::int64_t many = test::by_run_size(4096, 16384, 65536);
  run_case({many, 128, 256, 8, 128, false, DType::kBF16}, rng);
  run_case({many, 128, 8, 2, 16, true, DType::kFP32}, rng);
  run_case({300, 7, 8, 2, 8, false, DType::kFP32}, rng);  // fp32 rows of 28 bytes: element path
  run_case({300, 7168, 256, 8, 64, false, DType::kBF16}, rng);
  // Widths whose last 128-value scale block is partial, for the combine backward's records.
  run_case({300, 144, 8, 2, 16, false, DType::kBF16}, rng);
  run_case({77, 272, 16, 4, 8, true, DType::kBF16}, rng);
  // Top-6 and top-16 over rows of whole 128-value blocks, for the permute that quantizes.
  run_case({150, 384, 12, 6, 8, true, DType::kBF16}, rng);
  run_case({200, 256, 32, 16, 16, false, DType::kBF16, 0.3}, rng);
}

// The layout's scan splits each expert's column of block histograms over 32 lanes (E ≤ 32) down
// to one (E ≥ 1024, in two passes above 1024 experts): every split, on columns long enough to
// take several chunks of loads.
TEST_CASE("layout at every column split of its scan", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  run_case({70001, 16, 3, 2, 8, true, DType::kBF16}, rng);       // 32 lanes per column
  run_case({40000, 16, 33, 4, 16, false, DType::kBF16}, rng);    // 16
  run_case({30000, 16, 100, 8, 4, true, DType::kFP32}, rng);     // 8
  run_case({20000, 16, 1024, 8, 16, false, DType::kBF16}, rng);  // 1
  run_case({9000, 16, 2048, 16, 32, true, DType::kBF16}, rng);   // 1, two passes
  run_case({1, 16, 2048, 16, 0, false, DType::kBF16}, rng);
}

TEST_CASE("EP chunk sort to and from the padded expert-major layout", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // The last two: fixed blocks, every chunk the same count, given as uniform_count (no counts on
  // the device).
  for (const auto& [sources, local_experts, align, dtype, uniform] :
       {std::tuple{1, 1, 0, DType::kFP32, 0}, std::tuple{2, 4, 16, DType::kBF16, 0},
        std::tuple{8, 32, 128, DType::kBF16, 0}, std::tuple{4, 128, 8, DType::kFP32, 0},
        std::tuple{2, 8, 1, DType::kBF16, 0}, std::tuple{3, 5, 16, DType::kBF16, 32},
        std::tuple{2, 3, 0, DType::kFP32, 7}}) {
    INFO("sources " << sources << " local experts " << local_experts << " align " << align
                    << " uniform count " << uniform);
    const int H = 256;
    std::uniform_int_distribution<int> count(0, 40);
    reference::ChunkLayout chunks{sources, local_experts, {}};
    for (int i = 0; i < sources * local_experts; ++i)
      chunks.counts.push_back(uniform > 0 ? uniform : i % 7 == 3 ? 0 : count(rng));
    std::int64_t rows = 0;
    for (const auto c : chunks.counts) rows += c;
    const Matrix source_major = test::round_to(test::random_matrix(rows, H, rng), dtype);
    const Matrix want = reference::sort_chunks(source_major, chunks, align);

    const std::vector<std::int32_t> counts32(chunks.counts.begin(), chunks.counts.end());
    const auto counts_dev = test::upload(counts32);
    DeviceBuffer workspace(chunk_workspace_bytes(sources, local_experts));
    const auto src_dev = test::upload_as(source_major, dtype);
    const std::size_t elem = dtype_size(dtype);
    DeviceBuffer expert_major(static_cast<std::size_t>(want.rows * H) * elem + 16),
        back(static_cast<std::size_t>(rows * H) * elem + 16);
    test::poison(expert_major);
    test::poison(back);
    const ChunkArgs args{uniform > 0 ? nullptr : counts_dev.as<std::int32_t>(),
                         sources,
                         local_experts,
                         align,
                         workspace.data(),
                         uniform};
    const Tensor src_t(src_dev.data(), dtype, {rows, H}),
        em_t(expert_major.data(), dtype, {want.rows, H}), back_t(back.data(), dtype, {rows, H});
    sort_chunks(args, src_t, em_t, nullptr);
    unsort_chunks(args, em_t, back_t, nullptr);
    MOE_CHECK_CUDA(cudaDeviceSynchronize());
    CHECK(download_matrix(expert_major, want.rows, H, dtype).data == want.data);
    CHECK(download_matrix(back, rows, H, dtype).data == source_major.data);
  }
}

// The peer kernels address each slot's row in the buffer of its expert's rank. On one GPU, R
// buffers stand in for R ranks: rank r holds experts [r·E_loc, (r + 1)·E_loc) and the slice of
// the padded layout they own, so every result must equal the local kernels' bitwise. With
// capacity mode's dropped slots (group E, no row; the local kernels' results checked against the
// reference in test_permute_dropped.cpp) the row map gives them -1, and the peer kernels, which
// would fault on the null pointer such a slot has, skip them as the local ones do.
TEST_CASE("peer kernels over rows split between ranks' buffers equal the local kernels",
          "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [T, H, E, K, ranks, align, dtype] :
       {std::tuple{37, 72, 8, 2, 2, 16, DType::kBF16},
        std::tuple{41, 13, 24, 6, 3, 8, DType::kFP32},
        std::tuple{300, 64, 64, 16, 8, 16, DType::kBF16},
        std::tuple{1, 40, 8, 4, 4, 1, DType::kBF16}, std::tuple{0, 64, 8, 2, 2, 16, DType::kBF16}})
    for (const double dropped : {0.0, 0.4}) {
      INFO("T=" << T << " H=" << H << " E=" << E << " K=" << K << " ranks=" << ranks
                << " align=" << align << " " << dtype_name(dtype) << " dropped " << dropped);
      const int E_loc = E / ranks;
      const auto routing = draw_routing(T, E, K, false, rng);
      const auto [kept, topk_idx] = test::drop_slots(routing, E, dropped, rng);
      const auto layout = reference::make_layout(routing, kept, E, align);
      const std::int64_t rows = layout.rows();
      const Matrix x = test::round_to(test::random_matrix(T, H, rng), dtype);
      const Matrix y = test::round_to(test::random_matrix(rows, H, rng), dtype);
      const Matrix dy = test::round_to(test::random_matrix(T, H, rng), dtype);
      Stream stream;
      const std::size_t elem = dtype_size(dtype), row_bytes = static_cast<std::size_t>(H) * elem;
      auto first_row = [&](int r) { return layout.offsets[static_cast<std::size_t>(r * E_loc)]; };

      // The local kernels on the whole layout: what every split must reproduce.
      const auto idx = test::upload(topk_idx);
      const std::vector<std::int32_t> row32(layout.row.begin(), layout.row.end());
      const auto row_map = test::upload(row32);
      const auto prob = test::upload(std::vector<float>(routing.prob.begin(), routing.prob.end()));
      std::vector<std::int32_t> offsets32(layout.offsets.begin(), layout.offsets.end()),
          counts32(layout.counts.begin(), layout.counts.end());
      const auto offsets = test::upload(offsets32), counts = test::upload(counts32);
      const auto x_dev = test::upload_as(x, dtype), y_dev = test::upload_as(y, dtype),
                 dy_dev = test::upload_as(dy, dtype), y_local = test::upload_as(y, dtype);
      DeviceBuffer X(rows * row_bytes + 16), out(T * row_bytes + 16), dx(T * row_bytes + 16),
          dprob(static_cast<std::size_t>(T * K) * 4 + 16), row_prob(rows * 4 + 16);
      for (const auto* b : {&X, &dprob, &row_prob}) test::poison(*b);
      const Tensor x_t(x_dev.data(), dtype, {T, H}), dy_t(dy_dev.data(), dtype, {T, H});
      const auto* rm = row_map.as<std::int32_t>();
      // The probabilities beside the rows and back: row_prob[row(t, k)] = p[t, k] (padding 0), and
      // the dispatch backward's gather of the floats beside the rows returns p itself.
      permute_rows(x_t, rm, K, offsets.as<std::int32_t>(), counts.as<std::int32_t>(), E,
                   Tensor(X.data(), dtype, {rows, H}), stream.get(), prob.as<float>(),
                   row_prob.as<float>());
      unpermute_combine(Tensor(y_dev.data(), dtype, {rows, H}), rm, prob.as<float>(), K,
                        Tensor(out.data(), dtype, {T, H}), stream.get());
      unpermute_combine(Tensor(y_dev.data(), dtype, {rows, H}), rm, nullptr, K,
                        Tensor(dx.data(), dtype, {T, H}), stream.get(), row_prob.as<float>(),
                        dprob.as<float>());
      // The combine backward with probabilities inside the experts: dy permuted over Y.
      const Tensor y_in_place(y_local.data(), dtype, {rows, H});
      permute_rows(dy_t, rm, K, offsets.as<std::int32_t>(), counts.as<std::int32_t>(), E,
                   y_in_place, stream.get());
      stream.synchronize();
      const auto got_row_prob = test::download<float>(row_prob, static_cast<std::size_t>(rows));
      std::vector<float> want_row_prob(static_cast<std::size_t>(rows), 0.0f);
      for (std::int64_t i = 0; i < T * K; ++i)
        if (kept[i] != 0) want_row_prob[layout.row[i]] = static_cast<float>(routing.prob[i]);
      CHECK(got_row_prob == want_row_prob);
      // dprob: each kept slot's probability, read from beside its row; 0 for a dropped slot.
      std::vector<float> probs32(routing.prob.begin(), routing.prob.end());
      for (std::int64_t i = 0; i < T * K; ++i)
        if (kept[i] == 0) probs32[i] = 0.0f;
      CHECK(test::download<float>(dprob, static_cast<std::size_t>(T * K)) == probs32);

      // Slot rows on their ranks: the row in the whole layout minus the rank's first row.
      std::vector<std::int32_t> shift(E);
      for (int g = 0; g < E; ++g) shift[g] = static_cast<std::int32_t>(-first_row(g / E_loc));
      const auto shift_dev = test::upload(shift);
      DeviceBuffer slot_rows(static_cast<std::size_t>(T * K) * 4 + 16);
      test::poison(slot_rows);
      peer_row_map(rm, idx.as<std::int32_t>(), shift_dev.as<std::int32_t>(), T * K,
                   slot_rows.as<std::int32_t>(), stream.get());
      stream.synchronize();
      const auto got_slot_rows =
          test::download<std::int32_t>(slot_rows, static_cast<std::size_t>(T * K));
      for (std::int64_t i = 0; i < T * K; ++i) {
        REQUIRE(got_slot_rows[i] ==
                (kept[i] != 0 ? layout.row[i] - first_row(routing.expert[i] / E_loc) : -1));
      }

      // Each rank's buffers: X (filled by the dispatch) with the probabilities beside it, and Y
      // (y's slice, combined, then dY).
      std::vector<DeviceBuffer> X_of, Y_of, P_of;
      std::vector<DeviceBuffer> own_offsets, own_counts;
      PeerRows X_rows, Y_rows;
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t begin = first_row(r), end = first_row(r + 1);
        X_of.emplace_back((end - begin) * row_bytes + 16);
        test::poison(X_of.back());
        P_of.emplace_back((end - begin) * 4 + 16);
        test::poison(P_of.back());
        Y_of.emplace_back((end - begin) * row_bytes + 16);
        MOE_CHECK_CUDA(cudaMemcpy(Y_of.back().data(), y_dev.as<char>() + begin * row_bytes,
                                  (end - begin) * row_bytes, cudaMemcpyDeviceToDevice));
        std::vector<std::int32_t> own_off, own_count;
        for (int e = 0; e <= E_loc; ++e) own_off.push_back(offsets32[r * E_loc + e] - begin);
        for (int e = 0; e < E_loc; ++e) own_count.push_back(counts32[r * E_loc + e]);
        own_offsets.push_back(test::upload(own_off));
        own_counts.push_back(test::upload(own_count));
        X_rows.base[r] = X_of.back().data();
        Y_rows.base[r] = Y_of.back().data();
        X_rows.scalars[r] = Y_rows.scalars[r] = P_of.back().data();
      }
      for (PeerRows* p : {&X_rows, &Y_rows}) {
        p->ranks = ranks;
        p->experts_per_rank = E_loc;
        p->topk_idx = idx.as<std::int32_t>();
        p->rows = slot_rows.as<std::int32_t>();
      }
      auto own = [&](std::vector<DeviceBuffer>& of, int r) {
        return Tensor(of[r].data(), dtype, {first_row(r + 1) - first_row(r), H});
      };
      // The dispatch, once as each rank (each zeroes its own padding; the rows are the same
      // stores).
      for (int r = 0; r < ranks; ++r) {
        peer_permute(x_t, X_rows, K, own_offsets[r].as<std::int32_t>(),
                     own_counts[r].as<std::int32_t>(), E_loc, own(X_of, r), stream.get(),
                     prob.as<float>(), P_of[r].as<float>());
      }
      DeviceBuffer peer_out(T * row_bytes + 16), peer_dx(T * row_bytes + 16),
          peer_dprob(static_cast<std::size_t>(T * K) * 4 + 16);
      for (const auto* b : {&peer_out, &peer_dx, &peer_dprob}) test::poison(*b);
      peer_unpermute_combine(Y_rows, prob.as<float>(), K, Tensor(peer_out.data(), dtype, {T, H}),
                             stream.get());
      peer_unpermute_combine(Y_rows, nullptr, K, Tensor(peer_dx.data(), dtype, {T, H}),
                             stream.get(), peer_dprob.as<float>());
      // The combine backward: dy stored at every slot's row over Y (rank 0 zeroes its padding).
      peer_permute(dy_t, Y_rows, K, own_offsets[0].as<std::int32_t>(),
                   own_counts[0].as<std::int32_t>(), E_loc, own(Y_of, 0), stream.get());
      stream.synchronize();

      const auto n = static_cast<std::size_t>(T * H) * elem;
      CHECK(test::download<char>(peer_out, n) == test::download<char>(out, n));
      CHECK(test::download<char>(peer_dx, n) == test::download<char>(dx, n));
      CHECK(test::download<float>(peer_dprob, static_cast<std::size_t>(T * K)) ==
            test::download<float>(dprob, static_cast<std::size_t>(T * K)));
      const auto whole_X = test::download<char>(X, rows * row_bytes);
      const auto whole_dY = test::download<char>(y_local, rows * row_bytes);
      for (int r = 0; r < ranks; ++r) {
        INFO("rank " << r);
        const std::int64_t begin = first_row(r), end = first_row(r + 1);
        const auto got_X = test::download<char>(X_of[r], (end - begin) * row_bytes);
        CHECK(std::equal(got_X.begin(), got_X.end(), whole_X.begin() + begin * row_bytes));
        const auto got_P = test::download<float>(P_of[r], static_cast<std::size_t>(end - begin));
        CHECK(std::equal(got_P.begin(), got_P.end(), want_row_prob.begin() + begin));
        // dY in place: every routed row; rank 0 (the caller) also zeroed its padding.
        const auto got_dY = test::download<char>(Y_of[r], (end - begin) * row_bytes);
        for (int e = r * E_loc; e < (r + 1) * E_loc; ++e) {
          const std::int64_t last =
              r == 0 ? layout.offsets[e + 1] : layout.offsets[e] + layout.counts[e];
          for (std::int64_t row = layout.offsets[e]; row < last; ++row) {
            INFO("row " << row);
            REQUIRE(std::equal(got_dY.begin() + (row - begin) * row_bytes,
                               got_dY.begin() + (row - begin + 1) * row_bytes,
                               whole_dY.begin() + row * row_bytes));
          }
        }
      }
    }
}

TEST_CASE("permute kernels reject bad arguments", "[gpu][permute]") {
  float storage[4] = {};
  const Tensor ints(storage, DType::kInt32, {1, 4});
  const Tensor floats(storage, DType::kFP32, {1, 4});
  CHECK_THROWS_WITH(permute_rows(ints, nullptr, 1, nullptr, nullptr, 1, floats, nullptr),
                    test::contains_text("dtype int32"));
  CHECK_THROWS_WITH(permute_rows(floats, nullptr, 17, nullptr, nullptr, 1, floats, nullptr),
                    test::contains_text("topk = 17"));
  CHECK_THROWS_WITH(
      permute_rows(floats, nullptr, 1, nullptr, nullptr, 1, floats, nullptr, storage, nullptr),
      test::contains_text("prob and row_prob must be given together"));
  CHECK_THROWS_WITH(
      unpermute_combine(floats, nullptr, nullptr, 1, floats, nullptr, nullptr, storage),
      test::contains_text("row_grad and dprob must be given together"));
  LayoutArgs args;
  args.experts = 0;
  args.topk = 1;
  CHECK_THROWS_WITH(build_layout(args, nullptr), test::contains_text("experts = 0"));
  // Slots that fit the int32 row index, but not with the padding the scan may add to them.
  args.experts = 2048;
  args.topk = 8;
  args.align = 4096;
  args.tokens = (std::int64_t{INT32_MAX} - 2048 * 4095) / 8 + 1;
  CHECK_THROWS_WITH(build_layout(args, nullptr), test::contains_text("exceed the int32 row index"));
}

// Capacity mode over the peer exchange: a dropped slot (group E of the kept routing, row -1 in
// the sender's layout) has no row on any rank, so the row map gives it -1 and reads no shift for
// it (the shifts stop at E).
TEST_CASE("peer row map of a kept routing: dropped slots have no row", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 8, slots = 1000;
  std::uniform_int_distribution<int> group(0, E);  // E: dropped
  std::uniform_int_distribution<int> row(0, 5000), offset(-3000, 3000);
  std::vector<std::int32_t> idx(slots), row_map(slots), shift(E);
  for (int i = 0; i < slots; ++i) {
    idx[i] = group(rng);
    row_map[i] = idx[i] < E ? row(rng) : -1;
  }
  for (auto& s : shift) s = offset(rng);
  const auto idx_dev = test::upload(idx), row_map_dev = test::upload(row_map),
             shift_dev = test::upload(shift);
  DeviceBuffer rows(slots * 4);
  test::poison(rows);
  Stream stream;
  peer_row_map(row_map_dev.as<std::int32_t>(), idx_dev.as<std::int32_t>(),
               shift_dev.as<std::int32_t>(), slots, rows.as<std::int32_t>(), stream.get());
  stream.synchronize();
  const auto got_rows = test::download<std::int32_t>(rows, slots);
  int dropped = 0;
  for (int i = 0; i < slots; ++i) {
    INFO("slot " << i << " group " << idx[i]);
    REQUIRE(got_rows[i] == (idx[i] < E ? row_map[i] + shift[idx[i]] : -1));
    dropped += idx[i] == E;
  }
  CHECK(dropped > 0);
}
