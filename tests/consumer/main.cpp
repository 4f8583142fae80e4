// Uses the installed headers and library as a trainer's project would: a config, a tensor view,
// a safetensors file round trip, and a clear error for bad input.
#include <moe/config.h>
#include <moe/error.h>
#include <moe/safetensors.h>

#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  const auto config = moe::parse_config("hidden: 4\nffn_hidden: 4\nnum_experts: 4\ntopk: 2\n");
  const std::vector<std::int32_t> experts = {1, 3};
  moe::TensorFile file;
  file.add("experts", moe::FileDType::kI32, {2}, experts.data());
  const auto back = moe::TensorFile::parse(file.serialize());
  bool rejected = false;
  try {
    moe::parse_config("hidden: 4\nffn_hidden: 4\nnum_experts: 4\ntopk: 9\n");
  } catch (const moe::Error&) {
    rejected = true;
  }
  const bool ok = config.num_experts == 4 && back.get("experts").shape[0] == 2 && rejected;
  std::printf("consumer: %s (%s)\n", ok ? "ok" : "WRONG", config.describe().c_str());
  return ok ? 0 : 1;
}
