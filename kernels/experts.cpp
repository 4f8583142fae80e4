#include "experts.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>

#include "moe/error.h"
#include "pointer_upload.cuh"
#include "swiglu.cuh"

namespace moe {

std::string_view expert_schedule_name(ExpertSchedule schedule) {
  switch (schedule) {
    case ExpertSchedule::kStreams:
      return "streams";
    case ExpertSchedule::kBatched:
      return "batched";
    case ExpertSchedule::kGrouped:
      return "grouped";
  }
  return "unknown";
}

namespace {

void check_cublas_status(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS error {} in {}", static_cast<int>(status), call);
}

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The largest power of two (at most 256, what cuBLASLt asks for at most) dividing the address.
std::uint32_t address_alignment(const void* address) {
  const auto bits = reinterpret_cast<std::uintptr_t>(address) | 256u;
  return static_cast<std::uint32_t>(bits & (~bits + 1));
}

double flops(const GemmShape& s) {
  return 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
}

}  // namespace

// Operand addresses for the batched and grouped calls, in device arrays written by a kernel that
// carries them in its parameters (kernels/pointer_upload.cuh). A ring of slots: a slot is written
// on the caller's stream, read by GEMMs forked from it and joined back before the call returns,
// so the next write to it, queued on that stream later, follows every read. The host never
// waits, and a captured CUDA graph replays each call's own addresses.
struct ExpertFFN::PointerStaging {
  static constexpr std::size_t kSlots = 8;
  std::size_t slot_capacity;  // pointers per slot
  DeviceBuffer device;
  std::size_t next = 0;

