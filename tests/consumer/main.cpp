// Uses the installed headers and library: a config, the fp64 reference, a tensor file.
#include <moe/config.h>
#include <moe/reference.h>
#include <moe/safetensors.h>

#include <cstdio>

int main() {
  const auto config = moe::parse_config("hidden: 4\nffn_hidden: 4\nnum_experts: 4\ntopk: 2\n");
  moe::reference::Matrix logits(1, 4);
  logits.data = {0.1, 2.0, -1.0, 1.0};
  const auto routing = moe::reference::route(config, logits, {});
  moe::TensorFile file;
  file.add("experts", moe::FileDType::kI32, {2}, routing.expert.data());
  const auto back = moe::TensorFile::parse(file.serialize());
  const bool ok =
      routing.expert[0] == 1 && routing.expert[1] == 3 && back.get("experts").shape[0] == 2;
  std::printf("consumer: %s (%s)\n", ok ? "ok" : "WRONG", config.describe().c_str());
  return ok ? 0 : 1;
}
