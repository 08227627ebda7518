// RMSNorm in one kernel: a row's sum of squares in float32 and its scaled store in one pass
// each, no temporaries (torch's form runs five elementwise ops, each a dispatch and a pass
// over the rows: most of a decode step's elementwise time).
//
// Rounding follows HF exactly: Llama's `weight * (x * rstd).to(dtype)` rounds x * rstd to the
// dtype and then the product with the weight; Gemma 3's `(x * rstd * (1 + w)).to(dtype)`
// rounds once (`one_plus` holds 1 + w in float32). The sum of squares runs lane-wise, then a
// fixed lane tree: a row's bits depend on that row alone, whatever the row count or threads.
#include <ATen/Parallel.h>

#include <cmath>

#include "common.h"

namespace pdserve {

template <typename T>
void rms_norm_rows(const T* x, const T* w, const float* w1, T* out, int64_t rows, int64_t d,
                   float eps) {
  using fV = at::vec::Vectorized<float>;
  using tV = at::vec::Vectorized<T>;
  constexpr int64_t step = std::is_same_v<T, float> ? fV::size() : tV::size();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      fV acc(0.f);
      int64_t i = 0;
      for (; i + step <= d; i += step) {
        if constexpr (std::is_same_v<T, float>) {
          fV a = fV::loadu(xr + i);
          acc = at::vec::fmadd(a, a, acc);
        } else {
          auto [a, b] = at::vec::convert_to_float<T>(tV::loadu(xr + i));
          acc = at::vec::fmadd(a, a, acc);
          acc = at::vec::fmadd(b, b, acc);
        }
      }
      float ss = at::vec::vec_reduce_all<float>([](fV& a, fV& b) { return a + b; }, acc);
      for (int64_t j = i; j < d; ++j) ss += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      const fV rv(rstd);
      i = 0;
      for (; i + step <= d; i += step) {
        if constexpr (std::is_same_v<T, float>) {
          fV a = fV::loadu(xr + i) * rv;
          (w1 ? a * fV::loadu(w1 + i) : a * fV::loadu(w + i)).store(o + i);
        } else {
          auto [a, b] = at::vec::convert_to_float<T>(tV::loadu(xr + i));
          a = a * rv;
          b = b * rv;
          if (w1) {
            a = a * fV::loadu(w1 + i);
            b = b * fV::loadu(w1 + i + fV::size());
          } else {  // round x * rstd to T first, as HF's `.to(dtype)` before the weight
            auto [ra, rb] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
            auto [wa, wb] = at::vec::convert_to_float<T>(tV::loadu(w + i));
            a = ra * wa;
            b = rb * wb;
          }
          at::vec::convert_from_float<T>(a, b).store(o + i);
        }
      }
      for (; i < d; ++i) {
        const float a = static_cast<float>(xr[i]) * rstd;
        o[i] = w1 ? static_cast<T>(a * w1[i])
                  : static_cast<T>(static_cast<float>(static_cast<T>(a)) * static_cast<float>(w[i]));
      }
    }
  });
}

// x [..., d] -> RMSNorm(x) [..., d]; `weight`: [d] in x's dtype (Llama) or float32 1 + w
// (Gemma 3, `one_plus`).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool one_plus) {
  TORCH_CHECK(x.size(-1) == weight.numel(), "rms_norm: weight is not [d]");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  if (rows == 0) return out;
  TORCH_CHECK(!one_plus || wc.scalar_type() == at::kFloat, "rms_norm: 1 + w is float32");
  TORCH_CHECK(one_plus || wc.scalar_type() == x.scalar_type(), "rms_norm: weight dtype");
  const float* w1 = one_plus ? wc.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    const auto* w = one_plus ? nullptr : wc.data_ptr<at::BFloat16>();
    rms_norm_rows<at::BFloat16>(xc.data_ptr<at::BFloat16>(), w, w1,
                                out.data_ptr<at::BFloat16>(), rows, d, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: bf16 or float32");
    const float* w = one_plus ? nullptr : wc.data_ptr<float>();
    rms_norm_rows<float>(xc.data_ptr<float>(), w, w1, out.data_ptr<float>(), rows, d,
                         static_cast<float>(eps));
  }
  return out;
}

}  // namespace pdserve