  explicit PointerStaging(std::size_t capacity) : slot_capacity(capacity) {
    device.reserve(kSlots * capacity * sizeof(void*));
  }
  // Enqueues the upload on `stream`; the returned device array is valid for work queued after it.
  const void* const* stage(const std::vector<const void*>& pointers, cudaStream_t stream) {
    if (pointers.size() > slot_capacity)
      fail("ExpertFFN: {} operand pointers exceed the {} staged per call", pointers.size(),
           slot_capacity);
    const std::size_t slot = next;
    next = (next + 1) % kSlots;
    const void** device_slot = device.as<const void*>() + slot * slot_capacity;
    upload_pointers(pointers.data(), pointers.size(), device_slot, stream);
    return device_slot;
  }
};

// The grouped path's cuBLAS handle.
struct ExpertFFN::Grouped {
  cublasHandle_t handle = nullptr;
  Grouped() { check_cublas_status(cublasCreate(&handle), "cublasCreate"); }
  ~Grouped() {
    if (handle != nullptr) (void)cublasDestroy(handle);
  }
};

ExpertFFN::ExpertFFN(int hidden, int ffn, int local_experts, DType dtype, ExpertSchedule schedule,
                     int streams, std::size_t activation_chunk_bytes, std::size_t workspace_bytes,
                     bool autotune)
    : hidden_(hidden), ffn_(ffn), experts_(local_experts), dtype_(dtype), schedule_(schedule) {
  if (hidden < 1 || ffn < 1 || local_experts < 1) {
    fail("ExpertFFN: hidden = {}, ffn_hidden = {}, local experts = {} must all be positive", hidden,
         ffn, local_experts);
  }
  if (dtype != DType::kBF16 && dtype != DType::kFP32)
    fail("ExpertFFN: dtype = {} must be bf16 or fp32", dtype_name(dtype));
  if (streams < 1) fail("ExpertFFN: streams = {} must be >= 1", streams);
  // Chunks of whole 64-row tiles where the budget allows (the down products' M, dw2's K), at
  // least one row whatever the budget.
  chunk_rows_ = std::numeric_limits<std::int64_t>::max();
  if (activation_chunk_bytes > 0) {
    const auto row_bytes = static_cast<std::size_t>(ffn) * dtype_size(dtype);
    chunk_rows_ = static_cast<std::int64_t>(activation_chunk_bytes / row_bytes);
    if (chunk_rows_ >= 128) chunk_rows_ -= chunk_rows_ % 64;
    chunk_rows_ = std::max<std::int64_t>(chunk_rows_, 1);
  }
  // Every stream runs the same products, so they share what tuning learns; only batched calls
  // are tuned (GemmTuning::plain_products).
  if (autotune) {
    tuning_ = std::make_shared<GemmTuning>();
    tuning_->plain_products = false;
  }
  for (int i = 0; i < streams; ++i) {
    streams_.emplace_back();
    runners_.emplace_back(workspace_bytes, tuning_);
    joins_.emplace_back();
  }
  // At most three products per expert in one call (the backward's dw2, dw13 and dX), three
  // pointers each.
  if (schedule != ExpertSchedule::kStreams)
    pointers_ = std::make_unique<PointerStaging>(9 * static_cast<std::size_t>(local_experts));
  if (schedule == ExpertSchedule::kGrouped) grouped_ = std::make_unique<Grouped>();
}

ExpertFFN::~ExpertFFN() = default;

void ExpertFFN::set_host_wait(std::function<void(cudaEvent_t)> wait) {
  if (!wait) fail("ExpertFFN::set_host_wait: empty function");
  host_wait_ = std::move(wait);
}

void ExpertFFN::check_shapes(const Tensor& X, std::span<const std::int64_t> offsets,
                             const Tensor& w13, const Tensor& w2,
                             const ExpertActivations& act) const {
  if (std::ssize(offsets) != experts_ + 1) {
    fail("ExpertFFN: {} offsets for {} local experts (expected {})", offsets.size(), experts_,
         experts_ + 1);
  }
  for (int e = 0; e < experts_; ++e) {
    if (offsets[e] < 0 || offsets[e + 1] < offsets[e])
      fail("ExpertFFN: offsets[{}..{}] = {}, {} decrease", e, e + 1, offsets[e], offsets[e + 1]);
  }
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(X, "ExpertFFN X", dtype_, {rows, H});
  expect_tensor(w13, "ExpertFFN w13", dtype_, {E, 2 * F, H});
  expect_tensor(w2, "ExpertFFN w2", dtype_, {E, H, F});
  expect_tensor(act.h, "ExpertFFN h", dtype_, {rows, 2 * F});
  expect_tensor(act.a, "ExpertFFN a", dtype_, {activation_rows(offsets), F});
  if (!act.scale.shape.empty()) expect_tensor(act.scale, "ExpertFFN scale", DType::kFP32, {rows});
}

namespace {
// Rows [first, first + count) of an optional per-row vector (Tensor{} stays Tensor{}).
Tensor row_range(const Tensor& rows, std::int64_t first, std::int64_t count) {
  if (rows.shape.empty()) return {};
  return Tensor(rows.as<char>() + first * static_cast<std::int64_t>(dtype_size(rows.dtype)),
                rows.dtype, {count});
}
}  // namespace

std::vector<ExpertFFN::Chunk> ExpertFFN::plan_chunks(std::span<const std::int64_t> offsets) const {
  std::vector<Chunk> chunks;
  Chunk open;
  auto close = [&] {
    if (open.rows > 0) chunks.push_back(std::move(open));
    open = Chunk{};
  };
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t first = offsets[e], m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    if (m > chunk_rows_ - open.rows) close();
    if (m <= chunk_rows_) {
      if (open.rows == 0) open.first_row = first;
      open.pieces.push_back({e, first, m, true});
      open.rows += m;
      continue;
    }
    // Larger than a chunk: near-equal pieces (whole 64-row tiles where they fit), one a chunk.
    const std::int64_t count = (m + chunk_rows_ - 1) / chunk_rows_;
    std::int64_t piece = (m + count - 1) / count;
    if (chunk_rows_ >= 64) piece = std::min(chunk_rows_, (piece + 63) / 64 * 64);
    for (std::int64_t r = 0; r < m; r += piece) {
      const std::int64_t n = std::min(piece, m - r);
      chunks.push_back({first + r, n, {{e, first + r, n, r == 0}}});
    }
  }
  close();
  return chunks;
}

std::int64_t ExpertFFN::activation_rows(std::span<const std::int64_t> offsets) const {
  if (std::ssize(offsets) != experts_ + 1) {
    fail("ExpertFFN: {} offsets for {} local experts (expected {})", offsets.size(), experts_,
         experts_ + 1);
  }
  if (chunk_rows_ >= offsets.back()) return offsets.back();
  std::int64_t most = 0;
  for (const auto& chunk : plan_chunks(offsets)) most = std::max(most, chunk.rows);
  return most;
}

void ExpertFFN::up_products(const Tensor& X, std::span<const std::int64_t> offsets,
                            const Tensor& w13, const Tensor& h, std::vector<Product>& out) const {
  const std::int64_t H = hidden_, F = ffn_;
  const std::size_t elem = dtype_size(dtype_);
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    out.push_back({{m, 2 * F, H, false, true, dtype_, dtype_, dtype_},
                   X.as<char>() + offsets[e] * H * elem,
                   w13.as<char>() + e * 2 * F * H * elem,
                   h.as<char>() + offsets[e] * 2 * F * elem});
  }
}

