#include "src/stage_support.h"

#include <utility>

namespace moe {
namespace {
StageHook& installed_hook() {
  static StageHook hook;
  return hook;
}
}  // namespace

void set_stage_hook(StageHook hook) {
  installed_hook() = std::move(hook);
}
const StageHook& stage_hook() {
  return installed_hook();
}

}  // namespace moe
