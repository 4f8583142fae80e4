// Capacity mode's dropped slots on one GPU: they name group E, past the layout's groups, get row -1
// and count nowhere, and the row kernels neither store for them nor read for them. Row -1 lies just
// before a buffer, so every buffer here carries a guard in front of its first row: the outputs'
// guards must keep their poison, and the inputs' guards hold NaN, which any read of row -1 would
// carry into a result. The row map starts out holding another layout's rows (not -1, which the
// poison would give), as a reused layout buffer does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <vector>

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

// A device buffer whose data starts `guard` bytes in (16-byte aligned), the guard poisoned.
class Guarded {
 public:
  Guarded(std::size_t guard, std::size_t bytes)
      : guard_((guard + 15) / 16 * 16), buffer_(guard_ + bytes + 16) {
    test::poison(buffer_);
  }
  void* data() const { return buffer_.as<char>() + guard_; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data());
  }
  bool guard_intact() const {
    const auto bytes = test::download<std::uint8_t>(buffer_, guard_);
    return std::all_of(bytes.begin(), bytes.end(), [](std::uint8_t b) { return b == 0xFF; });
  }
  // `values` copied in after the guard (which stays poisoned: NaN as fp32 or bf16).
  void fill(const DeviceBuffer& values, std::size_t bytes) const {
    MOE_CHECK_CUDA(cudaMemcpy(data(), values.data(), bytes, cudaMemcpyDeviceToDevice));
  }
  std::vector<std::uint8_t> bytes(std::size_t count) const {
    std::vector<std::uint8_t> out(count);
    copy_to_host(out.data(), data(), count);
    return out;
  }

 private:
  std::size_t guard_;
  DeviceBuffer buffer_;
};

Matrix to_matrix(const Guarded& buffer, std::int64_t rows, std::int64_t cols, DType dtype) {
  return test::download_matrix(buffer.data(), rows, cols, dtype);
}

std::vector<float> floats(const Guarded& buffer, std::size_t count) {
  std::vector<float> v(count);
  copy_to_host(v.data(), buffer.data(), count * sizeof(float));
  return v;
}

struct Shape {
  std::int64_t tokens;
  int hidden, experts, topk, align;
  DType dtype;
  double dropped;
};