void ExpertFFN::forward(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
                        const Tensor& w2, const ExpertActivations& act, const Tensor& y,
                        cudaStream_t stream) {
  check_shapes(X, offsets, w13, w2, act);
  const std::int64_t H = hidden_, F = ffn_;
  expect_tensor(y, "ExpertFFN y", dtype_, {offsets.back(), H});
  const std::size_t elem = dtype_size(dtype_);

  std::vector<Product> products;
  up_products(X, offsets, w13, act.h, products);
  run(products, stream);  // h = X·w13ᵀ
  // Per chunk (the next one's SwiGLU waits for these products, the last readers of a):
  // a = silu(h_gate) ⊙ h_up, y = a·w2ᵀ.
  for (const Chunk& chunk : plan_chunks(offsets)) {
    swiglu_forward(
        Tensor(act.h.as<char>() + chunk.first_row * 2 * F * elem, dtype_, {chunk.rows, 2 * F}),
        Tensor(act.a.data, dtype_, {chunk.rows, F}), stream,
        row_range(act.scale, chunk.first_row, chunk.rows));
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{p.rows, H, F, false, true, dtype_, dtype_, dtype_},
                          act.a.as<char>() + (p.first_row - chunk.first_row) * F * elem,
                          w2.as<char>() + p.expert * H * F * elem,
                          y.as<char>() + p.first_row * H * elem});
    }
    run(products, stream);
  }
}

