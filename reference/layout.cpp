// Forward steps 4 and 6 of docs/design.md on one rank in fp64: padded expert-major layout, permute,
// combine, the EP receiver's chunk sort, and their backward. Slots that capacity mode dropped have
// no row and are skipped throughout.
#include "moe/error.h"
#include "reference/reference.h"

namespace moe::reference {

std::vector<std::int64_t> padded_offsets(std::span<const std::int64_t> counts, int align) {
  std::vector<std::int64_t> offsets(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e) {
    const std::int64_t padded = align > 1 ? (counts[e] + align - 1) / align * align : counts[e];
    offsets[e + 1] = offsets[e] + padded;
  }
  return offsets;
}

Layout make_layout(const Routing& routing, int num_experts, int align) {
  return make_layout(routing, std::vector<int>(routing.expert.size(), 1), num_experts, align);
}

Layout make_layout(const Routing& routing, std::span<const int> kept, int num_experts, int align,
                   std::int64_t block_rows) {
  if (kept.size() != routing.expert.size())
    fail("make_layout: {} kept flags for {} slots", kept.size(), routing.expert.size());
  Layout layout;
  layout.counts.assign(num_experts, 0);
  for (std::size_t i = 0; i < routing.expert.size(); ++i) {
    const int e = routing.expert[i];
    if (e < 0 || e >= num_experts) fail("make_layout: expert {} of {}", e, num_experts);
    if (kept[i] != 0) ++layout.counts[e];
  }
  if (block_rows > 0) {
    layout.offsets.assign(layout.counts.size() + 1, 0);
    for (std::size_t e = 0; e < layout.counts.size(); ++e) {
      if (layout.counts[e] > block_rows)
        fail("make_layout: expert {} keeps {} rows, more than its block of {}", e, layout.counts[e],
             block_rows);
      layout.offsets[e + 1] = layout.offsets[e] + block_rows;
    }
  } else {
    layout.offsets = padded_offsets(layout.counts, align);
  }
  // Visiting (t, k) in ascending order fills each group in (token, slot) order.
  std::vector<std::int64_t> cursor(layout.offsets.begin(), layout.offsets.end() - 1);
  layout.row.resize(routing.expert.size());
  for (std::size_t i = 0; i < routing.expert.size(); ++i)
    layout.row[i] = kept[i] != 0 ? cursor[routing.expert[i]]++ : Layout::kDroppedRow;
  return layout;
}

Matrix permute(const Matrix& x, const Layout& layout, const Routing& routing) {
  Matrix X(layout.rows(), x.cols);  // zero: padding rows stay zero
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;
      const auto src = x.row(t);
      std::copy(src.begin(), src.end(), X.row(row).begin());
    }
  }
  return X;
}

Matrix unpermute_combine(const Matrix& y, const Layout& layout, const Routing& routing) {
  Matrix out(routing.tokens, y.cols);
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    auto o = out.row(t);
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;
      const auto src = y.row(row);
      const double p = routing.prob_of(t, k);
      for (std::int64_t j = 0; j < y.cols; ++j) o[j] += p * src[j];
    }
  }
  return out;
}

Matrix combine_backward_rows(const Matrix& dy, const Layout& layout, const Routing& routing) {
  Matrix dY(layout.rows(), dy.cols);
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;
      auto dst = dY.row(row);
      const double p = routing.prob_of(t, k);
      for (std::int64_t j = 0; j < dy.cols; ++j) dst[j] = p * dy(t, j);
    }
  }
  return dY;
}

std::vector<double> combine_backward_prob(const Matrix& dy, const Matrix& y, const Layout& layout,
                                          const Routing& routing) {
  std::vector<double> dprob(routing.expert.size(), 0.0);
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;  // no row, no gradient: dp stays 0
      const auto src = y.row(row);
      double dot = 0.0;
      for (std::int64_t j = 0; j < dy.cols; ++j) dot += dy(t, j) * src[j];
      dprob[t * routing.topk + k] = dot;
    }
  }
  return dprob;
}

Matrix permute_backward(const Matrix& dX, const Layout& layout, const Routing& routing) {
  Matrix dx(routing.tokens, dX.cols);
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    auto d = dx.row(t);
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;
      const auto src = dX.row(row);
      for (std::int64_t j = 0; j < dX.cols; ++j) d[j] += src[j];
    }
  }
  return dx;
}

std::vector<std::int64_t> ChunkLayout::rows_per_expert() const {
  std::vector<std::int64_t> rows(local_experts, 0);
  for (int s = 0; s < sources; ++s) {
    for (int e = 0; e < local_experts; ++e) rows[e] += count(s, e);
  }
  return rows;
}

namespace {
// Calls visit(source_major_row, expert_major_row) for every real row of the chunk layout.
template <typename Visit>
void for_each_chunk_row(const ChunkLayout& chunks, int align, Visit visit) {
  const auto expert_offsets = padded_offsets(chunks.rows_per_expert(), align);
  std::vector<std::int64_t> cursor(expert_offsets.begin(), expert_offsets.end() - 1);
  std::int64_t source_row = 0;
  for (int s = 0; s < chunks.sources; ++s) {
    for (int e = 0; e < chunks.local_experts; ++e) {
      for (std::int64_t i = 0; i < chunks.count(s, e); ++i) visit(source_row++, cursor[e]++);
    }
  }
}
}  // namespace

Matrix sort_chunks(const Matrix& source_major, const ChunkLayout& chunks, int align) {
  Matrix expert_major(padded_offsets(chunks.rows_per_expert(), align).back(), source_major.cols);
  for_each_chunk_row(chunks, align, [&](std::int64_t from, std::int64_t to) {
    const auto src = source_major.row(from);
    std::copy(src.begin(), src.end(), expert_major.row(to).begin());
  });
  return expert_major;
}

Matrix unsort_chunks(const Matrix& expert_major, const ChunkLayout& chunks, int align) {
  std::int64_t rows = 0;
  for (const auto c : chunks.counts) rows += c;
  Matrix source_major(rows, expert_major.cols);
  for_each_chunk_row(chunks, align, [&](std::int64_t to, std::int64_t from) {
    const auto src = expert_major.row(from);
    std::copy(src.begin(), src.end(), source_major.row(to).begin());
  });
  return source_major;
}

}  // namespace moe::reference
