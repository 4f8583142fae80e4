// The grouped block-scaled FP8 products (kernels/grouped_fp8_gemm.cuh) against the fp64 products
// of the dequantized operands, as the layer's quantizers write them: groups without rows, of 16
// rows, of more than a tile and of a few tiles with a remainder; N and K with partial tiles and
// blocks, one K block and more than the pipeline's stages; many groups; every block and tile at
// a scale of its own, and outliers; the output poisoned before the launch, so a row or column
// left unwritten fails.
//
// The bound is test_experts_fp8's: 2^-9 of the exact value (the bf16 output's rounding) plus
// 2^-8 of Σ|a·b| (the tensor cores' accumulation of a block's products). A scale read from the
// wrong place errs by 2^-4 to 2^-2 of Σ|a·b|, far outside it.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include "kernels/fp8_quantize.cuh"
#include "kernels/gemm_fp8.h"
#include "kernels/grouped_fp8_gemm.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

struct Case {
  std::int64_t n, k;
  std::vector<std::int64_t> rows;  // per group
  bool outliers = false;
  std::string describe() const {
    std::ostringstream s;
    s << "N=" << n << " K=" << k << " rows";
    for (auto r : rows) s << " " << r;
    s << (outliers ? " outliers" : "");
    return s.str();
  }
};

std::int64_t blocks(std::int64_t cols) {
  return (cols + kFP8Block - 1) / kFP8Block;
}

// Each block of `rows` x 128 columns (A's row blocks: 1; B's tiles: 128) times its own 2^e, e in
// [-4, 4]: blocks of different scales, so that a scale read for the wrong block, tile or group
// shows.
void scale_blocks(Matrix& m, std::int64_t rows, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> exponent(-4, 4);
  for (std::int64_t r0 = 0; r0 < m.rows; r0 += rows)
    for (std::int64_t c0 = 0; c0 < m.cols; c0 += kFP8Block) {
      const double factor = std::ldexp(1.0, exponent(rng));
      for (std::int64_t r = r0; r < std::min(r0 + rows, m.rows); ++r)
        for (std::int64_t c = c0; c < std::min(c0 + kFP8Block, m.cols); ++c) m(r, c) *= factor;
    }
}

// A few tokens 8 times larger or smaller, and single values 30 times their row's.
void add_outliers(Matrix& m, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> row(0, m.rows - 1), col(0, m.cols - 1);
  for (int i = 0; i < 4; ++i) {
    const std::int64_t r = row(rng);
    const double factor = i % 2 == 0 ? 8.0 : 0.125;
    for (std::int64_t c = 0; c < m.cols; ++c) m(r, c) *= factor;
  }
  for (int i = 0; i < 8; ++i) m(row(rng), col(rng)) *= 30.0;
}

