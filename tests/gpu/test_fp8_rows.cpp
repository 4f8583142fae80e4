// The FP8 rows against the reference, every byte, outputs poisoned before each launch: the rows
// that travel with fp8_dispatch as records (kernels/fp8_quantize.cuh), rounded through FP8, and
// sorted from records into the experts' layout (kernels/permute.cuh); and the SwiGLU with its
// output quantized in the same pass (kernels/swiglu.cuh) against the SwiGLU, then the quantizer.
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
#include "support/fp8_values.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using test::draw_fp8_values;
using Shape = test::MatrixShape;

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
    const Matrix x = draw_fp8_values(s.rows, s.cols, rng);
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

    // Rows of whole 128-value blocks: the sort also stores the records' codes and scales
    // unchanged where the FP8 experts read them (the reference quantizer's of each source row,
    // sorted as the rows are; a padding row's codes 0 and scales 1), each expert's scales over
    // its padded rows. Sorted in two calls of two experts each, as the pipelined exchange does.
    if (s.cols % kFP8Block != 0) continue;
    Matrix code_values(s.rows, s.cols), scale_values(s.rows, blocks);
    for (std::size_t i = 0; i < code_values.data.size(); ++i) code_values.data[i] = want.codes[i];
    for (std::size_t i = 0; i < scale_values.data.size(); ++i)
      scale_values.data[i] = want.scales[i];
    const Matrix sorted_codes = reference::sort_chunks(code_values, chunks, 16);
    const Matrix sorted_scales = reference::sort_chunks(scale_values, chunks, 16);
    const std::vector<std::int64_t> offsets =
        reference::padded_offsets(chunks.rows_per_expert(), 16);
    DeviceBuffer again(static_cast<std::size_t>(sorted.rows * s.cols) * 2 + 16),
        codes(static_cast<std::size_t>(sorted.rows * s.cols) + 16),
        scales(static_cast<std::size_t>(sorted.rows * blocks) * 4 + 16);
    for (const auto* b : {&again, &codes, &scales}) test::poison(*b);
    for (const int first : {0, 2}) {
      ChunkArgs part = args;
      part.first_expert = first;
      part.end_expert = first + 2;
      for (int source = 0; source < sources; ++source)
        part.widest_source = std::max(
            part.widest_source, chunks.count(source, first) + chunks.count(source, first + 1));
      sort_chunk_records(part, records.data(), s.rows,
                         Tensor(again.data(), DType::kBF16, {sorted.rows, s.cols}), stream.get(),
                         {codes.as<std::uint8_t>(), scales.as<float>()});
    }
    stream.synchronize();
    CHECK(download_bf16(again, sorted.rows, s.cols).data == sorted.data);
    const auto got_codes =
        test::download<std::uint8_t>(codes, static_cast<std::size_t>(sorted.rows * s.cols));
    std::int64_t wrong_sorted_codes = 0, wrong_sorted_scales = 0;
    for (std::size_t i = 0; i < got_codes.size(); ++i)
      wrong_sorted_codes += got_codes[i] != sorted_codes.data[i];
    const auto got_scales =
        test::download<float>(scales, static_cast<std::size_t>(sorted.rows * blocks));
    for (int e = 0; e < local_experts; ++e) {
      const std::int64_t first = offsets[e], group = offsets[e + 1] - first;
      for (std::int64_t i = 0; i < group; ++i) {
        for (std::int64_t b = 0; b < blocks; ++b) {
          const double sorted_scale = sorted_scales(first + i, b);  // 0 in a padding row
          const double expected = sorted_scale == 0.0 ? 1.0 : sorted_scale;
          wrong_sorted_scales +=
              got_scales[static_cast<std::size_t>(first * blocks + b * group + i)] != expected;
        }
      }
    }
    CHECK(wrong_sorted_codes == 0);
    CHECK(wrong_sorted_scales == 0);
  }
  {
    // Codes asked for rows whose width is not whole 128-value blocks are refused.
    const int sources = 1, local_experts = 1;
    DeviceBuffer workspace(chunk_workspace_bytes(sources, local_experts)), rows(64 * 2 * 16),
        records(static_cast<std::size_t>(fp8_row_bytes(64)) * 16), codes(64 * 16), scales(64);
    const std::vector<std::int32_t> one_count{16};
    const auto counts_dev = test::upload(one_count);
    const ChunkArgs args{counts_dev.as<std::int32_t>(), sources, local_experts, 16,
                         workspace.data()};
    CHECK_THROWS_WITH(
        sort_chunk_records(args, records.data(), 16, Tensor(rows.data(), DType::kBF16, {16, 64}),
                           stream.get(), {codes.as<std::uint8_t>(), scales.as<float>()}),
        test::contains_text("rows of a multiple of 128 values (got 64)"));
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
  const Matrix h = draw_fp8_values(rows, 2 * F, rng), dA = draw_fp8_values(rows, F, rng);
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
