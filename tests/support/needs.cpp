// Compiled into each test binary with MOE_TEST_NEEDS set by CMake: what its main must provide.
#include "support/test_main.h"

namespace moe::test {
Needs test_needs() {
  return static_cast<Needs>(MOE_TEST_NEEDS);
}
}  // namespace moe::test