void ExpertFFN::backward(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                         const Tensor& w13, const Tensor& w2, const ExpertActivations& act,
                         bool recompute_h, const Tensor& dX, const Tensor& dw13, const Tensor& dw2,
                         cudaStream_t stream, const RefillInput& refill_input) {
  check_shapes(X, offsets, w13, w2, act);
  if (recompute_h && refill_input)
    fail("ExpertFFN::backward: recompute_h needs X on entry; it cannot be refilled later");
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(dY, "ExpertFFN dY", dtype_, {rows, H});
  expect_tensor(dX, "ExpertFFN dX", dtype_, {rows, H});
  expect_tensor(act.dA, "ExpertFFN dA", dtype_, {activation_rows(offsets), F});
  expect_tensor(act.dh, "ExpertFFN dh", dtype_, {rows, 2 * F});
  if (act.scale.shape.empty() != act.dscale.shape.empty())
    fail("ExpertFFN::backward: scale is {} and dscale {}; give both or neither",
         act.scale.describe(), act.dscale.describe());
  if (!act.dscale.shape.empty())
    expect_tensor(act.dscale, "ExpertFFN dscale", DType::kFP32, {rows});
  const DType grad_type = dw13.dtype;
  if (grad_type != DType::kBF16 && grad_type != DType::kFP32)
    fail("ExpertFFN: dw13 dtype {} must be bf16 or fp32", dtype_name(grad_type));
  expect_tensor(dw13, "ExpertFFN dw13", grad_type, {E, 2 * F, H});
  expect_tensor(dw2, "ExpertFFN dw2", grad_type, {E, H, F});
  const std::size_t elem = dtype_size(dtype_);
  const std::size_t grad_elem = dtype_size(grad_type);

  std::vector<Product> products;
  if (recompute_h) {
    up_products(X, offsets, w13, act.h, products);
    run(products, stream);
  }
  // Per chunk: dA = dY·w2, then dh and a again from h and dA. Cut into chunks, each chunk's dw2 =
  // dYᵀ·a follows before the next chunk's dA overwrites a; in one chunk, dw2 joins the fan-out
  // below, the most overlap.
  const std::vector<Chunk> chunks = plan_chunks(offsets);
  const bool chunked = chunks.size() > 1;
  for (const Chunk& chunk : chunks) {
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{p.rows, F, H, false, false, dtype_, dtype_, dtype_},
                          dY.as<char>() + p.first_row * H * elem,
                          w2.as<char>() + p.expert * H * F * elem,
                          act.dA.as<char>() + (p.first_row - chunk.first_row) * F * elem});
    }
    run(products, stream);
    auto rows_of = [&](const Tensor& t, std::int64_t width) {
      return Tensor(t.as<char>() + chunk.first_row * width * elem, dtype_, {chunk.rows, width});
    };
    swiglu_backward(rows_of(act.h, 2 * F), Tensor(act.dA.data, dtype_, {chunk.rows, F}),
                    rows_of(act.dh, 2 * F), Tensor(act.a.data, dtype_, {chunk.rows, F}), stream,
                    row_range(act.scale, chunk.first_row, chunk.rows),
                    row_range(act.dscale, chunk.first_row, chunk.rows));
    if (!chunked) continue;
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{H, F, p.rows, true, false, dtype_, dtype_, grad_type},
                          dY.as<char>() + p.first_row * H * elem,
                          act.a.as<char>() + (p.first_row - chunk.first_row) * F * elem,
                          dw2.as<char>() + p.expert * H * F * grad_elem,
                          p.first_of_expert ? 0.0f : 1.0f});
    }
    run(products, stream);
  }
  // dw2 = dYᵀ·a (unless done per chunk) and dw13 = dhᵀ·X (with no rows, K = 0, these write
  // zeros); dX = dh·w13. Separate buffers: one fan-out over all of them, the most overlap. dX over
  // dY (X kept): one fan-out, each expert's dX behind its dw2 (the last reader of its rows of dY)
  // on one stream. One buffer: dw2, X refilled, then each dw13 with its expert's dX behind it on
  // one stream.
  const bool dX_over_dY = !refill_input && dX.data == dY.data;
  std::vector<Product> all, dw2_products, dw13_products, dX_products;
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    const bool dw2_here = !chunked || m == 0;  // chunked: only the zeros of an empty expert
    const char* dh_e = act.dh.as<char>() + offsets[e] * 2 * F * elem;
    const Product dw2_e{{H, F, m, true, false, dtype_, dtype_, grad_type},
                        dY.as<char>() + offsets[e] * H * elem,
                        act.a.as<char>() + offsets[e] * F * elem,
                        dw2.as<char>() + e * H * F * grad_elem};
    const Product dw13_e{{2 * F, H, m, true, false, dtype_, dtype_, grad_type},
                         dh_e,
                         X.as<char>() + offsets[e] * H * elem,
                         dw13.as<char>() + e * 2 * F * H * grad_elem};
    const Product dX_e{{m, H, 2 * F, false, false, dtype_, dtype_, dtype_},
                       dh_e,
                       w13.as<char>() + e * 2 * F * H * elem,
                       dX.as<char>() + offsets[e] * H * elem};
    const Product none{};  // a follower slot with nothing to run (m·n = 0)
    if (dX_over_dY) {      // dw2_products holds the leads, dX_products their followers
      if (dw2_here) {
        dw2_products.push_back(dw2_e);
        dX_products.push_back(dX_e);  // with no rows m = 0: nothing runs
      } else {
        dw2_products.push_back(dX_e);  // dY's readers of this expert ran chunk by chunk
        dX_products.push_back(none);
      }
      dw2_products.push_back(dw13_e);
      dX_products.push_back(none);
    } else if (refill_input) {
      if (dw2_here) dw2_products.push_back(dw2_e);
      dw13_products.push_back(dw13_e);
      dX_products.push_back(dX_e);  // aligned with dw13's, empty with no rows
    } else {
      if (dw2_here) all.push_back(dw2_e);
      all.push_back(dw13_e);
      if (m > 0) all.push_back(dX_e);
    }
  }
  if (dX_over_dY) {
    run(dw2_products, stream, &dX_products);
    return;
  }
  if (!refill_input) {
    run(all, stream);
    return;
  }
  run(dw2_products, stream);                 // the last reads of dY
  refill_input(stream);                      // X over dY
  run(dw13_products, stream, &dX_products);  // dX over X_e once dw13_e has read it
}

namespace {

// Products with identical shapes (experts with equal padded row counts), in first-seen order.
// Empty ones (M·N = 0) are dropped; K = 0 ones (zeroing a weight gradient) stay alone.
template <typename Product>
std::vector<std::vector<const Product*>> same_shape_sets(const std::vector<Product>& products) {
  std::vector<std::vector<const Product*>> sets;
  std::map<GemmShape, std::size_t> index;
  for (const auto& p : products) {
    if (p.shape.m == 0 || p.shape.n == 0) continue;
    if (p.shape.k == 0 || p.beta != 0.0f) {  // batched calls take beta = 0 only
      sets.push_back({&p});
      continue;
    }
    const auto [it, added] = index.try_emplace(p.shape, sets.size());
    if (added) sets.emplace_back();
    sets[it->second].push_back(&p);
  }
  return sets;
}

}  // namespace

