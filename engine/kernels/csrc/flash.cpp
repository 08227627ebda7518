// Flash attention over the paged KV cache on torch's brgemm, one code path for prompt chunks
// and decode rows, batch-invariant by construction.
//
// Each request r has query rows [q_starts[r], q_starts[r + 1]), its last positions: row i of
// a request with ctx_lens[r] = n and q_len = L sits at position n - L + i and sees keys
// (p - window, p] (all of [0, p] without one). Its keys are read from its block table.
//
// The keys are cut into parts of PART keys counted from position 0. A part's K (transposed)
// and V are gathered from the pages once per (request, KV head) and packed for brgemm (VNNI
// pairs in bf16); every block of query rows of that request reads the packed part. A task is
// (request, KV head, block of query rows); its A matrix holds the block's rows for all G query
// heads of the group, so a K/V part is read once for the group (GQA). Per part: scores =
// Q K^T (brgemm, float32), masked and scaled, a part-local softmax (max, exp, sum over the
// whole part in a fixed lane order, masked columns exactly 0), P V (brgemm over the part's
// keys, P rounded to the input dtype as flash attention does), then merged into the row's
// running (max, sum, output) in part order.
//
// Three forms (`form`), one per machine for every row, so invariance holds the same way in each:
// - brgemm: both products on torch's brgemm in the input dtype (bf16 where brgemm has it, AMX);
// - float products: bf16 K, V and query rows packed as float32, both products on brgemm in
//   float32 (P kept in float32); the output still rounded to bf16. For bf16 anywhere;
// - dpbf16: the bf16 packing of the brgemm form, both products on our own AVX512-BF16 dot
//   product tiles (`dpbf16.h`), for CPUs with AVX512-BF16 whose brgemm has no bf16.
//
// What must hold (batch invariance): a row's bits depend on its own query, position, window
// and keys only. The parts start at fixed absolute positions, brgemm computes a row of C from
// that row of A alone (the same bits for any M and tile position: `engine.kernels` probes it),
// and the softmax and merge are per row in part order. So a prompt row computes the same bits
// whole, after a cached prefix, in a 16-token chunk, beside other requests, and as a decode row
// (one query row per request): recompute after preemption reproduces the decoded tokens' K/V.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "dpbf16.h"

