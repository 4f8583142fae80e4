// libFuzzer target: parse_config on arbitrary text.
//
// Bad input must become a moe::Error and nothing else: any other exception (a yaml-cpp
// conversion error let through, std::bad_alloc from a size taken on trust) escapes this function
// and libFuzzer reports it as a crash, as it does a sanitizer finding or a time-out. A config that
// parses is valid, so validate() passes again and the padding arithmetic is defined.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "moe/config.h"
#include "moe/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  moe::MoEConfig config;
  try {
    config = moe::parse_config(text, "fuzz.yaml");
  } catch (const moe::Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  config.validate();  // a parsed config is valid: throwing here escapes and is reported
  (void)config.describe();
  // The largest count whose padding still fits in int64 pads without error.
  const std::int64_t largest = std::numeric_limits<std::int64_t>::max() - moe::kMaxAlignSize;
  if (config.padded_rows(largest) < largest) std::abort();
  if (config.padded_rows(0) != 0) std::abort();
  // Capacity mode: any token count's capacity is a row count within the bound, or a moe::Error.
  if (config.capacity_mode()) {
    for (const std::int64_t tokens : {std::int64_t{0}, std::int64_t{1}, std::int64_t{1} << 30}) {
      try {
        const std::int64_t capacity = config.expert_capacity(tokens);
        if (capacity < 0 || capacity > moe::kMaxCapacityRows) std::abort();
      } catch (const moe::Error&) {
      }
    }
  }
  return 0;
}
