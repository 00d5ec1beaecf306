/* The online rotation of `rotation` (QuaRot-style) applied to activations: y = x Q, Q = diag(s) (R_m kron H_p),
 * H_p the normalized Sylvester Hadamard matrix (p a power of two), R_m a small orthogonal matrix (m odd, 1 when n
 * is a power of two). See ember_plugins/quantization/hadamard.py for why Q has this shape.
 *
 * Why a kernel: the torch formula multiplies each [m, p] row block by a dense H_p (n * p multiply-adds per row,
 * in float32, plus two dtype conversions), which on llama-150m's down_proj input (n = 2816 = 11 * 256) cost a
 * third of what the int4 down_proj itself does. A fast Walsh-Hadamard transform needs n * log2(p) additions.
 *
 * Per row, in float32 (what the torch path computes in): v = x * s viewed as [m, p]; each of the m blocks
 * transformed by H_p unnormalized (log2 p butterfly stages: the first three inside AVX2 registers, then two per
 * pass over the block); then R_m^T v (rt: R_m^T, row major) accumulated in registers with the 1/sqrt(p) scale,
 * and the store in x's dtype (bf16 rounded to nearest even). The result equals the torch path's
 * up to float32 summation order (a few ulp of float32, far below bf16's rounding).
 *
 * dtype: 0 = float32, 1 = bfloat16. Returns 0, or 1 for sizes it does not take (the caller runs torch then).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_N (1 << 16)
#define MAX_M 64

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD 1
#else
#define SIMD 0
#endif

/* Butterfly stages h, h * 2, ... up to p of an unnormalized Walsh-Hadamard transform of v [p], from stage
 * `from` on (the stages commute: H_p is a Kronecker power of H_2, so any order gives the transform). Two stages
 * per pass where two are left (radix 4: half the passes over the row). */
static void butterflies(float *v, int64_t p, int64_t from) {
    int64_t h = from;
    for (; h * 4 <= p; h *= 4) {
        for (int64_t i = 0; i < p; i += 4 * h) {
            float *a = v + i, *b = a + h, *c = b + h, *d = c + h;
#if SIMD
            if (h % 8 == 0) {
                for (int64_t j = 0; j < h; j += 8) {
                    const __m256 va = _mm256_loadu_ps(a + j), vb = _mm256_loadu_ps(b + j);
                    const __m256 vc = _mm256_loadu_ps(c + j), vd = _mm256_loadu_ps(d + j);
                    const __m256 s0 = _mm256_add_ps(va, vb), d0 = _mm256_sub_ps(va, vb);
                    const __m256 s1 = _mm256_add_ps(vc, vd), d1 = _mm256_sub_ps(vc, vd);
                    _mm256_storeu_ps(a + j, _mm256_add_ps(s0, s1));
                    _mm256_storeu_ps(b + j, _mm256_add_ps(d0, d1));
                    _mm256_storeu_ps(c + j, _mm256_sub_ps(s0, s1));
                    _mm256_storeu_ps(d + j, _mm256_sub_ps(d0, d1));
                }
                continue;
            }
#endif
            for (int64_t j = 0; j < h; j++) {
                const float s0 = a[j] + b[j], d0 = a[j] - b[j], s1 = c[j] + d[j], d1 = c[j] - d[j];
                a[j] = s0 + s1, b[j] = d0 + d1, c[j] = s0 - s1, d[j] = d0 - d1;
            }
        }
    }
    for (; h < p; h *= 2) {
        for (int64_t i = 0; i < p; i += 2 * h) {
            float *a = v + i, *b = a + h;
            for (int64_t j = 0; j < h; j++) {
                const float u = a[j], w = b[j];
                a[j] = u + w, b[j] = u - w;
            }
        }
    }
}

#if SIMD
/* The stages h = 1, 2, 4 inside one vector of 8: lanes whose h-bit is set get partner - self, the others
 * self + partner. */
static inline __m256 wht8(__m256 v) {
    __m256 t = _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1));
    v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xAA);
    t = _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2));
    v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xCC);
    t = _mm256_permute2f128_ps(v, v, 1);
    return _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xF0);
}
#endif

static void rotate_row(const void *x, void *out, const float *signs, const float *rt, int64_t m, int64_t p,
                       int bf16, float *v) {
    const int64_t n = m * p;
    const float scale = 1.0f / sqrtf((float)p);
#if SIMD
    if (p % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8)  /* signs, then the first three stages in registers */
            _mm256_storeu_ps(v + i, wht8(_mm256_mul_ps(load8_as_f32(x, i, bf16), _mm256_loadu_ps(signs + i))));
        for (int64_t b = 0; b < m; b++) butterflies(v + b * p, p, 8);
        const __m256 vscale = _mm256_set1_ps(scale);
        for (int64_t b = 0; b < m; b++) {  /* block b of R^T v (or v itself), scaled, in one pass per block */
            for (int64_t j = 0; j < p; j += 8) {
                __m256 acc;
                if (rt == NULL) {
                    acc = _mm256_loadu_ps(v + b * p + j);
                } else {
                    acc = _mm256_setzero_ps();
                    for (int64_t c = 0; c < m; c++)
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(rt[b * m + c]), _mm256_loadu_ps(v + c * p + j), acc);
                }
                store8(out, b * p + j, _mm256_mul_ps(acc, vscale), bf16);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) v[i] = load_as_f32(x, i, bf16) * signs[i];
    for (int64_t b = 0; b < m; b++) butterflies(v + b * p, p, 1);
    for (int64_t b = 0; b < m; b++) {
        for (int64_t j = 0; j < p; j++) {
            float acc = 0.0f;
            if (rt == NULL) {
                acc = v[b * p + j];
            } else {
                for (int64_t c = 0; c < m; c++) acc += rt[b * m + c] * v[c * p + j];
            }
            store_from_f32(out, b * p + j, acc * scale, bf16);
        }
    }
}

/* out [rows, m * p] = x [rows, m * p] Q. signs float32 [m * p] (+-1); rt float32 [m, m] or NULL when m == 1. */
int ember_hadamard_rotate(const void *x, void *out, const float *signs, const float *rt, int64_t rows, int64_t m,
                          int64_t p, int dtype, int num_threads) {
    if (rows < 0 || m < 1 || m > MAX_M || p < 1 || (p & (p - 1)) || m * p > MAX_N || (dtype != 0 && dtype != 1)
        || (m > 1 && rt == NULL))
        return 1;
    const int bf16 = dtype == 1, esize = bf16 ? 2 : 4;
    const int64_t n = m * p;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows > 1 && rows * n >= (1 << 15))
    {
        float *v = malloc(sizeof(float) * (size_t)n);
        if (v == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (v != NULL)
                rotate_row((const char *)x + r * n * esize, (char *)out + r * n * esize, signs, rt, m, p, bf16, v);
        }
        free(v);
    }
    return failed;
}