void ExpertFFN::run(const std::vector<Product>& products, cudaStream_t stream,
                    const std::vector<Product>* followers) {
  if (products.empty()) return;
  if (followers != nullptr && followers->size() != products.size())
    fail("ExpertFFN: {} followers for {} products", followers->size(), products.size());
  switch (schedule_) {
    case ExpertSchedule::kStreams:
      return run_on_streams(products, false, stream, followers);
    case ExpertSchedule::kBatched:
      return run_on_streams(products, true, stream, followers);
    case ExpertSchedule::kGrouped:  // one call for all: the followers' call comes after it
      run_grouped(products, stream);
      if (followers != nullptr) run_grouped(*followers, stream);
      return;
  }
}

void ExpertFFN::run_on_streams(const std::vector<Product>& products, bool batch_equal_shapes,
                               cudaStream_t stream, const std::vector<Product>* followers) {
  // Work items: one product, or (batching) every product of one shape as one call.
  struct Item {
    const Product* single = nullptr;
    GemmShape shape;
    int count = 0;
    std::size_t first = 0;  // the batch's a, b, c address arrays at [first, +count, +2·count)
    std::uint32_t alignment = 256;
    double flops = 0;
  };
  std::vector<const void*> addresses;
  auto make_item = [&](const std::vector<const Product*>& set) {
    const GemmShape& shape = set.front()->shape;
    if (set.size() == 1) return Item{set.front(), shape, 1, 0, 0, flops(shape)};
    Item batch{nullptr,          shape, static_cast<int>(set.size()),
               addresses.size(), 256,   flops(shape) * static_cast<double>(set.size())};
    for (const auto* p : set) {
      if (p->shape.key() != shape.key())
        fail("ExpertFFN: products of one batched call differ in shape");
      addresses.push_back(p->a);
    }
    for (const auto* p : set) addresses.push_back(p->b);
    for (const auto* p : set) addresses.push_back(p->c);
    for (std::size_t i = batch.first; i < addresses.size(); ++i)
      batch.alignment = std::min(batch.alignment, address_alignment(addresses[i]));
    return batch;
  };
  // A unit goes to one stream: an item, then (with followers) the item of its products'
  // followers, which may read what the first wrote.
  struct Unit {
    Item lead;
    std::optional<Item> then;
    double flops = 0;
  };
  std::vector<std::vector<const Product*>> sets;
  if (batch_equal_shapes) {
    sets = same_shape_sets(products);
  } else {
    for (const auto& p : products) sets.push_back({&p});
  }
  std::vector<Unit> units;
  for (const auto& set : sets) {
    Unit unit{make_item(set), std::nullopt, 0};
    if (followers != nullptr) {
      std::vector<const Product*> after;
      for (const auto* p : set) {
        const Product& f = (*followers)[static_cast<std::size_t>(p - products.data())];
        if (f.shape.m * f.shape.n != 0) after.push_back(&f);
      }
      if (!after.empty()) unit.then = make_item(after);
    }
    unit.flops = unit.lead.flops + (unit.then ? unit.then->flops : 0.0);
    units.push_back(std::move(unit));
  }
  if (units.empty()) return;
  const void* const* staged = addresses.empty() ? nullptr : pointers_->stage(addresses, stream);

  // Largest first, each to the least loaded stream, so no stream is left with the long tail.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& x, const Unit& y) { return x.flops > y.flops; });
  const std::size_t lanes = std::min(streams_.size(), units.size());
  std::vector<double> load(lanes, 0.0);
  fork_.record(stream);
  for (std::size_t s = 0; s < lanes; ++s)
    MOE_CHECK_CUDA(cudaStreamWaitEvent(streams_[s].get(), fork_.get(), 0));
  auto launch_item = [&](const Item& item, std::size_t lane) {
    cudaStream_t lane_stream = streams_[lane].get();
    if (item.single != nullptr) {
      runners_[lane].run(item.shape, item.single->a, item.single->b, item.single->c, lane_stream,
                         1.0f, item.single->beta);
    } else {
      const void* const* a = staged + item.first;
      runners_[lane].run_batched(item.shape, item.count, a, a + item.count,
                                 const_cast<void* const*>(a + 2 * item.count), item.alignment,
                                 lane_stream);
    }
  };
  auto launch = [&](const Unit& unit, std::size_t lane) {
    load[lane] += unit.flops;
    launch_item(unit.lead, lane);
    if (unit.then) launch_item(*unit.then, lane);
  };
  auto tuned = [&](const Item& item) {
    return item.single != nullptr ? runners_[0].tuned(item.shape)
                                  : runners_[0].tuned(item.shape, item.count, item.alignment);
  };
  // Units with a size class not timed yet run first, one after another on the first stream
  // before anything fans out, so that their algorithm trials run alone on the device. The host
  // first waits for the work queued before (through host_wait_, which a mesh bounds by its
  // timeout): the trials' own wait must not be the one that meets a stuck collective.
  std::vector<bool> launched(units.size(), false);
  bool idle = false;
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (tuned(units[i].lead) && (!units[i].then || tuned(*units[i].then))) continue;
    if (!idle) {
      host_wait_(fork_.get());
      idle = true;
    }
    launch(units[i], 0);
    launched[i] = true;
  }
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (launched[i]) continue;
    launch(units[i],
           static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin()));
  }
  for (std::size_t s = 0; s < lanes; ++s) {
    joins_[s].record(streams_[s].get());
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, joins_[s].get(), 0));
  }
}

