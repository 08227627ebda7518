// Batch-invariant linear layers on torch's brgemm (oneDNN's micro-kernel: AMX tiles where the
// CPU has them, AVX512-BF16 elsewhere).
//
// Why our own: oneDNN's matmul picks its kernel and its thread split from the row count M, so
// one row's float32 reduction order, and its rounded bf16 result, changes with the rows
// computed beside it (a batch, a chunk, a cached prefix's tail). Here every output tile
// [<= BLOCK_M rows, BLOCK_N cols] is one brgemm call over the whole K, the same call shape for
// every M, and threads split tiles, never K: a row's bits depend on that row alone.
//
// Weights are packed once: [N, K] -> ceil(N / BLOCK_N) panels of [K / 2, BLOCK_N, 2] (VNNI pairs),
// each contiguous so a panel stays in L2 while the thread walks all row blocks over it.
#include <ATen/Parallel.h>

#include "common.h"

namespace pdserve {

constexpr int64_t BLOCK_M = 32;
constexpr int64_t BLOCK_N = 64;
constexpr int64_t CHUNK_M = 256;  // rows of x kept in L2 across a thread's panels

bool brgemm_packs_bf16() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: a 2-d bf16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "pack: in features ", K, " not even");
  const int64_t nt = (N + BLOCK_N - 1) / BLOCK_N, padded = nt * BLOCK_N;
  // [K, N] with zero columns up to whole panels: the last panel's extra outputs are dropped
  auto wt = at::zeros({K, padded}, w.options());
  wt.narrow(1, 0, N).copy_(w.t());
  auto out = at::empty({nt, K * BLOCK_N}, w.options());
  at::parallel_for(0, nt, 0, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      at::native::cpublas::pack(K, BLOCK_N, padded, BLOCK_N, at::kBFloat16, at::kBFloat16,
                                wt.data_ptr<at::BFloat16>() + nb * BLOCK_N,
                                out.data_ptr<at::BFloat16>() + nb * K * BLOCK_N);
    }
  });
  return out;
}

// x [M, K] bf16 @ W^T (+ bias [N] float32) (+ residual [M, N]) -> [M, N] bf16.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear: x is [M, K] bf16");
  TORCH_CHECK(x.stride(1) == 1, "linear: x rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  const int64_t mt = (M + BLOCK_M - 1) / BLOCK_M, nt = (N + BLOCK_N - 1) / BLOCK_N;
  TORCH_CHECK(packed.numel() == nt * BLOCK_N * K, "linear: packed weight is not [", N, ", ", K,
              "]");
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* b = nullptr;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  const at::BFloat16* res = nullptr;
  at::Tensor res_c;
  if (residual.has_value() && residual->defined()) {
    res_c = residual->contiguous();
    TORCH_CHECK(res_c.size(0) == M && res_c.size(1) == N, "linear: residual is not [M, N]");
    res = res_c.data_ptr<at::BFloat16>();
  }
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Threads take whole weight panels (column blocks). Rows go in chunks of CHUNK_M: a chunk
  // of x stays in L2 while the thread walks its panels over it (all rows at once re-read x
  // from memory once per panel: 2.4 MB x 48 panels for a 2048-row MLP up-projection).
  at::parallel_for(0, nt, 0, [&](int64_t nb0, int64_t nb1) {
    alignas(64) float acc[BLOCK_M * BLOCK_N];
    for (int64_t mc = 0; mc < mt; mc += CHUNK_M / BLOCK_M) {
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const int64_t n0 = nb * BLOCK_N, cols = std::min(BLOCK_N, N - n0);
        for (int64_t mb = mc; mb < std::min(mt, mc + CHUNK_M / BLOCK_M); ++mb) {
          const int64_t m0 = mb * BLOCK_M, rows = std::min(BLOCK_M, M - m0);
          at::native::cpublas::brgemm(rows, BLOCK_N, K, lda, BLOCK_N, BLOCK_N, false,
                                      a + m0 * lda, w + nb * K * BLOCK_N, acc, true);
          for (int64_t r = 0; r < rows; ++r) {
            float* row = acc + r * BLOCK_N;
            if (b) {
              for (int64_t c = 0; c < cols; ++c) row[c] += b[n0 + c];
            }
            store_row<at::BFloat16>(o + (m0 + r) * N + n0, row,
                                    res ? res + (m0 + r) * N + n0 : nullptr, cols);
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

}  // namespace pdserve
