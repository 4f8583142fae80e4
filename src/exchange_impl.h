// What the three token exchanges share: the slot layout of this rank's tokens, and their makers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "moe/device.h"
#include "src/token_exchange.h"

namespace moe {

// The layout of the T·K slots by expert (build_layout): each expert's row count, where its group
// starts (padded to `align`), and each slot's row. Kept from forward to backward.
class SlotLayout {
 public:
  explicit SlotLayout(DeviceBuffer& workspace) : workspace_(workspace) {}
  // fixed_rows > 0: the first fixed_groups groups take exactly that many rows each.
  void build(const std::int32_t* topk_idx, std::int64_t tokens, int topk, int experts, int align,
             cudaStream_t stream, int fixed_rows = 0, int fixed_groups = 0);
  const std::int32_t* counts() const { return counts_.as<std::int32_t>(); }    // [E]
  const std::int32_t* offsets() const { return offsets_.as<std::int32_t>(); }  // [E + 1]
  const std::int32_t* row_map() const { return row_map_.as<std::int32_t>(); }  // [T, K]

 private:
  DeviceBuffer& workspace_;  // the scratch's
  DeviceBuffer counts_, offsets_, row_map_;
};

std::unique_ptr<TokenExchange> make_local_exchange(const ExchangeSetup& setup);
std::unique_ptr<TokenExchange> make_nccl_exchange(const ExchangeSetup& setup);
std::unique_ptr<TokenExchange> make_peer_exchange(const ExchangeSetup& setup);

}  // namespace moe