namespace pdserve {

constexpr int64_t PART = 256;  // keys per part
constexpr int64_t MAX_M = 96;  // A rows per brgemm call: query rows x the GQA group
constexpr int64_t COLS = 32;  // a part's columns are computed up to a multiple of this

// The part-local softmax of one row of raw scores x[0, cols): with mx = scale * max(x[lo, hi)),
// p[j] = exp(scale * x[j] - mx) for j in [lo, hi) and 0 elsewhere, stored in C (rounded for
// bf16); returns (mx, the sum of the float32 values), summed lane-wise over the columns in
// order, then a fixed lane tree (zeros add exactly: the sum depends on [lo, hi) only). One
// read of x: the max of scaled values is the scaled max (rounding is monotone, scale > 0).
template <typename C>
inline std::pair<float, float> softmax_part(const float* __restrict__ x, float scale,
                                            int64_t lo, int64_t hi, int64_t cols,
                                            C* __restrict__ p) {
  using fV = at::vec::Vectorized<float>;
  constexpr int64_t V = fV::size();
  static_assert(COLS % (2 * V) == 0 && PART % COLS == 0, "whole pairs of vectors");
  float raw = -std::numeric_limits<float>::infinity();
  int64_t j = lo;
  for (; j < hi && j % V; ++j) raw = std::max(raw, x[j]);
  fV vm(raw);
  for (; j + V <= hi; j += V) vm = at::vec::maximum(vm, fV::loadu(x + j));
  raw = at::vec::vec_reduce_all<float>([](fV& a, fV& b) { return at::vec::maximum(a, b); }, vm);
  for (; j < hi; ++j) raw = std::max(raw, x[j]);
  const float mx = raw * scale;
  const fV sv(scale), sh(mx), zero(0.f);
  fV sum(0.f);
  alignas(64) float edge[2 * V];
  for (j = 0; j < cols; j += 2 * V) {
    fV e0 = (fV::loadu(x + j) * sv - sh).exp_u20(), e1 = (fV::loadu(x + j + V) * sv - sh).exp_u20();
    if (j < lo || j + 2 * V > hi) {  // a vector pair on an edge of [lo, hi): zero the rest
      e0.store(edge);
      e1.store(edge + V);
      for (int64_t i = 0; i < 2 * V; ++i)
        if (j + i < lo || j + i >= hi) edge[i] = 0.f;
      e0 = fV::loadu(edge);
      e1 = fV::loadu(edge + V);
    }
    sum = sum + e0;
    sum = sum + e1;
    if constexpr (std::is_same_v<C, float>) {
      e0.store(p + j);
      e1.store(p + j + V);
    } else {
      at::vec::convert_from_float<C>(e0, e1).store(p + j);
    }
  }
  return {mx, at::vec::vec_reduce_all<float>([](fV& a, fV& b) { return a + b; }, sum)};
}

template <typename C, typename T>
inline C as(T x) {
  if constexpr (std::is_same_v<C, T>) {
    return x;
  } else {
    return C(static_cast<float>(x));
  }
}

// T: the inputs' and output's dtype; C: the products' inputs (T, or float32 for bf16 T);
// DP: the products on dpbf16 tiles instead of brgemm (T = C = bf16)
template <typename T, typename C, bool DP = false>
at::Tensor paged_flash_impl(const at::Tensor& q, const at::Tensor& k_pages,
                            const at::Tensor& v_pages, const at::Tensor& tables,
                            const at::Tensor& q_starts, const at::Tensor& ctx_lens,
                            int64_t window, double scale) {
  constexpr bool vnni = !std::is_same_v<C, float>;
  const int64_t TQ = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_pages.size(1), HKV = k_pages.size(2), G = H / HKV;
  const int64_t R = tables.size(0), W = tables.size(1);
  TORCH_CHECK(G <= MAX_M, "flash: a GQA group of ", G, " heads exceeds ", MAX_M);
  TORCH_CHECK(!vnni || D % 2 == 0, "flash: odd head_dim");
  TORCH_CHECK(!DP || D % 16 == 0, "flash dpbf16: head_dim ", D, " is not a multiple of 16");
  const int64_t QB = MAX_M / G;  // query rows per task
  auto out = at::empty({TQ, H * D}, q.options());
  if (TQ == 0) return out;
  auto qc = q.contiguous();
  auto tab = tables.to(at::kLong).contiguous();
  auto qst = q_starts.to(at::kLong).contiguous();
  auto len = ctx_lens.to(at::kLong).contiguous();
  const T* qp = qc.data_ptr<T>();
  const T* kp = k_pages.data_ptr<T>();
  const T* vp = v_pages.data_ptr<T>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* qs = qst.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t page_stride = k_pages.stride(0), row_stride = k_pages.stride(1);
  TORCH_CHECK(k_pages.stride(2) == D && k_pages.stride(3) == 1, "pages: [NB, BS, Hkv, D] rows");
  TORCH_CHECK(v_pages.stride(0) == page_stride && v_pages.stride(1) == row_stride,
              "K and V pages share a layout");
  TORCH_CHECK(qst.numel() == R + 1 && len.numel() == R && qs[0] == 0 && qs[R] == TQ,
              "flash: q_starts [R + 1] from 0 to the query rows, ctx_lens [R]");

  auto lo_of = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; };
  // per request: its packed parts [first_part, last part] and its tasks
  std::vector<int64_t> first_part(R), num_parts(R), pack_base(R + 1, 0), task_base(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lp[r], ql = qs[r + 1] - qs[r];
    TORCH_CHECK(ql >= 1 && ql <= n && n <= W * BS, "flash: request ", r, " has ", ql,
                " query rows and ", n, " keys (table of ", W * BS, ")");
    first_part[r] = lo_of(n - ql) / PART;
    num_parts[r] = (n - 1) / PART + 1 - first_part[r];
    pack_base[r + 1] = pack_base[r] + HKV * num_parts[r];
    task_base[r + 1] = task_base[r] + HKV * ((ql + QB - 1) / QB);
  }
  const int64_t units = pack_base[R], tasks = task_base[R], part_elems = PART * D;
  // every element is written by the packing below (zeros past the context): no fill first
  std::unique_ptr<C[]> kpk(new C[units * part_elems]), vpk(new C[units * part_elems]);
  auto request_of = [](const std::vector<int64_t>& base, int64_t i) {
    return std::upper_bound(base.begin(), base.end(), i) - base.begin() - 1;
  };