void check_case(const Case& c, std::mt19937_64& rng) {
  INFO(c.describe());
  const std::int64_t groups = static_cast<std::int64_t>(c.rows.size()), N = c.n, K = c.k;
  std::vector<std::int64_t> offsets{0};
  for (auto r : c.rows) offsets.push_back(offsets.back() + r);
  const std::int64_t M = offsets.back(), KB = blocks(K);
  const ScaleBuffer tiles = tile_scales(N, K);

  Matrix a = test::random_matrix(std::max<std::int64_t>(M, 1), K, rng);
  Matrix b = test::random_matrix(groups * N, K, rng, 1.0 / std::sqrt(static_cast<double>(K)));
  scale_blocks(a, 1, rng);
  // Tiles of 128 rows from each group's first: N is a multiple of 128 or the last tile is short.
  for (std::int64_t g = 0; g < groups; ++g) {
    Matrix tile_rows(N, K);
    std::copy_n(b.data.begin() + g * N * K, N * K, tile_rows.data.begin());
    scale_blocks(tile_rows, kFP8Block, rng);
    std::copy_n(tile_rows.data.begin(), N * K, b.data.begin() + g * N * K);
  }
  if (c.outliers) {
    if (M > 0) add_outliers(a, rng);
    add_outliers(b, rng);
  }
  const DeviceBuffer a_bf16 = test::upload_as(a, DType::kBF16);
  const DeviceBuffer b_bf16 = test::upload_as(b, DType::kBF16);
  DeviceBuffer a_codes(std::max<std::int64_t>(M * K, 16)),
      a_scales(std::max<std::int64_t>(M * KB, 4) * sizeof(float));
  DeviceBuffer b_codes(groups * N * K), b_scales(groups * tiles.count * sizeof(float));
  // Past the output, guard bytes that stay poisoned unless a tile stores outside C.
  constexpr std::int64_t kGuardBytes = 4096;
  DeviceBuffer out(std::max<std::int64_t>(M * N, 8) * 2 + kGuardBytes);
  const Stream stream;
  quantize_row_blocks_segmented(a_bf16.data(), offsets, K, a_codes.as<std::uint8_t>(),
                                a_scales.as<float>(), stream.get());
  quantize_tiles(b_bf16.data(), groups, N, K,
                 TileOutput{b_codes.as<std::uint8_t>(), b_scales.as<float>(), tiles}, TileOutput{},
                 stream.get());
  stream.synchronize();
  test::poison(out);
  const GroupedFp8Operands operands{.a = a_codes.as<std::uint8_t>(),
                                    .a_scales = a_scales.as<float>(),
                                    .b = b_codes.as<std::uint8_t>(),
                                    .b_scales = b_scales.as<float>(),
                                    .b_scale_stride = tiles.count,
                                    .c = out.data()};
  grouped_fp8_gemm(offsets, N, K, operands, stream.get());
  stream.synchronize();
  {
    const auto all = test::download<std::uint8_t>(out, out.bytes());
    std::int64_t touched = 0;
    for (std::size_t i = all.size() - kGuardBytes; i < all.size(); ++i) touched += all[i] != 0xFF;
    INFO("guard bytes written past C: " << touched);
    CHECK(touched == 0);
  }
  if (M == 0) return;

  const auto qa = test::download<std::uint8_t>(a_codes, M * K);
  const auto sa = test::download<float>(a_scales, M * KB);
  const auto qb = test::download<std::uint8_t>(b_codes, groups * N * K);
  const auto sb = test::download<float>(b_scales, groups * tiles.count);
  const auto got = test::download<BF16>(out, M * N);
  std::int64_t outside = 0;
  double worst = 0;
  std::vector<double> row_a(K), db(N * K);
  for (std::int64_t g = 0; g < groups; ++g) {
    for (std::int64_t j = 0; j < N; ++j)
      for (std::int64_t kk = 0; kk < K; ++kk)
        db[j * K + kk] = reference::from_e4m3(qb[(g * N + j) * K + kk]) *
                         sb[g * tiles.count + (j / kFP8Block) * tiles.layout.stride_a +
                            (kk / kFP8Block) * tiles.layout.stride_b];
    const std::int64_t first = offsets[g], m_g = c.rows[g];
    for (std::int64_t i = 0; i < m_g; ++i) {
      for (std::int64_t kk = 0; kk < K; ++kk)
        row_a[kk] = reference::from_e4m3(qa[(first + i) * K + kk]) *
                    sa[first * KB + (kk / kFP8Block) * m_g + i];
      for (std::int64_t j = 0; j < N; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t kk = 0; kk < K; ++kk) {
          const double w = db[j * K + kk];
          exact += row_a[kk] * w;
          magnitude += std::fabs(row_a[kk] * w);
        }
        const double value = from_bf16(got[(first + i) * N + j]);
        const double error = std::fabs(value - exact);
        const double bound = std::ldexp(std::fabs(exact), -9) + std::ldexp(magnitude, -8) + 1e-30;
        if (!(error <= bound)) ++outside;  // a NaN (poison left) counts
        worst = std::max(worst, std::isfinite(error) ? error / bound : 1e30);
      }
    }
  }
  INFO("worst error / bound " << worst);
  CHECK(outside == 0);
}

}  // namespace

TEST_CASE("grouped FP8 products equal the dequantized operands' fp64 products", "[gpu][fp8]") {
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  if (!grouped_fp8_gemm_supported(device)) {
    WARN("the grouped FP8 products need compute capability 9.0 and a build for sm_90a");
    return;
  }
  std::mt19937_64 rng(test::fresh_seed());
  const Case cases[] = {
      {256, 256, {16, 0, 128, 144, 272}},
      {144, 144, {32, 160}},                  // a partial tile and a partial block
      {384, 640, {528, 0, 16, 48, 256, 80}},  // five K blocks, past the four stages
      {128, 128, {0, 0, 0}},                  // no rows: nothing to launch
      {272, 400, {112, 208}, true},           // outliers; N and K both partial
      {1536, 512, {64, 400}},                 // twelve N tiles
      {128, 112, {16, 96}},                   // one K block: the pipeline's prologue alone
      {4096, 256, {1200, 16}},  // 192 tiles: a block's second and later tiles, past the SMs
      // 162 tiles of all three heights, five K blocks: a block's ring of four stages wraps within
      // a tile and carries on into its next one.
      {1536, 640, {600, 300, 1000, 16, 0, 450, 200, 100, 40}},
      // Rows that are no multiple of 16, rests of 192 and 255 past 256 rows.
      {256, 256, {1, 17, 63, 65, 129, 193, 255, 448, 511}},
      {64, 32, {16, 70}},  // N below a tile, one K block of 32
      {16, 16, {3}},       // the smallest product
  };
  for (const Case& c : cases) check_case(c, rng);
  // Many groups, a third of them without rows: the blocks' search for their group.
  Case many{160, 256, {}};
  std::uniform_int_distribution<int> sixteens(0, 12);
  for (int g = 0; g < 40; ++g) many.rows.push_back(g % 3 == 1 ? 0 : 16 * sixteens(rng));
  check_case(many, rng);
  // The most groups, empty ones first and last.
  Case most{128, 128, std::vector<std::int64_t>(kMaxGroupedGemmGroups, 0)};
  for (int g = 1; g + 1 < kMaxGroupedGemmGroups; ++g) most.rows[g] = g % 4 == 0 ? 0 : 8 * (g % 7);
  check_case(most, rng);
}