void run_dropped(const Shape& s, std::mt19937_64& rng) {
  std::ostringstream what;
  what << "T=" << s.tokens << " H=" << s.hidden << " E=" << s.experts << " K=" << s.topk
       << " align=" << s.align << " " << dtype_name(s.dtype) << " dropped " << s.dropped;
  INFO(what.str());
  const std::int64_t T = s.tokens, H = s.hidden;
  const int E = s.experts, K = s.topk;
  reference::Routing routing = test::draw_routing(T, E, K, /*skewed=*/false, rng);
  for (auto& p : routing.prob) p = static_cast<float>(p);  // as the GPU holds them
  const auto [kept, topk_idx] = test::drop_slots(routing, E, s.dropped, rng);
  const auto layout = reference::make_layout(routing, kept, E, s.align);
  const std::int64_t rows = layout.rows();
  const auto slots = static_cast<std::size_t>(T * K);
  Stream stream;

  // The layout, over a row map that holds the rows of every slot kept (another step's layout).
  const auto idx_dev = test::upload(topk_idx);
  DeviceBuffer counts(E * 4 + 16), offsets((E + 1) * 4 + 16), row_map(slots * 4 + 16),
      workspace(layout_workspace_bytes(T, K, E));
  for (const auto* b : {&counts, &offsets}) test::poison(*b);
  {
    const auto every_slot = reference::make_layout(routing, E, s.align);
    const std::vector<std::int32_t> stale(every_slot.row.begin(), every_slot.row.end());
    copy_to_device(row_map.data(), stale.data(), slots * 4);
  }
  build_layout({idx_dev.as<std::int32_t>(), T, K, E, s.align, counts.as<std::int32_t>(),
                offsets.as<std::int32_t>(), row_map.as<std::int32_t>(), workspace.data()},
               stream.get());
  stream.synchronize();
  const auto got_rows = test::download<std::int32_t>(row_map, slots);
  REQUIRE(std::equal(layout.row.begin(), layout.row.end(), got_rows.begin()));
  REQUIRE(test::download<std::int32_t>(offsets, static_cast<std::size_t>(E) + 1).back() == rows);

  // Inputs, each behind a NaN guard row.
  const std::size_t elem = dtype_size(s.dtype), row_bytes = static_cast<std::size_t>(H) * elem;
  const Matrix x = test::round_to(test::random_matrix(T, H, rng), s.dtype);
  const Matrix y = test::round_to(test::random_matrix(rows, H, rng), s.dtype);
  const Matrix dy = test::round_to(test::random_matrix(T, H, rng), s.dtype);
  std::vector<float> row_grad(static_cast<std::size_t>(rows));
  std::uniform_real_distribution<float> grad(0.05f, 1.0f);
  for (auto& g : row_grad) g = grad(rng);
  const Guarded y_in(row_bytes, static_cast<std::size_t>(rows) * row_bytes),
      row_grad_in(16, row_grad.size() * 4);
  y_in.fill(test::upload_as(y, s.dtype), static_cast<std::size_t>(rows) * row_bytes);
  row_grad_in.fill(test::upload(row_grad), row_grad.size() * 4);
  const auto x_dev = test::upload_as(x, s.dtype);
  const auto dy_dev = test::upload_as(dy, s.dtype);
  const auto prob_dev = test::upload(std::vector<float>(routing.prob.begin(), routing.prob.end()));

  // Outputs, each behind a poisoned guard row.
  const auto row_buffer = [&] {
    return Guarded(row_bytes, static_cast<std::size_t>(rows) * row_bytes);
  };
  const auto token_buffer = [&] {
    return Guarded(row_bytes, static_cast<std::size_t>(T) * row_bytes);
  };
  const Guarded X = row_buffer(), dY = row_buffer(), out = token_buffer(), dx = token_buffer(),
                row_prob(16, static_cast<std::size_t>(rows) * 4), dprob(16, slots * 4),
                dprob_beside(16, slots * 4);
  const Tensor x_t(x_dev.data(), s.dtype, {T, H}), dy_t(dy_dev.data(), s.dtype, {T, H}),
      y_t(y_in.data(), s.dtype, {rows, H}), X_t(X.data(), s.dtype, {rows, H}),
      dY_t(dY.data(), s.dtype, {rows, H}), out_t(out.data(), s.dtype, {T, H}),
      dx_t(dx.data(), s.dtype, {T, H});
  const auto* rm = row_map.as<std::int32_t>();
  const auto* off = offsets.as<std::int32_t>();
  const auto* cnt = counts.as<std::int32_t>();
  const float* p = prob_dev.as<float>();
  // As the local exchange runs them: the permute with each row's probability beside it, the
  // combine, its backward, and the permute backward reading dprob from beside the rows.
  permute_rows(x_t, rm, K, off, cnt, E, X_t, stream.get(), p, row_prob.as<float>());
  unpermute_combine(y_t, rm, p, K, out_t, stream.get());
  combine_backward(dy_t, y_t, rm, p, K, off, cnt, E, dY_t, dprob.as<float>(), stream.get());
  unpermute_combine(y_t, rm, nullptr, K, dx_t, stream.get(), row_grad_in.as<float>(),
                    dprob_beside.as<float>());
  stream.synchronize();

  const double tolerance = s.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  CHECK(to_matrix(X, rows, H, s.dtype).data == reference::permute(x, layout, routing).data);
  CHECK(test::relative_error(to_matrix(out, T, H, s.dtype),
                             reference::unpermute_combine(y, layout, routing)) <= tolerance);
  CHECK(test::relative_error(to_matrix(dY, rows, H, s.dtype),
                             reference::combine_backward_rows(dy, layout, routing)) <= tolerance);
  CHECK(test::relative_error(to_matrix(dx, T, H, s.dtype),
                             reference::permute_backward(y, layout, routing)) <= tolerance);
  // Each kept slot's probability beside its row, padding 0; dprob 0 exactly where dropped, the
  // float beside the row where kept.
  std::vector<float> want_row_prob(static_cast<std::size_t>(rows), 0.0f);
  const auto got_row_prob = floats(row_prob, want_row_prob.size());
  const auto got_dprob = floats(dprob, slots), got_beside = floats(dprob_beside, slots);
  std::int64_t wrong_dprob = 0, wrong_beside = 0;
  for (std::size_t i = 0; i < slots; ++i) {
    const std::int64_t row = layout.row[i];
    if (row == reference::Layout::kDroppedRow) {
      wrong_dprob += got_dprob[i] != 0.0f;
      wrong_beside += got_beside[i] != 0.0f;
      continue;
    }
    want_row_prob[static_cast<std::size_t>(row)] = static_cast<float>(routing.prob[i]);
    wrong_dprob += !std::isfinite(got_dprob[i]);
    wrong_beside += got_beside[i] != row_grad[static_cast<std::size_t>(row)];
  }
  CHECK(got_row_prob == want_row_prob);
  CHECK(wrong_dprob == 0);
  CHECK(wrong_beside == 0);
  for (const Guarded* b : {&X, &dY, &out, &dx, &row_prob, &dprob, &dprob_beside})
    CHECK(b->guard_intact());

  // fp8_dispatch's combine backward: a dropped slot's record is never written, its dprob is 0.
  if (s.dtype != DType::kBF16 || H % 16 != 0) return;
  const auto record = static_cast<std::size_t>(fp8_row_bytes(H));
  const Guarded records(record, static_cast<std::size_t>(rows) * record),
      dprob_records(16, slots * 4);
  combine_backward_records(dy_t, y_t, rm, p, K, off, cnt, E, records.data(),
                           dprob_records.as<float>(), stream.get());
  stream.synchronize();
  CHECK(records.guard_intact());
  CHECK(dprob_records.guard_intact());
  CHECK(floats(dprob_records, slots) == got_dprob);
}

}  // namespace

TEST_CASE("dropped slots: no row, nothing stored or read for them, dprob 0", "[gpu][permute]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const double share : {0.3, 1.0}) {
    run_dropped({257, 256, 8, 2, 16, DType::kBF16, share}, rng);
    run_dropped({100, 128, 64, 8, 128, DType::kBF16, share}, rng);
    run_dropped({33, 100, 16, 4, 8, DType::kBF16, share}, rng);  // rows of 200 bytes: element path
    run_dropped({65, 64, 32, 8, 0, DType::kFP32, share}, rng);
    run_dropped({300, 64, kMaxExperts, 4, 16, DType::kBF16, share}, rng);  // dropped: group 2048
  }
}