  // 1. gather and pack each (request, KV head, part): B of Q K^T is K^T [D, PART], B of P V
  // is V [PART, D]; in bf16 both in VNNI pairs ([K / 2, N, 2], brgemm's layout), in float32
  // row-major. Keys past the context are zeros (their scores are masked, their P is 0).
  at::parallel_for(0, units, 0, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = request_of(pack_base, u), local = u - pack_base[r];
      const int64_t h = local / num_parts[r], part = first_part[r] + local % num_parts[r];
      C* kd = kpk.get() + u * part_elems;
      C* vd = vpk.get() + u * part_elems;
      for (int64_t j = 0; j < PART; ++j) {
        const int64_t t = part * PART + j;
        const T* krow = nullptr;
        const T* vrow = nullptr;
        if (t < lp[r]) {
          const int64_t off = tp[r * W + t / BS] * page_stride + (t % BS) * row_stride + h * D;
          krow = kp + off;
          vrow = vp + off;
        }
        for (int64_t d = 0; d < D; ++d) {
          const C kx = krow ? as<C>(krow[d]) : C(0.f), vx = vrow ? as<C>(vrow[d]) : C(0.f);
          if constexpr (vnni) {
            kd[(d / 2) * PART * 2 + j * 2 + d % 2] = kx;
            vd[(j / 2) * D * 2 + d * 2 + j % 2] = vx;
          } else {
            kd[d * PART + j] = kx;
            vd[j * D + d] = vx;
          }
        }
      }
    }
  });

  // 2. tasks, the costliest (most parts) first, taken by whichever thread is free
  std::vector<int64_t> order(tasks), cost(tasks);
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r = request_of(task_base, t), ql = qs[r + 1] - qs[r];
    const int64_t blk = (t - task_base[r]) % ((ql + QB - 1) / QB);
    const int64_t p0 = lp[r] - ql + blk * QB, p1 = std::min(lp[r], p0 + QB) - 1;
    cost[t] = p1 / PART - lo_of(p0) / PART + 1;
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);

  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    using fV = at::vec::Vectorized<float>;
    std::vector<C> a(MAX_M * D), prob(MAX_M * PART);
    std::vector<float> s(MAX_M * PART), o(MAX_M * D), acc(MAX_M * D);
    std::vector<float> m_run(MAX_M), l_run(MAX_M), m_loc(MAX_M), l_loc(MAX_M);
    std::vector<int64_t> pos(MAX_M);
    std::vector<char> seen(MAX_M), live(MAX_M);
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t i; (i = next.fetch_add(1)) < tasks;) {
        const int64_t t = order[i], r = request_of(task_base, t);
        const int64_t n = lp[r], ql = qs[r + 1] - qs[r], nqb = (ql + QB - 1) / QB;
        const int64_t h = (t - task_base[r]) / nqb, blk = (t - task_base[r]) % nqb;
        const int64_t row0 = blk * QB, rows = std::min(QB, ql - row0), M = rows * G;
        for (int64_t i2 = 0; i2 < rows; ++i2) {
          const T* src = qp + ((qs[r] + row0 + i2) * H + h * G) * D;
          std::copy(src, src + G * D, a.data() + i2 * G * D);  // rows (query row, head)
          for (int64_t g = 0; g < G; ++g) pos[i2 * G + g] = n - ql + row0 + i2;
        }
        std::fill(seen.begin(), seen.begin() + M, 0);
        const int64_t part_lo = lo_of(pos[0]) / PART, part_hi = pos[M - 1] / PART;
        for (int64_t part = part_lo; part <= part_hi; ++part) {
          const int64_t u = pack_base[r] + h * num_parts[r] + (part - first_part[r]);
          // columns up to the block's last visible key, whole COLS: the rest is masked for
          // every row (P = 0 there, and a sum of exact zeros changes no bit of the result)
          const int64_t cols = std::min(PART, (pos[M - 1] + 1 - part * PART + COLS - 1) / COLS * COLS);
          if constexpr (DP) {
            dp_gemm(M, cols, D, a.data(), D, kpk.get() + u * part_elems, PART, s.data(), PART);
          } else {
            at::native::cpublas::brgemm(M, cols, D, D, PART, PART, false, a.data(),
                                        kpk.get() + u * part_elems, s.data(), vnni);
          }
          for (int64_t m = 0; m < M; ++m) {
            const float* row = s.data() + m * PART;
            const int64_t lo = std::max(lo_of(pos[m]), part * PART) - part * PART;
            const int64_t hi = std::min(pos[m] + 1, (part + 1) * PART) - part * PART;
            live[m] = hi > lo;
            if (!live[m]) {  // no key of this part is visible to the row: P row of zeros
              std::fill(prob.begin() + m * PART, prob.begin() + m * PART + cols, C(0.f));
              continue;
            }
            std::tie(m_loc[m], l_loc[m]) = softmax_part(row, sc, lo, hi, cols, prob.data() + m * PART);
          }
          if constexpr (DP) {
            dp_gemm(M, D, cols, prob.data(), PART, vpk.get() + u * part_elems, D, o.data(), D);
          } else {
            at::native::cpublas::brgemm(M, D, cols, PART, D, D, false, prob.data(),
                                        vpk.get() + u * part_elems, o.data(), vnni);
          }
          for (int64_t m = 0; m < M; ++m) {
            if (!live[m]) continue;
            float* ar = acc.data() + m * D;
            const float* orow = o.data() + m * D;
            if (!seen[m]) {
              seen[m] = 1;
              m_run[m] = m_loc[m];
              l_run[m] = l_loc[m];
              std::copy(orow, orow + D, ar);
              continue;
            }
            const float mn = std::max(m_run[m], m_loc[m]);
            const float ea = std::exp(m_run[m] - mn), eb = std::exp(m_loc[m] - mn);
            l_run[m] = l_run[m] * ea + l_loc[m] * eb;
            m_run[m] = mn;
            const fV va(ea), vb(eb);
            int64_t d = 0;
            for (; d + fV::size() <= D; d += fV::size())
              (fV::loadu(ar + d) * va + fV::loadu(orow + d) * vb).store(ar + d);
            for (; d < D; ++d) ar[d] = ar[d] * ea + orow[d] * eb;
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          float* ar = acc.data() + m * D;
          const float inv = 1.f / l_run[m];
          for (int64_t d = 0; d < D; ++d) ar[d] *= inv;
          const int64_t row = qs[r] + row0 + m / G, head = h * G + m % G;
          store_row<T>(op + (row * H + head) * D, ar, nullptr, D);
        }
      }
    }
    if constexpr (!DP) at::native::cpublas::brgemm_release(vnni);
  });
  return out;
}