TEST_CASE("grouped FP8 products refuse what they cannot run, naming it", "[gpu][fp8]") {
  GroupedFp8Operands ok;
  DeviceBuffer any(1 << 16);
  ok.a = ok.b = any.as<std::uint8_t>();
  ok.a_scales = ok.b_scales = any.as<float>();
  ok.c = any.data();
  ok.b_scale_stride = tile_scales(128, 128).count;
  const std::vector<std::int64_t> offsets{0, 16};
  const Stream stream;
  CHECK_THROWS_WITH(grouped_fp8_gemm(std::vector<std::int64_t>{0}, 128, 128, ok, stream.get()),
                    test::contains_text("1 offsets"));
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 120, 128, ok, stream.get()),
                    test::contains_text("n = 120"));
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 0, ok, stream.get()),
                    test::contains_text("k = 0"));
  CHECK_THROWS_WITH(
      grouped_fp8_gemm(std::vector<std::int64_t>{0, 32, 16}, 128, 128, ok, stream.get()),
      test::contains_text("offsets[2] = 16"));
  GroupedFp8Operands no_c = ok;
  no_c.c = nullptr;
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 128, no_c, stream.get()),
                    test::contains_text("null operand"));
  // Without rows there is nothing to launch, and no buffer is needed.
  GroupedFp8Operands none;
  none.b_scale_stride = ok.b_scale_stride;
  CHECK_NOTHROW(grouped_fp8_gemm(std::vector<std::int64_t>{0, 0, 0}, 128, 128, none, stream.get()));
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 120, ok, stream.get()),
                    test::contains_text("k = 120"));
  CHECK_THROWS_WITH(grouped_fp8_gemm(std::vector<std::int64_t>{16, 32}, 128, 128, ok, stream.get()),
                    test::contains_text("offsets[0] = 16"));
  CHECK_THROWS_WITH(grouped_fp8_gemm(std::vector<std::int64_t>(kMaxGroupedGemmGroups + 2, 0), 128,
                                     128, ok, stream.get()),
                    test::contains_text("258 offsets"));
  // The loads' 32-bit row coordinates: groups · N and the rows stay below 2^31 - 256.
  CHECK_THROWS_WITH(grouped_fp8_gemm(std::vector<std::int64_t>{0, 16, 32}, std::int64_t{1} << 30,
                                     128, ok, stream.get()),
                    test::contains_text("rows of b exceed"));
  CHECK_THROWS_WITH(
      grouped_fp8_gemm(std::vector<std::int64_t>{0, 0x7fffff00}, 128, 128, ok, stream.get()),
      test::contains_text("offsets[1] = 2147483392"));
  GroupedFp8Operands no_a = ok;
  no_a.a = nullptr;
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 128, no_a, stream.get()),
                    test::contains_text("null operand"));
  GroupedFp8Operands shifted = ok;
  shifted.b = ok.b + 8;
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 128, shifted, stream.get()),
                    test::contains_text("16-byte aligned"));
  shifted = ok;
  shifted.c = any.as<char>() + 8;  // its rows are stored 16 bytes at a time
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 128, shifted, stream.get()),
                    test::contains_text("a, b and c must be 16-byte aligned"));
  shifted = ok;
  shifted.a_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(ok.a_scales) + 2);
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 128, 128, shifted, stream.get()),
                    test::contains_text("the scales 4-byte aligned"));
  GroupedFp8Operands short_scales = ok;
  short_scales.b_scale_stride = 1;
  CHECK_THROWS_WITH(grouped_fp8_gemm(offsets, 256, 128, short_scales, stream.get()),
                    test::contains_text("b_scale_stride = 1"));
}