void ExpertFFN::run_grouped(const std::vector<Product>& products, cudaStream_t stream) {
  // cublasGemmGroupedBatchedEx takes one dtype for inputs and output: bf16 products with fp32
  // weight gradients go through the batched cuBLASLt path instead.
  std::vector<Product> one_type, mixed;
  for (const auto& p : products) {
    if (p.shape.a_type != p.shape.b_type) fail("ExpertFFN: a product mixes input dtypes");
    // The grouped call here takes beta = 0: pieces that add to C run beside the mixed ones.
    (p.shape.c_type == p.shape.a_type && p.beta == 0.0f ? one_type : mixed).push_back(p);
  }
  if (!mixed.empty()) run_on_streams(mixed, true, stream);
  // One group per shape; K = 0 products only zero their output.
  std::vector<std::vector<const Product*>> groups;
  for (auto& set : same_shape_sets(one_type)) {
    const GemmShape& s = set.front()->shape;
    if (s.k == 0) {
      MOE_CHECK_CUDA(cudaMemsetAsync(
          set.front()->c, 0, static_cast<std::size_t>(s.m * s.n) * dtype_size(s.c_type), stream));
    } else {
      groups.push_back(std::move(set));
    }
  }
  if (!groups.empty()) run_grouped_call(groups, dtype_, stream);
}

void ExpertFFN::run_grouped_call(const std::vector<std::vector<const Product*>>& groups, DType type,
                                 cudaStream_t stream) {
  // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, as in GemmRunner.
  const std::size_t n = groups.size();
  std::vector<cublasOperation_t> trans_first(n), trans_second(n);
  std::vector<int> m(n), nn(n), k(n), ld_first(n), ld_second(n), ld_out(n), group_size(n);
  std::vector<float> alpha(n, 1.0f), beta(n, 0.0f);
  std::vector<const void*> first, second, out;  // per product, in group order
  for (std::size_t g = 0; g < n; ++g) {
    const GemmShape& s = groups[g].front()->shape;
    trans_first[g] = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    trans_second[g] = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[g] = static_cast<int>(s.n);
    nn[g] = static_cast<int>(s.m);
    k[g] = static_cast<int>(s.k);
    ld_first[g] = static_cast<int>(s.trans_b ? s.k : s.n);
    ld_second[g] = static_cast<int>(s.trans_a ? s.m : s.k);
    ld_out[g] = static_cast<int>(s.n);
    group_size[g] = static_cast<int>(groups[g].size());
    for (const auto* p : groups[g]) {
      first.push_back(p->b);
      second.push_back(p->a);
      out.push_back(p->c);
    }
  }
  const std::size_t count = first.size();
  std::vector<const void*> addresses = first;
  addresses.insert(addresses.end(), second.begin(), second.end());
  addresses.insert(addresses.end(), out.begin(), out.end());
  const void* const* device = pointers_->stage(addresses, stream);
  auto& g = *grouped_;
  check_cublas_status(cublasSetStream(g.handle, stream), "cublasSetStream");
  check_cublas_status(
      cublasGemmGroupedBatchedEx(g.handle, trans_first.data(), trans_second.data(), m.data(),
                                 nn.data(), k.data(), alpha.data(), device, cuda_type(type),
                                 ld_first.data(), device + count, cuda_type(type), ld_second.data(),
                                 beta.data(), const_cast<void* const*>(device + 2 * count),
                                 cuda_type(type), ld_out.data(), static_cast<int>(n),
                                 group_size.data(), CUBLAS_COMPUTE_32F),
      "cublasGemmGroupedBatchedEx");
}

}  // namespace moe
