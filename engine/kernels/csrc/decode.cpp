// Decode attention on the paged KV cache (no per-request contiguous mirror: each partition's
// pages pass through a small thread-local buffer), split into fixed key partitions
// (flash-decoding), batch-invariant by construction.
//
// One query row per request attends to its keys [lo, n) (lo > 0 only under a sliding window).
// The keys are cut into partitions of PART keys counted from position 0, whatever the batch
// or the thread count. Each (request, KV head, partition) is reduced in one fixed order on one
// thread, reading each K and V row once for all the query heads of its group (GQA); a second
// pass merges a row's partitions in partition order (log-sum-exp). So every reduction of a row
// runs in one order fixed by its own length: alone, in any batch, on any thread count, the
// same bits.
//
// Two forms (`form`), one per machine for every row, so invariance holds the same way in each:
// - float: both products in float32 (bf16 K and V widened), for any dtype;
// - dpbf16 (bf16 on a CPU with AVX512-BF16): the scores Q K^T on VDPBF16PS, 16 keys at a time,
//   each key's dot product reduced by one fixed transposing tree (`scores_dp`), the scale
//   applied to the float32 score; P V stays in float32. The scores were most of the float
//   form's time (a horizontal sum per key and head).
//
// The memory traffic: one task per (request, partition) first copies the partition's page
// runs (every KV head: whole contiguous rows) into a thread-local buffer, then reduces each
// head from it. A page's rows interleave the KV heads, so reading one head's rows in place
// touched short pieces at scattered addresses with a dependent chain of arithmetic between
// the loads, while the K/V of the step is DRAM-resident (the layer's weights streamed through
// the caches in between); the copy streams whole page runs with many loads in flight. The
// copy changes no value and no order of arithmetic.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "dpbf16.h"

