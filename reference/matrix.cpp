#include <algorithm>
#include <span>

#include "moe/error.h"
#include "moe/tensor.h"
#include "reference/reference.h"

namespace moe::reference {

Matrix matmul(const Matrix& a, const Matrix& b) {
  if (a.cols != b.rows) fail("matmul: [{},{}] · [{},{}]", a.rows, a.cols, b.rows, b.cols);
  Matrix c(a.rows, b.cols);
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t k = 0; k < a.cols; ++k) {
      const double aik = a(i, k);
      if (aik == 0.0) continue;
      for (std::int64_t j = 0; j < b.cols; ++j) c(i, j) += aik * b(k, j);
    }
  }
  return c;
}

Matrix matmul_nt(const Matrix& a, const Matrix& b) {
  if (a.cols != b.cols) fail("matmul_nt: [{},{}] · [{},{}]ᵀ", a.rows, a.cols, b.rows, b.cols);
  Matrix c(a.rows, b.rows);
  for (std::int64_t i = 0; i < a.rows; ++i) {
    // A zero row (an expert's alignment padding) gives a zero row, as the sum below would with
    // finite weights (a NaN or Inf, which only --no-check-finite lets in, would give NaN), and
    // matmul's zero skip gives alike: the padding's cost does not grow with num_experts ·
    // align_size whatever the tokens.
    const auto row = std::span(a.data).subspan(static_cast<std::size_t>(i * a.cols),
                                               static_cast<std::size_t>(a.cols));
    if (std::all_of(row.begin(), row.end(), [](double v) { return v == 0.0; })) continue;
    for (std::int64_t j = 0; j < b.rows; ++j) {
      double sum = 0.0;
      for (std::int64_t k = 0; k < a.cols; ++k) sum += a(i, k) * b(j, k);
      c(i, j) = sum;
    }
  }
  return c;
}

Matrix matmul_tn(const Matrix& a, const Matrix& b) {
  if (a.rows != b.rows) fail("matmul_tn: [{},{}]ᵀ · [{},{}]", a.rows, a.cols, b.rows, b.cols);
  Matrix c(a.cols, b.cols);
  for (std::int64_t k = 0; k < a.rows; ++k) {
    for (std::int64_t i = 0; i < a.cols; ++i) {
      const double aki = a(k, i);
      if (aki == 0.0) continue;
      for (std::int64_t j = 0; j < b.cols; ++j) c(i, j) += aki * b(k, j);
    }
  }
  return c;
}

Matrix transpose(const Matrix& m) {
  Matrix t(m.cols, m.rows);
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t c = 0; c < m.cols; ++c) t(c, r) = m(r, c);
  }
  return t;
}

void add_into(Matrix& target, const Matrix& addend) {
  if (target.rows != addend.rows || target.cols != addend.cols) {
    fail("add_into: [{},{}] += [{},{}]", target.rows, target.cols, addend.rows, addend.cols);
  }
  for (std::size_t i = 0; i < target.data.size(); ++i) target.data[i] += addend.data[i];
}

Matrix slice_rows(const Matrix& m, std::int64_t begin, std::int64_t end) {
  if (begin < 0 || end < begin || end > m.rows) {
    fail("slice_rows: [{}, {}) of {} rows", begin, end, m.rows);
  }
  Matrix out(end - begin, m.cols);
  std::copy(m.data.begin() + begin * m.cols, m.data.begin() + end * m.cols, out.data.begin());
  return out;
}

Matrix concat_rows(std::span<const Matrix> parts) {
  std::int64_t rows = 0;
  const std::int64_t cols = parts.empty() ? 0 : parts.front().cols;
  for (const auto& part : parts) {
    if (part.cols != cols) fail("concat_rows: {} columns after {}", part.cols, cols);
    rows += part.rows;
  }
  Matrix out(rows, cols);
  auto cursor = out.data.begin();
  for (const auto& part : parts) cursor = std::copy(part.data.begin(), part.data.end(), cursor);
  return out;
}

Matrix round_to(const Matrix& m, DType dtype) {
  Matrix out = m;
  for (auto& v : out.data) {
    const auto f = static_cast<float>(v);
    v = dtype == DType::kBF16 ? from_bf16(to_bf16(f)) : f;
  }
  return out;
}

}  // namespace moe::reference
