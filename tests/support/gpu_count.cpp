// Prints the number of visible CUDA GPUs (0 without a driver): the mpi test launcher's guard.
#include <cstdio>

#include "moe/device.h"

int main() {
  std::printf("%d\n", moe::cuda_device_count());
  return 0;
}
