// Elementwise device work: dtype conversion, seeded initialisation, finiteness checks, small
// writes of host values, clearing rows up to an end held on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "moe/tensor.h"

namespace moe {

// out = in converted to out's dtype; both bf16 or fp32 with the same element count.
void convert(const Tensor& in, const Tensor& out, cudaStream_t stream);

// Fills a bf16 or fp32 tensor with N(0, stddev²) values that depend only on (seed, first + i) for
// element i: the same global slice gets the same values on every rank.
void init_normal(const Tensor& out, std::uint64_t seed, std::uint64_t first, float stddev,
                 cudaStream_t stream);

// device[i] = values[i] for at most 8 values, carried in the kernel's parameters: unlike a copy
// from host memory, the launch reads the host values when it is queued, so a CUDA graph that
// captures it writes the values it was captured with.
void write_values(std::int64_t* device, std::span<const std::int64_t> values, cudaStream_t stream);

// Counts the NaN and Inf elements of a bf16 or fp32 tensor into *count (device, int32).
void count_nonfinite(const Tensor& t, int* count, cudaStream_t stream);

}  // namespace moe
