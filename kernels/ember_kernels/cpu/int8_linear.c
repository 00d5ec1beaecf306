/* Weight-only int8 linear on CPU: y[M, N] = x[M, K] @ (w[N, K] * scale[N]).T, computed in float32.
 *
 * Decode is bound by reading weights: this streams each int8 weight row from memory and widens it
 * to float32 in registers, so it moves a quarter of the bytes of an fp32 GEMV (torch's
 * _weight_int8pack_mm reached ~2 GB/s on an AVX2 CPU, this ~6-9 GB/s, the machine's bandwidth).
 *
 * Work: output rows in blocks of NB, spread over OpenMP threads; within a block, activation rows in
 * groups of up to MG, so a block's weights (NB x K bytes) stay in L1/L2 while every group uses them.
 * Every (m, n) is the same sequence of float operations whatever M and the grouping are, so a row's
 * result never depends on the rows batched with it (batching and speculation leave greedy output alone).
 *
 * Layouts (row-major, contiguous): x [M, K] float32 or bfloat16, w [N, K] int8, scale [N] float32,
 * y [M, N] float32 or bfloat16. bf16 activations are widened once (exact) and bf16 outputs rounded
 * from the float32 result, as x.float() before and y.to(bfloat16) after would: the same numbers, two
 * torch ops fewer per linear (they cost about as much as a small layer's weights at decode).
 * Returns 0, 1 for bad sizes, or 2 if memory for widening x ran out.
 */
#include <stdint.h>
#include <stdlib.h>

#define NB 16 /* output rows per work item */
#define MG 4  /* activation rows per pass over a weight row: 4 accumulators + 4 widened weights fit in registers */

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)

static inline __m256 widen8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* Dot products of one weight row with `mg` (<= MG, a compile-time constant after inlining) rows of x. */
static inline __attribute__((always_inline)) void row_dots(const float *x, const int8_t *w, int64_t K,
                                                           const int mg, float *out) {
    __m256 acc[MG];
    for (int m = 0; m < mg; m++) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 w0 = widen8(w + k), w1 = widen8(w + k + 8), w2 = widen8(w + k + 16), w3 = widen8(w + k + 24);
        for (int m = 0; m < mg; m++) {
            const float *xm = x + m * K + k;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xm), w0);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w1, a);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w2, a);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w3, a);
            acc[m] = _mm256_add_ps(acc[m], a);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = widen8(w + k);
        for (int m = 0; m < mg; m++) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m]);
    }
    for (int m = 0; m < mg; m++) {
        float s = hsum(acc[m]);
        for (int64_t j = k; j < K; j++) s += x[m * K + j] * (float)w[j];
        out[m] = s;
    }
}
#else
static inline void row_dots(const float *x, const int8_t *w, int64_t K, const int mg, float *out) {
    for (int m = 0; m < mg; m++) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += x[m * K + k] * (float)w[k];
        out[m] = s;
    }
}
#endif

static void block(const float *x, const int8_t *w, const float *scale, void *y, int y_bf16, int64_t M,
                  int64_t N, int64_t K, int64_t n0, int64_t n1) {
    float dots[MG];
    for (int64_t m0 = 0; m0 < M; m0 += MG) {
        int64_t mg = M - m0 < MG ? M - m0 : MG;
        const float *xg = x + m0 * K;
        for (int64_t n = n0; n < n1; n++) {
            switch (mg) { /* constant group sizes, so the accumulators stay in registers */
                case 4: row_dots(xg, w + n * K, K, 4, dots); break;
                case 3: row_dots(xg, w + n * K, K, 3, dots); break;
                case 2: row_dots(xg, w + n * K, K, 2, dots); break;
                default: row_dots(xg, w + n * K, K, 1, dots); break;
            }
            for (int64_t m = 0; m < mg; m++) store_from_f32(y, (m0 + m) * N + n, dots[m] * scale[n], y_bf16);
        }
    }
}

int ember_int8_linear(const void *x, int x_bf16, const int8_t *w, const float *scale, void *y, int y_bf16,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    float *widened = NULL;
    if (x_bf16) {
        widened = malloc(sizeof(float) * (size_t)(M * K));
        if (!widened) return 2;
        for (int64_t i = 0; i < M * K; i++) widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const float *xf = x_bf16 ? widened : (const float *)x;
    int64_t num_blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * NB, n1 = n0 + NB < N ? n0 + NB : N;
        block(xf, w, scale, y, y_bf16, M, N, K, n0, n1);
    }
    free(widened);
    return 0;
}