namespace pdserve {

constexpr int64_t PART = 256;

template <typename T>
inline void to_float(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  using fV = at::vec::Vectorized<float>;
  using tV = at::vec::Vectorized<T>;
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, float>) {
    for (; i + tV::size() <= n; i += tV::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(tV::loadu(src + i));
      a.store(dst + i);
      b.store(dst + i + fV::size());
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// sum(a[i] * b[i]) in a fixed order: lane-wise over vectors, then a fixed lane tree.
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  using fV = at::vec::Vectorized<float>;
  fV acc(0.f);
  int64_t i = 0;
  for (; i + fV::size() <= n; i += fV::size()) {
    acc = at::vec::fmadd(fV::loadu(a + i), fV::loadu(b + i), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](fV& x, fV& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x[i] = exp(x[i] - shift), returning their sum (lane-wise, then a fixed lane tree)
inline float exp_shifted(float* __restrict__ x, float shift, int64_t n) {
  using fV = at::vec::Vectorized<float>;
  fV sum(0.f);
  const fV sh(shift);
  int64_t i = 0;
  for (; i + fV::size() <= n; i += fV::size()) {
    fV e = (fV::loadu(x + i) - sh).exp_u20();
    e.store(x + i);
    sum = sum + e;
  }
  float s = at::vec::vec_reduce_all<float>([](fV& a, fV& b) { return a + b; }, sum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// acc[i] += p * v[i]
inline void axpy(float* __restrict__ acc, float p, const float* __restrict__ v, int64_t n) {
  using fV = at::vec::Vectorized<float>;
  int64_t i = 0;
  const fV pv(p);
  for (; i + fV::size() <= n; i += fV::size())
    at::vec::fmadd(pv, fV::loadu(v + i), fV::loadu(acc + i)).store(acc + i);
  for (; i < n; ++i) acc[i] += p * v[i];
}

constexpr int64_t MAX_G = 8;  // GQA groups up to this take the register-blocked paths

// s[g * PART + t - start] = dot(q_g, k_t) for t in [start, end), g < G: the same arithmetic
// as `dot` (lane-wise fmadd over D in order, then the fixed lane tree), but four keys and all
// G heads in flight at once, so the FMA chains overlap instead of waiting on each other.
template <int G, typename T, typename RowOf>
inline void scores_g(const float* __restrict__ qf, const T* kp, RowOf row_of, int64_t start,
                     int64_t end, int64_t D, float* __restrict__ s) {
  using fV = at::vec::Vectorized<float>;
  constexpr int64_t KEYS = 4;
  const auto tree = [](fV& x, fV& y) { return x + y; };
  for (int64_t t = start; t < end; t += KEYS) {
    const int64_t kn = std::min(KEYS, end - t);
    const T* rows[KEYS];
    for (int64_t j = 0; j < KEYS; ++j) rows[j] = row_of(kp, t + std::min(j, kn - 1));
    fV acc[KEYS][G];
    for (int64_t j = 0; j < KEYS; ++j)
      for (int64_t g = 0; g < G; ++g) acc[j][g] = fV(0.f);
    for (int64_t d = 0; d < D; d += fV::size()) {
      fV k[KEYS];
      for (int64_t j = 0; j < KEYS; ++j) {
        if constexpr (std::is_same_v<T, float>) {
          k[j] = fV::loadu(rows[j] + d);
        } else {  // fV::size() elements of T, widened
          k[j] = std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(rows[j] + d, fV::size())));
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const fV q = fV::loadu(qf + g * D + d);
        for (int64_t j = 0; j < KEYS; ++j) acc[j][g] = at::vec::fmadd(q, k[j], acc[j][g]);
      }
    }
    for (int64_t j = 0; j < kn; ++j)
      for (int64_t g = 0; g < G; ++g)
        s[g * PART + (t + j - start)] = at::vec::vec_reduce_all<float>(tree, acc[j][g]);
  }
}

// out_g[:] += p_g[t] * v_t[:] for t in [start, end) in order, g < G: `axpy`'s arithmetic with
// each D slice's G accumulators held in registers across the keys (NS slices of 16 per pass:
// NS x G independent chains).
template <int G, int NS, typename T, typename RowOf>
inline void values_pass(const float* __restrict__ s, const T* vp, RowOf row_of, int64_t start,
                        int64_t end, int64_t D, int64_t d0, float* __restrict__ out) {
  using fV = at::vec::Vectorized<float>;
  fV acc[NS][G];
  for (int c = 0; c < NS; ++c)
    for (int g = 0; g < G; ++g) acc[c][g] = fV::loadu(out + g * D + d0 + c * fV::size());
  for (int64_t t = start; t < end; ++t) {
    const T* row = row_of(vp, t) + d0;
    for (int c = 0; c < NS; ++c) {
      fV v;
      if constexpr (std::is_same_v<T, float>) {
        v = fV::loadu(row + c * fV::size());
      } else {
        v = std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(row + c * fV::size(), fV::size())));
      }
      for (int g = 0; g < G; ++g)
        acc[c][g] = at::vec::fmadd(fV(s[g * PART + (t - start)]), v, acc[c][g]);
    }
  }
  for (int c = 0; c < NS; ++c)
    for (int g = 0; g < G; ++g) acc[c][g].store(out + g * D + d0 + c * fV::size());
}

template <int G, typename T, typename RowOf>
inline void values_g(const float* __restrict__ s, const T* vp, RowOf row_of, int64_t start,
                     int64_t end, int64_t D, float* __restrict__ out) {
  constexpr int64_t W = at::vec::Vectorized<float>::size();
  for (int64_t d0 = 0; d0 < D; d0 += 2 * W) {
    if (D - d0 >= 2 * W) {
      values_pass<G, 2, T>(s, vp, row_of, start, end, D, d0, out);
    } else {
      values_pass<G, 1, T>(s, vp, row_of, start, end, D, d0, out);
    }
  }
}

// The register-blocked paths take the GQA group size G as a compile-time constant (1 to MAX_G)
// so that their accumulators live in registers: with G a run-time value they lived on the
// stack, and each FMA waited on the store of the one before. The same arithmetic either way.
// `with_group(G, f)` calls f(std::integral_constant<int, G>{}).
template <typename F>
inline void with_group(int64_t G, F&& f) {
  switch (G) {
#define PDSERVE_G(n) case n: return f(std::integral_constant<int, n>{});
    PDSERVE_G(1) PDSERVE_G(2) PDSERVE_G(3) PDSERVE_G(4)
    PDSERVE_G(5) PDSERVE_G(6) PDSERVE_G(7) PDSERVE_G(8)
#undef PDSERVE_G
    default: TORCH_CHECK(false, "decode: a GQA group of ", G, " heads is over ", MAX_G);
  }
}

#if defined(__AVX512BF16__)
// s[g * PART + t - start] = scale * dot(q_g, k_t) for t in [start, end), g < G, on VDPBF16PS.
// Per head, 16 keys at a time: key j's products accumulate lane-wise in its own register, in
// k-pair order (D / 32 instructions), then one fixed tree sums each register's 16 lanes, all
// 16 registers together (4 levels of shuffles and adds), leaving key j's sum in lane j. A
// key's bits depend on its own row and q_g only (a short last group repeats its last row).
// D must be even (a last D % 32 elements are loaded masked).
template <typename RowOf>
inline void scores_dp(int64_t G, const c10::BFloat16* q, const c10::BFloat16* kp, RowOf row_of,
                      int64_t start, int64_t end, int64_t D, float scale, float* __restrict__ s) {
  constexpr int64_t KEYS = 16;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t = start; t < end; t += KEYS) {
    const int64_t kn = std::min(KEYS, end - t);
    // slot i holds key 4 * (i % 4) + i / 4: the tree below leaves slot i's sum in lane
    // 4 * (i % 4) + i / 4, so each key's sum lands in its own lane
    const c10::BFloat16* rows[KEYS];
    for (int64_t i = 0; i < KEYS; ++i)
      rows[i] = row_of(kp, t + std::min<int64_t>(4 * (i % 4) + i / 4, kn - 1));
    for (int64_t g = 0; g < G; ++g) {
      const c10::BFloat16* qg = q + g * D;
      __m512 a[KEYS];
      for (int64_t i = 0; i < KEYS; ++i) a[i] = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d);
        for (int64_t i = 0; i < KEYS; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_loadu_si512(rows[i] + d));
      }
      if (d < D) {  // the last D % 32 elements, the rest of the register zero (adds 0 exactly)
        const __mmask32 m = (__mmask32)((1ull << (D - d)) - 1);
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, qg + d);
        for (int64_t i = 0; i < KEYS; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, rows[i] + d));
      }
      __m512 b[8], c[4], e[2];
      for (int j = 0; j < 8; ++j)  // 128-bit blocks 0,1: slot 2j's halves summed; 2,3: 2j+1's
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
      for (int j = 0; j < 4; ++j)  // block k: slot 4j + k's four partial sums
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
      for (int j = 0; j < 2; ++j)  // block k: two partials of slot 8j + k, two of 8j + 4 + k
        e[j] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xDD));
      // block k, lane m: slot 4m + k's sum
      const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88),
                                     _mm512_shuffle_ps(e[0], e[1], 0xDD));
      _mm512_mask_storeu_ps(s + g * PART + (t - start), (__mmask16)((1u << kn) - 1),
                            _mm512_mul_ps(r, sc));
    }
  }
}
#endif

