// FP8 block quantization on the GPU (kernels/fp8_quantize.cuh) against the reference
// (reference::quantize_row_blocks / quantize_tiles): every code and every scale bit for bit, at
// shapes with partial blocks, with outliers, zero blocks and values in E4M3's subnormal range,
// the scales written through both strides, outputs poisoned before each launch. The SwiGLU with
// its output quantized in the same pass (kernels/swiglu.cuh) against the SwiGLU, then the
// quantizer.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "kernels/fp8_quantize.cuh"
#include "kernels/permute.cuh"
#include "kernels/swiglu.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

// bf16 values of mixed magnitudes: most N(0, 1), some blocks scaled by 1e3 or 1e-6 (subnormal
// codes), one zero block, and single outliers.
Matrix draw(std::int64_t rows, std::int64_t cols, std::mt19937_64& rng) {
  Matrix x(rows, cols);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> kind(0, 9);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 128) {
      const int k = kind(rng);
      const double factor = k == 0 ? 1e3 : k == 1 ? 1e-6 : k == 2 ? 0.0 : 1.0;
      for (std::int64_t c = c0; c < std::min(c0 + 128, cols); ++c) x(r, c) = factor * normal(rng);
    }
  }
  if (rows * cols > 0) {
    std::uniform_int_distribution<std::int64_t> any(0, rows * cols - 1);
    for (int i = 0; i < 3; ++i) x.data[static_cast<std::size_t>(any(rng))] = 3e4 * normal(rng);
  }
  return round_to(x, DType::kBF16);
}

struct Shape {
  std::int64_t rows, cols;
};

void check(const reference::BlockQuantized& want, const std::vector<std::uint8_t>& codes,
           const std::vector<float>& scales, ScaleLayout layout) {
  std::int64_t wrong_codes = 0, first = -1;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    if (codes[i] != want.codes[i]) {
      ++wrong_codes;
      if (first < 0) first = static_cast<std::int64_t>(i);
    }
  }
  INFO("first wrong code at element " << first);
  CHECK(wrong_codes == 0);
  const std::int64_t scale_rows = static_cast<std::int64_t>(want.scales.size()) / want.scale_cols;
  std::int64_t wrong_scales = 0;
  for (std::int64_t a = 0; a < scale_rows; ++a) {
    for (std::int64_t b = 0; b < want.scale_cols; ++b) {
      const float got = scales[static_cast<std::size_t>(a * layout.stride_a + b * layout.stride_b)];
      const float expected = want.scales[static_cast<std::size_t>(a * want.scale_cols + b)];
      if (std::memcmp(&got, &expected, sizeof(float)) != 0) ++wrong_scales;
    }
  }
  CHECK(wrong_scales == 0);
}

}  // namespace

TEST_CASE("fp8 quantize: row blocks and tiles equal the reference bit for bit",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<Shape> shapes = {{1, 128}, {3, 200},   {130, 256}, {257, 1000}, {128, 16},
                                     {5, 7},   {300, 384}, {129, 136}, {64, 4100}};
  Stream stream;
  for (const Shape& s : shapes) {
    for (const bool tiles : {false, true}) {
      for (const bool outer_contiguous : {false, true}) {
        std::ostringstream what;
        what << s.rows << "x" << s.cols << (tiles ? " tiles" : " row blocks")
             << (outer_contiguous ? ", scales outer-contiguous" : ", scales row-major");
        INFO(what.str());
        const Matrix x = draw(s.rows, s.cols, rng);
        const reference::BlockQuantized want =
            tiles ? reference::quantize_tiles(x) : reference::quantize_row_blocks(x);
        const std::int64_t scale_rows =
            static_cast<std::int64_t>(want.scales.size()) / want.scale_cols;
        // Row-major scales [a][b], or the first index contiguous: [b][a] with a padded to 4.
        const std::int64_t padded = (scale_rows + 3) / 4 * 4;
        const ScaleLayout layout =
            outer_contiguous ? ScaleLayout{1, padded} : ScaleLayout{want.scale_cols, 1};
        const std::size_t scale_count = static_cast<std::size_t>(
            outer_contiguous ? padded * want.scale_cols : scale_rows * want.scale_cols);
        const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
        DeviceBuffer q(static_cast<std::size_t>(s.rows * s.cols) + 16),
            scales(scale_count * 4 + 16);
        test::poison(q);
        test::poison(scales);
        if (tiles) {
          quantize_tiles(x_dev.data(), s.rows, s.cols, q.as<std::uint8_t>(), scales.as<float>(),
                         layout, stream.get());
        } else {
          quantize_row_blocks(x_dev.data(), s.rows, s.cols, q.as<std::uint8_t>(),
                              scales.as<float>(), layout, stream.get());
        }
        stream.synchronize();
        check(want, test::download<std::uint8_t>(q, static_cast<std::size_t>(s.rows * s.cols)),
              test::download<float>(scales, scale_count), layout);
      }
    }
  }
}

