#pragma once

namespace moe::test {
enum class Needs { kCpu = 0, kGpu = 1, kMpi = 2 };
// Defined per test binary (support/needs.cpp).
Needs test_needs();
// Under MPI: this process's world rank and size (0 and 1 otherwise).
int world_rank();
int world_size();
inline constexpr int kSkipExitCode = 77;  // ctest SKIP_RETURN_CODE
}  // namespace moe::test
