// Shared helpers of pdserve's CPU kernels: float32 accumulators stored to the output dtype.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

namespace pdserve {

// dst[i] = round(src[i] (+ add[i])) for i < n; `add` (nullable) is in the output dtype.
template <typename T>
inline void store_row(T* __restrict__ dst, const float* __restrict__ src,
                      const T* __restrict__ add, int64_t n) {
  using fV = at::vec::Vectorized<float>;
  using tV = at::vec::Vectorized<T>;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fV::size() <= n; i += fV::size()) {
      fV a = fV::loadu(src + i);
      if (add) a = a + fV::loadu(add + i);
      a.store(dst + i);
    }
  } else {
    for (; i + tV::size() <= n; i += tV::size()) {
      fV a = fV::loadu(src + i), b = fV::loadu(src + i + fV::size());
      if (add) {
        auto [x, y] = at::vec::convert_to_float<T>(tV::loadu(add + i));
        a = a + x;
        b = b + y;
      }
      at::vec::convert_from_float<T>(a, b).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] + (add ? static_cast<float>(add[i]) : 0.f));
}

}  // namespace pdserve
