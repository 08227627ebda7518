// A small GEMM on AVX512-BF16 dot products (VDPBF16PS), for the flash kernel's two products on
// CPUs whose torch brgemm has no bf16 (AVX512-BF16 without AMX). Built only where the compiler
// targets AVX512-BF16 (`-march=native` on such a CPU); `kDpBf16` says whether it was.
//
// C[m, n] = sum_k A[m, k] B[k, n] for m < M, n < N: A bf16 row-major (lda), B bf16 in VNNI
// pairs [K / 2][ldb][2] (brgemm's layout), C float32 row-major (ldc), overwritten. N is a
// multiple of 16 and K is even.
//
// What must hold (batch invariance): row m of C is computed from row m of A alone, one lane
// per column, over k in one fixed order (a pair per instruction), whatever M, N and the tile
// the row falls in: the same bits for a row alone or in any block of rows.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pdserve {

#if defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;

// One tile: MR rows x NV vectors of 16 columns, its accumulators in registers (MR x NV <= 24).
template <int MR, int NV>
inline void dp_tile(const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B, int64_t ldb,
                    float* C, int64_t ldc, int64_t K) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v)
      b[v] = (__m512bh)_mm512_loadu_si512(B + (k2 * ldb + 16 * v) * 2);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, A + m * lda + 2 * k2, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + 16 * v, acc[m][v]);
}

template <int NV>
inline void dp_panel(int64_t M, const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B,
                     int64_t ldb, float* C, int64_t ldc, int64_t K) {
  constexpr int MR = 6;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) dp_tile<MR, NV>(A + m * lda, lda, B, ldb, C + m * ldc, ldc, K);
  const auto a = A + m * lda;
  const auto c = C + m * ldc;
  switch (M - m) {
    case 5: dp_tile<5, NV>(a, lda, B, ldb, c, ldc, K); break;
    case 4: dp_tile<4, NV>(a, lda, B, ldb, c, ldc, K); break;
    case 3: dp_tile<3, NV>(a, lda, B, ldb, c, ldc, K); break;
    case 2: dp_tile<2, NV>(a, lda, B, ldb, c, ldc, K); break;
    case 1: dp_tile<1, NV>(a, lda, B, ldb, c, ldc, K); break;
    default: break;
  }
}

inline void dp_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                    const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t n = 0; n < N; n += 64) {
    const auto b = B + n * 2;
    const auto c = C + n;
    switch (std::min<int64_t>(4, (N - n) / 16)) {
      case 4: dp_panel<4>(M, A, lda, b, ldb, c, ldc, K); break;
      case 3: dp_panel<3>(M, A, lda, b, ldb, c, ldc, K); break;
      case 2: dp_panel<2>(M, A, lda, b, ldb, c, ldc, K); break;
      default: dp_panel<1>(M, A, lda, b, ldb, c, ldc, K); break;
    }
  }
}
#else
constexpr bool kDpBf16 = false;

inline void dp_gemm(int64_t, int64_t, int64_t, const c10::BFloat16*, int64_t,
                    const c10::BFloat16*, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "dpbf16: built without AVX512-BF16");
}
#endif

}  // namespace pdserve
