// Layout, permute, unpermute-combine, their backward, and the EP chunk sort against the fp64
// reference: outputs poisoned before each launch, every element checked, padding rows zero.
#include <algorithm>
#include <numeric>
#include <random>
#include <sstream>

#include "kernels/permute.cuh"
#include "moe/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

reference::Routing draw_routing(std::int64_t tokens, int experts, int topk, bool skewed,
                                std::mt19937_64& rng) {
  reference::Routing routing;
  routing.tokens = tokens;
  routing.topk = topk;
  std::vector<int> all(experts);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<double> prob(0.05, 1.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (!skewed)
      std::shuffle(all.begin(), all.end(), rng);  // skewed: every token to experts 0..K-1
    for (int k = 0; k < topk; ++k) {
      routing.expert.push_back(all[k]);
      routing.prob.push_back(prob(rng));
    }
  }
  return routing;
}

// Values as the device holds them, back in fp64.
Matrix download_matrix(const DeviceBuffer& buffer, std::int64_t rows, std::int64_t cols,
                       DType dtype) {
  Matrix m(rows, cols);
  const auto n = static_cast<std::size_t>(rows * cols);
  if (dtype == DType::kBF16) {
    const auto v = test::download<BF16>(buffer, n);
    for (std::size_t i = 0; i < n; ++i) m.data[i] = from_bf16(v[i]);
  } else {
    const auto v = test::download<float>(buffer, n);
    for (std::size_t i = 0; i < n; ++i) m.data[i] = v[i];
  }
  return m;
}

struct Case {
  std::int64_t tokens;
  int hidden, experts, topk, align;
  bool skewed;
  DType dtype;
  std::string describe() const {
    std::ostringstream s;
    s << "T=" << tokens << " H=" << hidden << " E=" << experts << " K=" << topk
      << " align=" << align << (skewed ? " skewed" : " uniform") << " " << dtype_name(dtype);
    return s.str();
  }
};

void run_case(const Case& c, std::mt19937_64& rng) {
  INFO(c.describe());
  const auto T = c.tokens;
  const int H = c.hidden, E = c.experts, K = c.topk;
  const auto routing = draw_routing(T, E, K, c.skewed, rng);
  const auto layout = reference::make_layout(routing, E, c.align);
  const std::int64_t rows = layout.rows();
  // Inputs rounded to the dtype, so the reference sees exactly what the GPU does.
  const Matrix x = test::round_to(test::random_matrix(T, H, rng), c.dtype);
  const Matrix y = test::round_to(test::random_matrix(rows, H, rng), c.dtype);
  const Matrix dy = test::round_to(test::random_matrix(T, H, rng), c.dtype);
  const double tolerance = c.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  Stream stream;

  // Layout.
  const auto idx_dev = test::upload(routing.expert);
  DeviceBuffer counts(E * 4 + 16), offsets((E + 1) * 4 + 16),
      row_map(static_cast<std::size_t>(T * K) * 4 + 16), workspace(layout_workspace_bytes(T, K, E));
  for (const auto* b : {&counts, &offsets, &row_map}) test::poison(*b);
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
  CHECK(test::relative_error(
            test::to_double(test::download<float>(dprob, static_cast<std::size_t>(T * K))),
            reference::combine_backward_prob(dy, y, layout, routing32)) <= 1e-5);
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
}

}  // namespace

TEST_CASE("layout, permute, combine and their backward over the grid", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::int64_t token_counts[] = {0, 1, 7, 4096};
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

TEST_CASE("permute at T = 65536 and odd widths", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  run_case({65536, 128, 256, 8, 128, false, DType::kBF16}, rng);
  run_case({65536, 128, 8, 2, 16, true, DType::kFP32}, rng);
  run_case({300, 7, 8, 2, 8, false, DType::kFP32}, rng);  // fp32 rows of 28 bytes: element path
  run_case({300, 7168, 256, 8, 64, false, DType::kBF16}, rng);
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
  for (const auto& [sources, local_experts, align, dtype] :
       {std::tuple{1, 1, 0, DType::kFP32}, std::tuple{2, 4, 16, DType::kBF16},
        std::tuple{8, 32, 128, DType::kBF16}, std::tuple{4, 128, 8, DType::kFP32},
        std::tuple{2, 8, 1, DType::kBF16}}) {
    INFO("sources " << sources << " local experts " << local_experts << " align " << align);
    const int H = 256;
    std::uniform_int_distribution<int> count(0, 40);
    reference::ChunkLayout chunks{sources, local_experts, {}};
    for (int i = 0; i < sources * local_experts; ++i)
      chunks.counts.push_back(i % 7 == 3 ? 0 : count(rng));
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
    const ChunkArgs args{counts_dev.as<std::int32_t>(), sources, local_experts, align,
                         workspace.data()};
    const Tensor src_t(src_dev.data(), dtype, {rows, H}),
        em_t(expert_major.data(), dtype, {want.rows, H}), back_t(back.data(), dtype, {rows, H});
    sort_chunks(args, src_t, em_t, nullptr);
    unsort_chunks(args, em_t, back_t, nullptr);
    MOE_CHECK_CUDA(cudaDeviceSynchronize());
    CHECK(download_matrix(expert_major, want.rows, H, dtype).data == want.data);
    CHECK(download_matrix(back, rows, H, dtype).data == source_major.data);
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
  LayoutArgs args;
  args.experts = 0;
  args.topk = 1;
  CHECK_THROWS_WITH(build_layout(args, nullptr), test::contains_text("experts = 0"));
}