template <typename T>
at::Tensor paged_decode_impl(const at::Tensor& q, const at::Tensor& k_pages,
                             const at::Tensor& v_pages, const at::Tensor& tables,
                             const at::Tensor& lens, int64_t window, double scale, bool dp) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_pages.size(1), HKV = k_pages.size(2), G = H / HKV;
  const int64_t W = tables.size(1);
  auto out = at::empty({B, H * D}, q.options());
  auto qc = q.contiguous();
  auto tab = tables.to(at::kLong).contiguous();
  auto len = lens.to(at::kLong).contiguous();
  const T* qp = qc.data_ptr<T>();
  const T* kp = k_pages.data_ptr<T>();
  const T* vp = v_pages.data_ptr<T>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t page_stride = k_pages.stride(0), row_stride = k_pages.stride(1);
  TORCH_CHECK(k_pages.stride(2) == D && k_pages.stride(3) == 1, "pages: [NB, BS, Hkv, D] rows");
  TORCH_CHECK(v_pages.stride(0) == page_stride && v_pages.stride(1) == row_stride,
              "K and V pages share a layout");

  // partitions (b, part), counted from position 0; part_base[b]: b's first partition
  std::vector<int64_t> first_part(B), num_parts(B), part_base(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lp[b];
    TORCH_CHECK(n >= 1 && n <= W * BS, "decode: context length ", n, " outside the table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    first_part[b] = lo / PART;
    num_parts[b] = (n - 1) / PART + 1 - first_part[b];
    part_base[b + 1] = part_base[b] + num_parts[b];
  }
  const int64_t parts = part_base[B];
  const int64_t RW = HKV * D;  // a token's K (or V) row, every head, in the staging buffer
  // per (partition, query head): running max, sum of exponentials, unnormalised output
  std::vector<float> m(parts * H), l(parts * H), acc(parts * H * D);

  // each thread takes a run of partitions of about equal keys (a request's last partition
  // is often short: equal partition counts left one thread twice the other's work)
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), parts);
  std::vector<int64_t> cut(threads + 1, parts);
  {
    std::vector<int64_t> keys(parts + 1, 0);  // running sum of keys (+ a partition's fixed cost)
    for (int64_t b = 0, pi = 0; b < B; ++b) {
      const int64_t n = lp[b], lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      for (int64_t p = first_part[b]; p < first_part[b] + num_parts[b]; ++p, ++pi) {
        keys[pi + 1] = keys[pi] + std::min(n, (p + 1) * PART) - std::max(lo, p * PART) + 16;
      }
    }
    cut[0] = 0;
    for (int64_t i = 1; i < threads; ++i) {
      const int64_t at_key = keys[parts] * i / threads;
      cut[i] = std::lower_bound(keys.begin(), keys.end(), at_key) - keys.begin();
      cut[i] = std::max(cut[i - 1], std::min(cut[i], parts));
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t c0, int64_t c1) {
    using fV = at::vec::Vectorized<float>;
    const int64_t t0 = cut[c0], t1 = cut[c1];
    if (t0 >= t1) return;
    std::vector<float> qf(G * D), kf(D), vf(D), s(G * PART);
    std::unique_ptr<T[]> kbuf(new T[PART * RW]), vbuf(new T[PART * RW]);  // left uninitialised
    int64_t b = std::upper_bound(part_base.begin(), part_base.end(), t0) - part_base.begin() - 1;
    for (int64_t pi = t0; pi < t1; ++pi) {
      while (pi >= part_base[b + 1]) ++b;
      const int64_t part = first_part[b] + (pi - part_base[b]);
      const int64_t n = lp[b], lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t start = std::max(lo, part * PART), end = std::min(n, (part + 1) * PART);
      for (int64_t t = start; t < end;) {  // the partition's rows, page run by page run
        const int64_t off = t % BS, run = std::min(BS - off, end - t);
        const int64_t src = tp[b * W + t / BS] * page_stride + off * row_stride;
        // one copy per run where a page's rows are packed, else one per row
        const int64_t per_copy = row_stride == RW ? run : 1;
        for (int64_t r = 0; r < run; r += per_copy) {
          const int64_t dst = (t - start + r) * RW, bytes = per_copy * RW * sizeof(T);
          std::memcpy(kbuf.get() + dst, kp + src + r * row_stride, bytes);
          std::memcpy(vbuf.get() + dst, vp + src + r * row_stride, bytes);
        }
        t += run;
      }
      for (int64_t h = 0; h < HKV; ++h) {
        const T* kb = kbuf.get();
        const T* vb = vbuf.get();
        const auto row_of = [&](const T* base, int64_t t) { return base + (t - start) * RW + h * D; };
        const bool fast = G <= MAX_G && D % fV::size() == 0;
        if (dp) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            scores_dp(G, qp + (b * H + h * G) * D, kb, row_of, start, end, D,
                      static_cast<float>(scale), s.data());
          }
#endif
        } else {
          for (int64_t g = 0; g < G; ++g) {
            to_float<T>(qp + (b * H + h * G + g) * D, qf.data() + g * D, D);
            for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= static_cast<float>(scale);
          }
          if (fast) {
            with_group(G, [&](auto g) {
              scores_g<decltype(g)::value, T>(qf.data(), kb, row_of, start, end, D, s.data());
            });
          } else {
            for (int64_t t = start; t < end; ++t) {
              to_float<T>(row_of(kb, t), kf.data(), D);
              for (int64_t g = 0; g < G; ++g) {
                s[g * PART + (t - start)] = dot(qf.data() + g * D, kf.data(), D);
              }
            }
          }
        }
        float* mt = m.data() + pi * H + h * G;
        float* lt = l.data() + pi * H + h * G;
        float* at = acc.data() + (pi * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < end - start; ++t) mx = std::max(mx, s[g * PART + t]);
          mt[g] = mx;
          lt[g] = exp_shifted(s.data() + g * PART, mx, end - start);
          std::fill(at + g * D, at + (g + 1) * D, 0.f);
        }
        if (fast) {
          with_group(G, [&](auto g) {
            values_g<decltype(g)::value, T>(s.data(), vb, row_of, start, end, D, at);
          });
        } else {
          for (int64_t t = start; t < end; ++t) {
            to_float<T>(row_of(vb, t), vf.data(), D);
            for (int64_t g = 0; g < G; ++g) axpy(at + g * D, s[g * PART + (t - start)], vf.data(), D);
          }
        }
      }
    }
  });

  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * HKV, 0, [&](int64_t r0, int64_t r1) {
    std::vector<float> o(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / HKV, h = r % HKV, np = num_parts[b];
      const int64_t base = part_base[b];
      for (int64_t g = 0; g < G; ++g) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < np; ++p) mx = std::max(mx, m[(base + p) * H + h * G + g]);
        float sum = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t p = 0; p < np; ++p) {
          const float w = std::exp(m[(base + p) * H + h * G + g] - mx);
          sum += l[(base + p) * H + h * G + g] * w;
          axpy(o.data(), w, acc.data() + ((base + p) * H + h * G + g) * D, D);
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        store_row<T>(op + (b * H + h * G + g) * D, o.data(), nullptr, D);
      }
    }
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages,
                                  const at::Tensor& v_pages, const at::Tensor& tables,
                                  const at::Tensor& lens, int64_t window, double scale,
                                  int64_t form) {
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4, "decode: shapes");
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type(), "decode: q and the pages differ in dtype");
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "decode: query heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_pages.size(3), "decode: head_dim differs");
  TORCH_CHECK(form == 0 || form == 1, "decode: form 0 (float) or 1 (dpbf16)");
  const bool dp = form == 1;
  if (dp) {
    TORCH_CHECK(kDpBf16, "decode: dpbf16 needs the extension built for AVX512-BF16");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "decode: dpbf16 is for bf16");
    TORCH_CHECK(q.size(2) % 2 == 0, "decode: dpbf16 needs an even head_dim");
  }
  if (q.scalar_type() == at::kBFloat16)
    return paged_decode_impl<at::BFloat16>(q, k_pages, v_pages, tables, lens, window, scale, dp);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode: bf16 or float32");
  return paged_decode_impl<float>(q, k_pages, v_pages, tables, lens, window, scale, false);
}

}  // namespace pdserve
