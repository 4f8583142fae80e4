// How the expert products launch: one cuBLASLt product at a time on several streams, batches of
// equal shapes through pointer arrays, or one grouped cuBLAS call (docs/design.md, "Experts"); the
// operand addresses staged for the device, and a span's part of each launch (ExpertSpan).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>

#include "experts.h"
#include "moe/error.h"
#include "pointer_upload.cuh"

namespace moe {

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
                    const std::vector<Product>* followers, ExpertSpan span) {
  if (products.empty()) return;
  if (followers != nullptr && followers->size() != products.size())
    fail("ExpertFFN: {} followers for {} products", followers->size(), products.size());
  switch (schedule_) {
    case ExpertSchedule::kStreams:
      return run_on_streams(products, false, stream, followers, span);
    case ExpertSchedule::kBatched:
      return run_on_streams(products, true, stream, followers, span);
    case ExpertSchedule::kGrouped: {  // one call for all: the followers' call comes after it
      // The span's products alone (their groups are the span's, so no bitwise promise here).
      auto in_span = [&](const std::vector<Product>& all) {
        std::vector<Product> kept;
        for (const Product& p : all) {
          if (p.expert < 0 || (p.expert >= span.first && p.expert < span.end)) kept.push_back(p);
        }
        return kept;
      };
      run_grouped(in_span(products), stream);
      if (followers != nullptr) run_grouped(in_span(*followers), stream);
      return;
    }
  }
}

void ExpertFFN::run_on_streams(const std::vector<Product>& products, bool batch_equal_shapes,
                               cudaStream_t stream, const std::vector<Product>* followers,
                               ExpertSpan span) {
  // Work items: one product, or (batching) every product of one shape as one call. A span runs
  // the part of each item that its experts own, launched as the whole item would be: batched
  // wherever the whole is, with the whole's size class and alignment.
  struct Item {
    const Product* single = nullptr;
    GemmShape shape;
    int count = 0;
    std::size_t first = 0;  // the batch's a, b, c address arrays at [first, +count, +2·count)
    std::uint32_t alignment = 256;
    double flops = 0;
    int batch_class = 0;  // the whole item's count (a span's part may hold fewer)
  };
  auto in_span = [&](const Product* p) {
    return p->expert < 0 || (p->expert >= span.first && p->expert < span.end);
  };
  std::vector<const void*> addresses;
  // The item of `set` (all experts), for its products in the span; count 0 where none is.
  auto make_item = [&](const std::vector<const Product*>& set) {
    const GemmShape& shape = set.front()->shape;
    if (set.size() == 1) {
      if (!in_span(set.front())) return Item{};
      return Item{set.front(), shape, 1, 0, 0, flops(shape)};
    }
    std::uint32_t alignment = 256;
    for (const auto* p : set) {
      if (p->shape.key() != shape.key())
        fail("ExpertFFN: products of one batched call differ in shape");
      for (const void* address : {p->a, p->b, static_cast<const void*>(p->c)})
        alignment = std::min(alignment, address_alignment(address));
    }
    std::vector<const Product*> part;
    for (const auto* p : set) {
      if (in_span(p)) part.push_back(p);
    }
    if (part.empty()) return Item{};
    Item batch{nullptr,
               shape,
               static_cast<int>(part.size()),
               addresses.size(),
               alignment,
               flops(shape) * static_cast<double>(part.size()),
               static_cast<int>(set.size())};
    for (const auto* p : part) addresses.push_back(p->a);
    for (const auto* p : part) addresses.push_back(p->b);
    for (const auto* p : part) addresses.push_back(p->c);
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
    if (unit.lead.count == 0) continue;  // none of the span's
    if (followers != nullptr) {
      std::vector<const Product*> after;
      for (const auto* p : set) {
        const Product& f = (*followers)[static_cast<std::size_t>(p - products.data())];
        if (f.shape.m * f.shape.n != 0) after.push_back(&f);
      }
      if (!after.empty()) {
        unit.then = make_item(after);  // a follower is its lead's expert's
        if (unit.then->count == 0) unit.then.reset();
      }
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
                                 lane_stream, item.batch_class);
    }
  };
  auto launch = [&](const Unit& unit, std::size_t lane) {
    load[lane] += unit.flops;
    launch_item(unit.lead, lane);
    if (unit.then) launch_item(*unit.then, lane);
  };
  auto tuned = [&](const Item& item) {
    return item.single != nullptr
               ? runners_[0].tuned(item.shape)
               : runners_[0].tuned(item.shape, item.count, item.alignment, item.batch_class);
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
  if (!mixed.empty()) run_on_streams(mixed, true, stream, nullptr, ExpertSpan{});
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
