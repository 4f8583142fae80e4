// Catch2 v2 (Debian bookworm, CI) and v3 (Ubuntu 24.04, the GPU machine) behind one include.
#pragma once

#if MOE_CATCH2_V3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;  // v2 declares Approx at global scope; do the same for v3
#else
#include <catch2/catch.hpp>
#endif

#include <string>

namespace moe::test {
// Substring matcher: ContainsSubstring in v3, Contains in v2.
inline auto contains_text(const std::string& text) {
#if MOE_CATCH2_V3
  return Catch::Matchers::ContainsSubstring(text);
#else
  return Catch::Matchers::Contains(text);
#endif
}
}  // namespace moe::test