TEST_CASE(
    "fp8 quantize: row blocks in segments put each segment's scales where its product reads them",
    "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const std::int64_t cols : {std::int64_t{128}, std::int64_t{200}, std::int64_t{640}}) {
    for (const int segments : {1, 5, 40}) {
      // Segment sizes 0 to 48 rows, some empty, as experts' row groups come.
      std::uniform_int_distribution<int> size(0, 3);
      std::vector<std::int64_t> offsets{0};
      for (int s = 0; s < segments; ++s) offsets.push_back(offsets.back() + 16 * size(rng));
      if (offsets.back() == 0) offsets.back() = 16;
      const std::int64_t rows = offsets.back();
      INFO(rows << "x" << cols << " in " << segments << " segments");
      const Matrix x = draw(rows, cols, rng);
      const reference::BlockQuantized want = reference::quantize_row_blocks(x);
      const std::int64_t blocks = want.scale_cols;
      const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
      DeviceBuffer q(static_cast<std::size_t>(rows * cols) + 16),
          scales(static_cast<std::size_t>(rows * blocks) * 4 + 16);
      test::poison(q);
      test::poison(scales);
      quantize_row_blocks_segmented(x_dev.data(), offsets, cols, q.as<std::uint8_t>(),
                                    scales.as<float>(), stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, static_cast<std::size_t>(rows * cols));
      CHECK(codes == want.codes);
      const auto got = test::download<float>(scales, static_cast<std::size_t>(rows * blocks));
      std::int64_t wrong = 0;
      for (int s = 0; s < segments; ++s) {
        const std::int64_t first = offsets[s], n = offsets[s + 1] - first;
        for (std::int64_t i = 0; i < n; ++i) {
          for (std::int64_t c = 0; c < blocks; ++c) {
            const float expected = want.scales[static_cast<std::size_t>((first + i) * blocks + c)];
            const float value = got[static_cast<std::size_t>(first * blocks + c * n + i)];
            if (std::memcmp(&value, &expected, sizeof(float)) != 0) ++wrong;
          }
        }
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("fp8 quantize: stacked matrices and their transposes in tiles equal the reference",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  const std::vector<Shape> shapes = {{256, 128}, {520, 384}, {96, 200},
                                     {300, 264}, {16, 16},   {130, 7}};
  for (const Shape& s : shapes) {
    for (const std::int64_t matrices : {std::int64_t{1}, std::int64_t{3}}) {
      INFO(matrices << " matrices of " << s.rows << "x" << s.cols);
      std::vector<Matrix> parts;
      for (std::int64_t m = 0; m < matrices; ++m) parts.push_back(draw(s.rows, s.cols, rng));
      // Scales of each matrix row-major with padded rows, and of each transpose the other way
      // round, so that both strides are exercised.
      const std::int64_t tr = (s.rows + 127) / 128, tc = (s.cols + 127) / 128;
      const ScaleBuffer direct{{tc + 1, 1}, tr * (tc + 1)}, flipped{{1, tc + 2}, tr * (tc + 2)};
      const DeviceBuffer x_dev = test::upload_as(reference::concat_rows(parts), DType::kBF16);
      const auto elements = static_cast<std::size_t>(matrices * s.rows * s.cols);
      DeviceBuffer q(elements + 16), qt(elements + 16),
          scales(static_cast<std::size_t>(matrices * direct.count) * 4 + 16),
          scales_t(static_cast<std::size_t>(matrices * flipped.count) * 4 + 16);
      for (const auto* b : {&q, &qt, &scales, &scales_t}) test::poison(*b);
      quantize_tiles(x_dev.data(), matrices, s.rows, s.cols,
                     TileOutput{q.as<std::uint8_t>(), scales.as<float>(), direct},
                     TileOutput{qt.as<std::uint8_t>(), scales_t.as<float>(), flipped},
                     stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, elements);
      const auto codes_t = test::download<std::uint8_t>(qt, elements);
      const auto got =
          test::download<float>(scales, static_cast<std::size_t>(matrices * direct.count));
      const auto got_t =
          test::download<float>(scales_t, static_cast<std::size_t>(matrices * flipped.count));
      const auto per_matrix = static_cast<std::size_t>(s.rows * s.cols);
      for (std::int64_t m = 0; m < matrices; ++m) {
        const auto want = reference::quantize_tiles(parts[static_cast<std::size_t>(m)]);
        const auto want_t =
            reference::quantize_tiles(reference::transpose(parts[static_cast<std::size_t>(m)]));
        const auto at = static_cast<std::size_t>(m) * per_matrix;
        CHECK(std::equal(want.codes.begin(), want.codes.end(), codes.begin() + at));
        CHECK(std::equal(want_t.codes.begin(), want_t.codes.end(), codes_t.begin() + at));
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < tr; ++i) {
          for (std::int64_t j = 0; j < tc; ++j) {
            const float expected = want.scales[static_cast<std::size_t>(i * tc + j)];
            const float a = got[static_cast<std::size_t>(m * direct.count + i * (tc + 1) + j)];
            const float b = got_t[static_cast<std::size_t>(m * flipped.count + j + i * (tc + 2))];
            // The transpose's tile (j, i) is this tile: its reference says the same.
            const float expected_t = want_t.scales[static_cast<std::size_t>(j * tr + i)];
            if (std::memcmp(&a, &expected, 4) != 0 || std::memcmp(&b, &expected, 4) != 0 ||
                std::memcmp(&expected_t, &expected, 4) != 0)
              ++wrong;
          }
        }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("fp8 quantize: tiles from unaligned x into unaligned codes, and the transpose alone",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const Shape& s : std::vector<Shape>{{136, 256}, {256, 136}, {96, 200}}) {
    INFO(s.rows << "x" << s.cols << ", x 2 bytes and the codes 1 byte past alignment");
    const Matrix x = draw(s.rows, s.cols, rng);
    const auto want = reference::quantize_tiles(x);
    const auto want_t = reference::quantize_tiles(reference::transpose(x));
    const auto elements = static_cast<std::size_t>(s.rows * s.cols);
    const DeviceBuffer x_aligned = test::upload_as(x, DType::kBF16);
    DeviceBuffer x_dev(elements * 2 + 16), q(elements + 16), qt(elements + 16),
        scales(want.scales.size() * 4 + 16), scales_t(want.scales.size() * 4 + 16);
    MOE_CHECK_CUDA(
        cudaMemcpy(x_dev.as<char>() + 2, x_aligned.data(), elements * 2, cudaMemcpyDeviceToDevice));
    const std::int64_t tr = (s.rows + 127) / 128, tc = (s.cols + 127) / 128;
    const TileOutput transposed{
        qt.as<std::uint8_t>() + 1, scales_t.as<float>(), {{tr, 1}, tr * tc}};
    for (const bool both : {true, false}) {
      INFO((both ? "codes and transpose" : "the transpose alone"));
      for (const auto* b : {&q, &qt, &scales, &scales_t}) test::poison(*b);
      const TileOutput direct =
          both ? TileOutput{q.as<std::uint8_t>() + 1, scales.as<float>(), {{tc, 1}, tr * tc}}
               : TileOutput{};
      quantize_tiles(x_dev.as<char>() + 2, 1, s.rows, s.cols, direct, transposed, stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, elements + 16);
      const auto codes_t = test::download<std::uint8_t>(qt, elements + 16);
      CHECK(std::equal(want_t.codes.begin(), want_t.codes.end(), codes_t.begin() + 1));
      CHECK(codes_t[0] == 0xFF);
      CHECK(codes_t[elements + 1] == 0xFF);  // nothing past the end
      check(want_t, std::vector<std::uint8_t>(codes_t.begin() + 1, codes_t.begin() + 1 + elements),
            test::download<float>(scales_t, want_t.scales.size()), {tr, 1});
      if (both) {
        CHECK(std::equal(want.codes.begin(), want.codes.end(), codes.begin() + 1));
        CHECK(codes[elements + 1] == 0xFF);
        check(want, std::vector<std::uint8_t>(codes.begin() + 1, codes.begin() + 1 + elements),
              test::download<float>(scales, want.scales.size()), {tc, 1});
      } else {
        CHECK(std::count(codes.begin(), codes.end(), 0xFF) == std::ssize(codes));
      }
    }
  }
}

TEST_CASE("fp8 quantize: bad arguments are named", "[gpu][fp8][quantize]") {
  Stream stream;
  DeviceBuffer buffer(1024);
  CHECK_THROWS_WITH(quantize_row_blocks(buffer.data(), -1, 128, buffer.as<std::uint8_t>(),
                                        buffer.as<float>(), {1, 1}, stream.get()),
                    test::contains_text("rows = -1"));
  CHECK_THROWS_WITH(quantize_tiles(nullptr, 4, 128, buffer.as<std::uint8_t>(), buffer.as<float>(),
                                   {1, 1}, stream.get()),
                    test::contains_text("must be device pointers"));
  const std::vector<std::int64_t> decreasing{0, 32, 16};
  CHECK_THROWS_WITH(
      quantize_row_blocks_segmented(buffer.data(), decreasing, 128, buffer.as<std::uint8_t>(),
                                    buffer.as<float>(), stream.get()),
      test::contains_text("offsets[2] = 16"));
  const std::vector<std::int64_t> too_many(kMaxQuantizeSegments + 2, 0);
  CHECK_THROWS_WITH(
      quantize_row_blocks_segmented(buffer.data(), too_many, 128, buffer.as<std::uint8_t>(),
                                    buffer.as<float>(), stream.get()),
      test::contains_text("514 offsets"));
  // Nothing to do is no error.
  quantize_tiles(nullptr, 0, 128, nullptr, nullptr, {1, 1}, stream.get());
}

namespace {

// bf16 values as the device holds them, back in fp64.
Matrix download_bf16(const DeviceBuffer& buffer, std::int64_t rows, std::int64_t cols) {
  Matrix m(rows, cols);
  const auto values = test::download<BF16>(buffer, static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < values.size(); ++i) m.data[i] = from_bf16(values[i]);
  return m;
}

}  // namespace

// fp8_dispatch's rows: each record holds the row's codes, then its blocks' scales, then zeros;
// rounding through FP8 gives what decoding the records gives; the chunk sort decodes records into
// the padded expert-major layout. Every byte against the reference.
TEST_CASE("fp8 quantize: travelling rows as records, rounded, and sorted from records",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const Shape& s : std::vector<Shape>{{1, 16}, {37, 144}, {300, 2048}, {5, 7168}, {0, 64}}) {
    INFO(s.rows << "x" << s.cols);
    const Matrix x = draw(s.rows, s.cols, rng);
    const reference::BlockQuantized want = reference::quantize_row_blocks(x);
    const std::int64_t record = fp8_row_bytes(s.cols), blocks = want.scale_cols;
    CHECK(record % 16 == 0);
    CHECK(record >= s.cols + 4 * blocks);
    CHECK(record < s.cols + 4 * blocks + 16);
    const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
    DeviceBuffer records(static_cast<std::size_t>(s.rows * record) + 16),
        rounded(static_cast<std::size_t>(s.rows * s.cols) * 2 + 16);
    test::poison(records);
    test::poison(rounded);
    quantize_row_records(x_dev.data(), s.rows, s.cols, records.data(), stream.get());
    round_rows_through_fp8(x_dev.data(), s.rows, s.cols, rounded.data(), stream.get());
    stream.synchronize();
    const auto bytes =
        test::download<std::uint8_t>(records, static_cast<std::size_t>(s.rows * record));
    std::int64_t wrong_codes = 0, wrong_scales = 0, wrong_padding = 0;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const std::uint8_t* row = bytes.data() + r * record;
      for (std::int64_t c = 0; c < s.cols; ++c)
        wrong_codes += row[c] != want.codes[static_cast<std::size_t>(r * s.cols + c)];
      for (std::int64_t b = 0; b < blocks; ++b) {
        float scale = 0.0f;
        std::memcpy(&scale, row + s.cols + 4 * b, sizeof(float));
        wrong_scales += scale != want.scales[static_cast<std::size_t>(r * blocks + b)];
      }
      for (std::int64_t i = s.cols + 4 * blocks; i < record; ++i) wrong_padding += row[i] != 0;
    }
    CHECK(wrong_codes == 0);
    CHECK(wrong_scales == 0);
    CHECK(wrong_padding == 0);
    CHECK(download_bf16(rounded, s.rows, s.cols).data == reference::round_rows_through_fp8(x).data);

    // The records of 3 sources for 4 local experts, sorted into a layout padded to 16.
    const int sources = 3, local_experts = 4;
    reference::ChunkLayout chunks{sources, local_experts, {}};
    std::vector<std::int32_t> counts32;
    std::int64_t left = s.rows;
    for (int i = 0; i < sources * local_experts; ++i) {
      const std::int64_t take = i + 1 == sources * local_experts ? left : left / 3;
      chunks.counts.push_back(take);
      counts32.push_back(static_cast<std::int32_t>(take));
      left -= take;
    }
    const Matrix sorted =
        reference::sort_chunks(reference::round_rows_through_fp8(x), chunks, /*align=*/16);
    const auto counts_dev = test::upload(counts32);
    DeviceBuffer workspace(chunk_workspace_bytes(sources, local_experts));
    DeviceBuffer expert_major(static_cast<std::size_t>(sorted.rows * s.cols) * 2 + 16);
    test::poison(expert_major);
    const ChunkArgs args{counts_dev.as<std::int32_t>(), sources, local_experts, 16,
                         workspace.data()};
    sort_chunk_records(args, records.data(), s.rows,
                       Tensor(expert_major.data(), DType::kBF16, {sorted.rows, s.cols}),
                       stream.get());
    stream.synchronize();
    CHECK(download_bf16(expert_major, sorted.rows, s.cols).data == sorted.data);
  }
  // Bad shapes are refused by name.
  CHECK_THROWS_WITH(quantize_row_records(nullptr, 2, 24, nullptr, stream.get()),
                    test::contains_text("cols = 24 must be >= 0, cols a multiple of 16"));
  CHECK_THROWS_WITH(round_rows_through_fp8(nullptr, 2, 32, nullptr, stream.get()),
                    test::contains_text("x and out must be device pointers"));
}

namespace {

// Row groups of 0 to 60 rows (some empty, some odd), as the experts' come.
std::vector<std::int64_t> draw_segments(int segments, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> size(0, 60);
  std::vector<std::int64_t> offsets{0};
  for (int s = 0; s < segments; ++s)
    offsets.push_back(offsets.back() + (s % 4 == 1 ? 0 : size(rng)));
  return offsets;
}

// A poisoned output of `bytes` from `shift` bytes into its buffer (0 or 2: a bf16 row then starts
// off 16-byte alignment), with 16 guard bytes after it.
struct Output {
  DeviceBuffer buffer;
  std::int64_t bytes, shift;
  Output(std::int64_t bytes_, std::int64_t shift_ = 0)
      : buffer(static_cast<std::size_t>(bytes_ + shift_) + 16), bytes(bytes_), shift(shift_) {
    test::poison(buffer);
  }
  void* data() const { return buffer.as<char>() + shift; }
  // Its bytes as T, the guard bytes checked untouched.
  template <typename T>
  std::vector<T> read() const {
    const auto all =
        test::download<std::uint8_t>(buffer, static_cast<std::size_t>(bytes + shift + 16));
    CHECK(std::all_of(all.end() - 16, all.end(), [](std::uint8_t b) { return b == 0xFF; }));
    std::vector<T> out(static_cast<std::size_t>(bytes) / sizeof(T));
    std::memcpy(out.data(), all.data() + shift, out.size() * sizeof(T));
    return out;
  }
};

// A device copy of `values` (bytes) from `shift` bytes into its buffer.
Output upload_shifted(const std::vector<std::uint8_t>& values, std::int64_t shift) {
  Output out(static_cast<std::int64_t>(values.size()), shift);
  if (!values.empty()) copy_to_device(out.data(), values.data(), values.size());
  return out;
}

std::vector<std::uint8_t> bf16_bytes(const Matrix& m) {
  std::vector<std::uint8_t> bytes(m.data.size() * 2);
  for (std::size_t i = 0; i < m.data.size(); ++i) {
    const BF16 v = to_bf16(static_cast<float>(m.data[i]));
    std::memcpy(bytes.data() + 2 * i, &v, 2);
  }
  return bytes;
}

std::vector<std::uint8_t> float_bytes(const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(values.size() * 4);
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

struct SwigluCase {
  std::int64_t F;
  std::vector<std::int64_t> offsets;
  bool weighed;
  std::int64_t shift;  // of every bf16 tensor of the one-pass calls: 2 takes the two passes
};

// The SwiGLU with its output quantized, forward and backward (in place and apart), against the
// SwiGLU then the quantizer: every output bit for bit, the guard bytes after each untouched.
void check_swiglu_fp8(const SwigluCase& c, std::mt19937_64& rng, cudaStream_t stream) {
  const DType bf16 = DType::kBF16, fp32 = DType::kFP32;
  const std::int64_t F = c.F, rows = c.offsets.back(), blocks = (F + 127) / 128,
                     dh_blocks = (2 * F + 127) / 128;
  const Matrix h = draw(rows, 2 * F, rng), dA = draw(rows, F, rng);
  std::vector<float> weights(static_cast<std::size_t>(rows));
  std::uniform_real_distribution<float> unit(0.01f, 1.0f);
  for (float& w : weights) w = unit(rng);
  const auto h_bytes = bf16_bytes(h), dA_bytes = bf16_bytes(dA), w_bytes = float_bytes(weights);
  auto bf16_t = [&](const Output& o, std::int64_t cols) {
    return Tensor(o.data(), bf16, {rows, cols});
  };
  auto weight_t = [&](const Output& o) {
    return c.weighed ? Tensor(o.data(), fp32, {rows}) : Tensor{};
  };
  const Output h_ref = upload_shifted(h_bytes, 0), dA_ref = upload_shifted(dA_bytes, 0),
               w_ref = upload_shifted(w_bytes, 0);

  // The forward: a, its codes and scales.
  Output a_want(rows * F * 2), q_want(rows * F), s_want(rows * blocks * 4);
  Output a_got(rows * F * 2, c.shift), q_got(rows * F), s_got(rows * blocks * 4);
  const Output h_in = upload_shifted(h_bytes, c.shift);
  swiglu_forward(bf16_t(h_ref, 2 * F), bf16_t(a_want, F), stream, weight_t(w_ref));
  quantize_row_blocks_segmented(a_want.data(), c.offsets, F,
                                static_cast<std::uint8_t*>(q_want.data()),
                                static_cast<float*>(s_want.data()), stream);
  swiglu_forward_fp8(
      bf16_t(h_in, 2 * F), bf16_t(a_got, F),
      {static_cast<std::uint8_t*>(q_got.data()), static_cast<float*>(s_got.data()), c.offsets},
      stream, weight_t(w_ref));
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK(a_got.read<std::uint16_t>() == a_want.read<std::uint16_t>());
  CHECK(q_got.read<std::uint8_t>() == q_want.read<std::uint8_t>());
  CHECK(s_got.read<std::uint32_t>() == s_want.read<std::uint32_t>());

  // The backward, two passes apart: dh, a again, dscale, dh's codes and scales.
  Output dh_want(rows * 2 * F * 2), a2_want(rows * F * 2), ds_want(rows * 4);
  Output dq_want(rows * 2 * F), dsc_want(rows * dh_blocks * 4);
  swiglu_backward(bf16_t(h_ref, 2 * F), bf16_t(dA_ref, F), bf16_t(dh_want, 2 * F),
                  bf16_t(a2_want, F), stream, weight_t(w_ref), weight_t(ds_want));
  quantize_row_blocks_segmented(dh_want.data(), c.offsets, 2 * F,
                                static_cast<std::uint8_t*>(dq_want.data()),
                                static_cast<float*>(dsc_want.data()), stream);
  // One pass apart.
  const Output dA_in = upload_shifted(dA_bytes, c.shift);
  Output dh_got(rows * 2 * F * 2, c.shift), a2_got(rows * F * 2, c.shift), ds_got(rows * 4);
  Output dq_got(rows * 2 * F), dsc_got(rows * dh_blocks * 4);
  swiglu_backward_fp8(
      bf16_t(h_in, 2 * F), bf16_t(dA_in, F), bf16_t(dh_got, 2 * F), bf16_t(a2_got, F),
      {static_cast<std::uint8_t*>(dq_got.data()), static_cast<float*>(dsc_got.data()), c.offsets},
      stream, weight_t(w_ref), weight_t(ds_got));
  // One pass in place: dh over h, a over dA, dscale over scale.
  const Output h_place = upload_shifted(h_bytes, c.shift),
               dA_place = upload_shifted(dA_bytes, c.shift), w_place = upload_shifted(w_bytes, 0);
  Output dq_place(rows * 2 * F), dsc_place(rows * dh_blocks * 4);
  swiglu_backward_fp8(bf16_t(h_place, 2 * F), bf16_t(dA_place, F), bf16_t(h_place, 2 * F),
                      bf16_t(dA_place, F),
                      {static_cast<std::uint8_t*>(dq_place.data()),
                       static_cast<float*>(dsc_place.data()), c.offsets},
                      stream, weight_t(w_place), weight_t(w_place));
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto dh = dh_want.read<std::uint16_t>(), a2 = a2_want.read<std::uint16_t>();
  const auto dq = dq_want.read<std::uint8_t>();
  const auto dsc = dsc_want.read<std::uint32_t>();
  CHECK(dh_got.read<std::uint16_t>() == dh);
  CHECK(a2_got.read<std::uint16_t>() == a2);
  CHECK(dq_got.read<std::uint8_t>() == dq);
  CHECK(dsc_got.read<std::uint32_t>() == dsc);
  CHECK(h_place.read<std::uint16_t>() == dh);
  CHECK(dA_place.read<std::uint16_t>() == a2);
  CHECK(dq_place.read<std::uint8_t>() == dq);
  CHECK(dsc_place.read<std::uint32_t>() == dsc);
  if (c.weighed) {
    const auto ds = ds_want.read<std::uint32_t>();
    CHECK(ds_got.read<std::uint32_t>() == ds);
    CHECK(w_place.read<std::uint32_t>() == ds);
  }
}

}  // namespace

TEST_CASE("fp8 swiglu: the output quantized in the same pass equals SwiGLU then the quantizer",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  // F a multiple of 128 takes one pass (odd block counts included); 200 and 136, or rows off
  // 16-byte alignment, the two calls.
  for (const std::int64_t F : {128, 384, 768, 1152, 200, 136}) {
    for (const int segments : {1, 7, 33}) {
      for (const bool weighed : {false, true}) {
        const SwigluCase c{F, draw_segments(segments, rng), weighed, 0};
        INFO(c.offsets.back() << " rows in " << segments << " segments, F = " << F
                              << (weighed ? ", weighed" : ""));
        check_swiglu_fp8(c, rng, stream.get());
      }
    }
  }
  {
    INFO("rows off 16-byte alignment: the two passes");
    check_swiglu_fp8({384, {0, 40, 40, 97}, true, 2}, rng, stream.get());
  }
  {
    INFO("more rows than one sweep of the grid (2112 blocks of 8 warps)");
    check_swiglu_fp8({128, {0, 9000, 9001, 17500}, true, 0}, rng, stream.get());
  }
  // Bad arguments are refused by name.
  const DType bf16 = DType::kBF16;
  const std::vector<std::int64_t> offsets{0, 3, 5};
  DeviceBuffer h(6 * 256 * 2), a(6 * 128 * 4), q(6 * 256), scales(64);
  const Tensor h_t(h.data(), bf16, {6, 256}), a_t(a.data(), bf16, {6, 128});
  CHECK_THROWS_WITH(
      swiglu_forward_fp8(h_t, a_t, {q.as<std::uint8_t>(), scales.as<float>(), offsets},
                         stream.get()),
      test::contains_text("swiglu_forward_fp8: offsets end at 5, h has 6 rows"));
  const std::vector<std::int64_t> six{0, 6};
  CHECK_THROWS_WITH(swiglu_forward_fp8(h_t, a_t, {nullptr, scales.as<float>(), six}, stream.get()),
                    test::contains_text("out.codes and out.scales must be device pointers"));
  const Tensor h32(h.data(), DType::kFP32, {6, 256}), a32(a.data(), DType::kFP32, {6, 128});
  CHECK_THROWS_WITH(
      swiglu_backward_fp8(h32, a32, h32, a32, {q.as<std::uint8_t>(), scales.as<float>(), six},
                          stream.get()),
      test::contains_text("a is fp32; FP8 quantizes bf16 rows"));
}