at::Tensor paged_flash_attention(const at::Tensor& q, const at::Tensor& k_pages,
                                 const at::Tensor& v_pages, const at::Tensor& tables,
                                 const at::Tensor& q_starts, const at::Tensor& ctx_lens,
                                 int64_t window, double scale, int64_t form) {
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4, "flash: shapes");
  TORCH_CHECK(tables.dim() == 2, "flash: block tables are [R, W]");
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() &&
                  q.scalar_type() == v_pages.scalar_type(),
              "flash: q and the pages differ in dtype");
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "flash: query heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_pages.size(3), "flash: head_dim differs");
  TORCH_CHECK(scale > 0, "flash: scale must be positive");
  TORCH_CHECK(form >= 0 && form <= 2, "flash: form 0 (brgemm), 1 (float products), 2 (dpbf16)");
  if (q.scalar_type() == at::kBFloat16 && form == 2) {
    TORCH_CHECK(kDpBf16, "flash dpbf16: built without AVX512-BF16");
    return paged_flash_impl<at::BFloat16, at::BFloat16, true>(q, k_pages, v_pages, tables,
                                                              q_starts, ctx_lens, window, scale);
  }
  if (q.scalar_type() == at::kBFloat16 && form == 1)
    return paged_flash_impl<at::BFloat16, float>(q, k_pages, v_pages, tables, q_starts,
                                                 ctx_lens, window, scale);
  if (q.scalar_type() == at::kBFloat16)
    return paged_flash_impl<at::BFloat16, at::BFloat16>(q, k_pages, v_pages, tables, q_starts,
                                                        ctx_lens, window, scale);
  TORCH_CHECK(q.scalar_type() == at::kFloat && form == 0, "flash: bf16, or float32 on brgemm");
  return paged_flash_impl<float, float>(q, k_pages, v_pages, tables, q_starts, ctx_lens,
                                        window, scale);
}

bool has_dpbf16() { return kDpBf16; }

}  // namespace pdserve
