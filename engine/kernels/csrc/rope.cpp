// RoPE fused with the K/V cache write: one pass rotates a step's query and key heads and
// stores the rotated K and the V rows at their cache slots (torch's form: a roll, three
// elementwise ops and two index copies, each a dispatch and a pass).
//
// Rounding follows `engine.rope.Rotary.rotate` exactly, so the fused and unfused forms give
// the same bits: out = round(round(x * cos) + round(roll(x, D/2) * sin_signed)), each product
// and the sum rounded to the dtype as torch's bf16 ops round them (float32 arithmetic, one
// rounding per op). Rows are independent: a row's bits depend on that row alone.
#include <ATen/Parallel.h>

#include "common.h"

namespace pdserve {

// o[j] = round(round(x[j] * c[j]) + round(xs[j] * s[j])) for j < n (xs: x rolled by D/2)
template <typename T>
inline void rotate_span(const T* __restrict__ x, const T* __restrict__ xs, const T* __restrict__ c,
                        const T* __restrict__ s, T* __restrict__ o, int64_t n) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using fV = at::vec::Vectorized<float>;
    for (; j + fV::size() <= n; j += fV::size()) {
      fV a = fV::loadu(x + j) * fV::loadu(c + j);
      fV b = fV::loadu(xs + j) * fV::loadu(s + j);
      (a + b).store(o + j);
    }
  } else {
    using tV = at::vec::Vectorized<T>;
    auto round = [](at::vec::Vectorized<float> p, at::vec::Vectorized<float> q) {
      return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(p, q));
    };
    for (; j + tV::size() <= n; j += tV::size()) {
      auto [x0, x1] = at::vec::convert_to_float<T>(tV::loadu(x + j));
      auto [c0, c1] = at::vec::convert_to_float<T>(tV::loadu(c + j));
      auto [y0, y1] = at::vec::convert_to_float<T>(tV::loadu(xs + j));
      auto [s0, s1] = at::vec::convert_to_float<T>(tV::loadu(s + j));
      auto [a0, a1] = round(x0 * c0, x1 * c1);
      auto [b0, b1] = round(y0 * s0, y1 * s1);
      at::vec::convert_from_float<T>(a0 + b0, a1 + b1).store(o + j);
    }
  }
  for (; j < n; ++j) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j])));
    const float b = static_cast<float>(static_cast<T>(static_cast<float>(xs[j]) * static_cast<float>(s[j])));
    o[j] = static_cast<T>(a + b);
  }
}

template <typename T>
void rope_write_impl(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin_signed, const at::Tensor& k_slots,
                     const at::Tensor& v_slots, const at::Tensor& slots, int64_t kv_heads,
                     at::Tensor& out) {
  const int64_t T_ = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t q_heads = heads - kv_heads;
  const T* x = qk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin_signed.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  T* kc = k_slots.data_ptr<T>();
  T* vc = v_slots.data_ptr<T>();
  const int64_t xs0 = qk.stride(0), xs1 = qk.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t cs0 = cos.stride(0), ss0 = sin_signed.stride(0);
  const int64_t slot_stride = k_slots.stride(0);
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* ct = c + t * cs0;
      const T* st = s + t * ss0;
      const int64_t slot = sl[t];
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * xs0 + h * xs1;
        T* orow = o + (t * heads + h) * D;
        rotate_span<T>(xr, xr + half, ct, st, orow, half);  // roll(x, D/2): x2 before x1
        rotate_span<T>(xr + half, xr, ct + half, st + half, orow + half, half);
        if (h >= q_heads) {  // a key head: its rotated row goes to the cache as well
          std::copy(orow, orow + D, kc + slot * slot_stride + (h - q_heads) * D);
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* vr = vp + t * vs0 + h * vs1;
        std::copy(vr, vr + D, vc + slot * slot_stride + h * D);
      }
    }
  });
}

// qk [T, H + Hkv, D] (rows may be strided, the last dim contiguous), v [T, Hkv, D] likewise,
// cos / sin_signed [T, (1,) D] -> rotated qk [T, H + Hkv, D], contiguous; the rotated key
// heads and v are stored at `slots` [T] of k_slots / v_slots [num_slots, Hkv, D].
at::Tensor rope_write(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin_signed, const at::Tensor& k_slots,
                      const at::Tensor& v_slots, const at::Tensor& slots) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && qk.stride(2) == 1 && v.stride(2) == 1,
              "rope_write: qk [T, H + Hkv, D], v [T, Hkv, D], rows contiguous in D");
  const int64_t T_ = qk.size(0), D = qk.size(2), kv_heads = v.size(1);
  TORCH_CHECK(D % 2 == 0 && v.size(0) == T_ && v.size(2) == D, "rope_write: shapes");
  TORCH_CHECK(k_slots.is_contiguous() || (k_slots.stride(2) == 1 && k_slots.stride(1) == D),
              "rope_write: cache rows [Hkv, D] contiguous");
  TORCH_CHECK(v_slots.stride(0) == k_slots.stride(0) && v_slots.stride(1) == D,
              "rope_write: K and V slots share a layout");
  auto c2 = cos.reshape({T_, D});
  auto s2 = sin_signed.reshape({T_, D});
  TORCH_CHECK(c2.stride(1) == 1 && s2.stride(1) == 1, "rope_write: tables contiguous in D");
  auto sl = slots.to(at::kLong).contiguous();
  auto out = at::empty({T_, qk.size(1), D}, qk.options());
  if (T_ == 0) return out;
  if (qk.scalar_type() == at::kBFloat16) {
    rope_write_impl<at::BFloat16>(qk, v, c2, s2, k_slots, v_slots, sl, kv_heads, out);
  } else {
    TORCH_CHECK(qk.scalar_type() == at::kFloat, "rope_write: bf16 or float32");
    rope_write_impl<float>(qk, v, c2, s2, k_slots, v_slots, sl, kv_heads, out);
  }
  return out;
}

}  // namespace pdserve
