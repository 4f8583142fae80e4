#include "io/expert_streams.h"

#include "io/tensor_values.h"
#include "moe/error.h"

namespace moe {
namespace {

// One expert's [rows, cols] slice of a stacked tensor, as doubles, as a layer holding it in
// `held` sees them.
reference::Matrix expert_matrix(const TensorSource& weights, const std::string& name, int expert,
                                std::int64_t rows, std::int64_t cols, DType held) {
  reference::Matrix m(rows, cols);
  m.data = file_values(weights.read_rows(name, expert, 1), name, held);
  if (std::ssize(m.data) != rows * cols)
    fail("{}: expert {} of tensor '{}' has {} values; expected [{}, {}]", weights.source(), expert,
         name, m.data.size(), rows, cols);
  return m;
}

void append_f32(TensorFileWriter& writer, const std::string& name, const reference::Matrix& m) {
  const std::vector<float> values(m.data.begin(), m.data.end());
  writer.append(name, values.data(), values.size() * 4);
}

}  // namespace

FileExperts::FileExperts(const MoEConfig& config, const TensorSource& weights)
    : config_(config), weights_(weights) {}

reference::ExpertWeights FileExperts::load(int expert) const {
  const std::int64_t H = config_.hidden, F = config_.ffn_hidden;
  reference::ExpertWeights w;
  w.w13.push_back(
      reference::transpose(expert_matrix(weights_, "w13", expert, 2 * F, H, config_.dtype)));
  w.w2.push_back(reference::transpose(expert_matrix(weights_, "w2", expert, H, F, config_.dtype)));
  return w;
}

FileExpertGrads::FileExpertGrads(const MoEConfig& config, TensorFileWriter& writer)
    : config_(config), writer_(writer) {}

void FileExpertGrads::take(int expert, reference::Matrix dw13, reference::Matrix dw2) {
  const std::int64_t H = config_.hidden, F = config_.ffn_hidden;
  if (expert != next_)
    fail("FileExpertGrads: the gradients of expert {} came after {} experts", expert, next_);
  if (dw13.rows != H || dw13.cols != 2 * F || dw2.rows != F || dw2.cols != H)
    fail(
        "FileExpertGrads: expert {} has gradients [{},{}] and [{},{}]; expected [{},{}] and "
        "[{},{}]",
        expert, dw13.rows, dw13.cols, dw2.rows, dw2.cols, H, 2 * F, F, H);
  append_f32(writer_, "grad.w13", reference::transpose(dw13));
  append_f32(writer_, "grad.w2", reference::transpose(dw2));
  ++next_;
}

}  // namespace moe
