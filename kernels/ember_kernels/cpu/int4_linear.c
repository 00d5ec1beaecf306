/* Group-wise int4 linear on CPU: y[M, N] = x[M, K] @ W.T with W[n, k] = s[n, g] * (q[n, k] - z[n, g]),
 * g = k / G, q and z in 0..15.
 *
 * Decode is bound by reading weights, and at half a byte per weight the widening to float32 that the
 * int8 kernel does per weight would cost more than the bytes it reads. So the activations are quantized
 * too, to int8, symmetric, one scale per row and per group of G inputs (dynamic, from the row's own
 * values: a row's result never depends on the rows batched with it), and each group's dot product is
 * exact integer arithmetic, 64 multiply-adds per vpdpbusd (u8 weights x s8 activations into int32):
 *
 *     y[m, n] = sum_g s[n, g] * xs[m, g] * (sum_k q[n, k] xq[m, k]  -  z[n, g] * sum_k xq[m, k])
 *
 * computed as  sum_g (acc * (s xs)) - (s z) * (xs sum xq)  in float32, groups in order. Every (m, n) is
 * the same sequence of operations whatever M and the tiling: batching and speculation leave results alone.
 *
 * Weight layout (`ember_int4_pack` writes it from values [N, K]): output rows in blocks of 16 (N padded
 * with zero rows); per block, per 8 inputs k = 8j..8j+7, 64 bytes: 4 bytes per row of the block (one
 * 32-bit lane each), byte i holding q[n, 8j + i] in its low nibble and q[n, 8j + 4 + i] in its high one.
 * So one 64-byte load, two masks and two vpdpbusd (activation bytes broadcast) advance 16 rows by 8
 * inputs, with no horizontal sums. Scales: sc[block][g][16] = s and sz[block][g][16] = s * z, float32.
 * K is padded to groups * G (the last group may be shorter than G: its padding activations are zero).
 *
 * Paths: AVX-512 VNNI; AVX2 (vpmaddubsw + vpmaddwd, same integer results); portable C.
 * Returns 0, 1 for bad sizes, 2 if memory for the quantized activations ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define RB 16 /* output rows per block: one 32-bit lane each in a 512-bit register */
#define MT 4  /* activation rows per pass over a block's weights */
#define XQ_BLOCK_BYTES (512 * 1024) /* quantized activations per block of rows: half a 1 MB L2 */

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* 16 inputs from k (n of them, the rest zero) as float32. */
static inline __m512 load16(const void *x, int x_bf16, int64_t k, int n) {
    const __mmask16 mask = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1);
    if (!x_bf16) return _mm512_maskz_loadu_ps(mask, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* One group of one row: the scalar loop's numbers exactly (the same float32 products, rounding to nearest even,
 * integer sums), 16 inputs at a time where AVX-512 is there: scalar, quantizing was ~10% of a prefill call. */
static void quantize_group(const void *x, int x_bf16, int64_t at, int64_t n, int64_t G, int8_t *row, float *xs,
                           float *xsum) {
#if defined(__AVX512F__)
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) /* max(v, acc): a NaN input leaves acc, as the scalar comparison did */
        vmax = _mm512_max_ps(_mm512_and_ps(load16(x, x_bf16, at + k, (int)(n - k)), magnitude), vmax);
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i total = _mm512_setzero_si512();
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int64_t k = 0; k < n; k += 16) {
        const int count = n - k < 16 ? (int)(n - k) : 16;
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x, x_bf16, at + k, count), vinv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_max_ps(_mm512_min_ps(r, hi), lo);
        const __m512i q = _mm512_cvtps_epi32(r);
        total = _mm512_add_epi32(total, q); /* lanes past n are zero */
        _mm512_mask_cvtepi32_storeu_epi8(row + k, (__mmask16)(count == 16 ? 0xFFFF : (1u << count) - 1), q);
    }
    const int32_t sum = _mm512_reduce_add_epi32(total);
#else
    float amax = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        const float v = fabsf(load_as_f32(x, at + k, x_bf16));
        amax = v > amax ? v : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t k = 0; k < n; k++) {
        float r = nearbyintf(load_as_f32(x, at + k, x_bf16) * inv);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        row[k] = (int8_t)r;
        sum += (int32_t)r;
    }
#endif
    for (int64_t k = n; k < G; k++) row[k] = 0;
    const float scale = amax / 127.0f;
    *xs = scale;
    *xsum = scale * (float)sum;
}

/* Quantize x's rows per group: xq [M, Kp] int8 (zero padding), xs [M, groups] scales, xsum [M, groups]
 * = xs * sum(xq) (the dequantized group sum the zero points multiply). */
static void quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t G, int64_t groups,
                          int8_t *xq, float *xs, float *xsum) {
    const int64_t Kp = groups * G;
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
            quantize_group(x, x_bf16, m * K + k0, k1 - k0, G, xq + m * Kp + k0, xs + m * groups + g,
                           xsum + m * groups + g);
        }
    }
}

/* Integer dot products of one block (16 rows) with `mt` activation rows over one group: acc[m] lanes. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void block_group(const uint8_t *w, const int8_t *xq, int64_t Kp,
                                                              int64_t steps, const int mt, __m512i *acc) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_si512();
    for (int64_t j = 0; j < steps; j++) {
        const __m512i packed = _mm512_loadu_si512((const void *)(w + 64 * j));
        const __m512i lo = _mm512_and_si512(packed, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        for (int m = 0; m < mt; m++) {
            const int8_t *xm = xq + m * Kp + 8 * j;
            int32_t a, b;
            memcpy(&a, xm, 4);
            memcpy(&b, xm + 4, 4);
            acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(a));
            acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_set1_epi32(b));
        }
    }
}

static inline __attribute__((always_inline)) void block_rows(const uint8_t *w, const float *sc, const float *sz,
                                                             const int8_t *xq, const float *xs, const float *xsum,
                                                             int64_t Kp, int64_t G, int64_t groups, const int mt,
                                                             float *out /* [mt][16] */) {
    __m512 total[MT];
    __m512i acc[MT];
    for (int m = 0; m < mt; m++) total[m] = _mm512_setzero_ps();
    const int64_t steps = G / 8;
    for (int64_t g = 0; g < groups; g++) {
        block_group(w + g * steps * 64, xq + g * G, Kp, steps, mt, acc);
        const __m512 s = _mm512_loadu_ps(sc + g * RB), z = _mm512_loadu_ps(sz + g * RB);
        for (int m = 0; m < mt; m++) {
            const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(xs[m * groups + g]));
            total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), scale, total[m]);
            total[m] = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[m * groups + g]), total[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out + m * RB, total[m]);
}
#elif defined(__AVX2__)
/* AVX2: each 16-row block is two 256-bit halves (rows 0-7, 8-15). vpmaddubsw sums two u8 x s8 products
 * into int16 (at most 2 * 15 * 127: no saturation), vpmaddwd with ones sums pairs into int32. */
static inline __m256i dot4(__m256i w, int32_t x) {
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void block_rows(const uint8_t *w, const float *sc, const float *sz,
                                                             const int8_t *xq, const float *xs, const float *xsum,
                                                             int64_t Kp, int64_t G, int64_t groups, const int mt,
                                                             float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 total[MT][2];
    for (int m = 0; m < mt; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    const int64_t steps = G / 8;
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[MT][2];
        for (int m = 0; m < mt; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        const uint8_t *wg = w + g * steps * 64;
        for (int64_t j = 0; j < steps; j++) {
            for (int h = 0; h < 2; h++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(wg + 64 * j + 32 * h));
                const __m256i lo = _mm256_and_si256(packed, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                for (int m = 0; m < mt; m++) {
                    const int8_t *xm = xq + m * Kp + g * G + 8 * j;
                    int32_t a, b;
                    memcpy(&a, xm, 4);
                    memcpy(&b, xm + 4, 4);
                    acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_add_epi32(dot4(lo, a), dot4(hi, b)));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_loadu_ps(sc + g * RB + 8 * h), z = _mm256_loadu_ps(sz + g * RB + 8 * h);
            for (int m = 0; m < mt; m++) {
                const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xs[m * groups + g]));
                total[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), scale, total[m][h]);
                total[m][h] = _mm256_fnmadd_ps(z, _mm256_set1_ps(xsum[m * groups + g]), total[m][h]);
            }
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm256_storeu_ps(out + m * RB, total[m][0]);
        _mm256_storeu_ps(out + m * RB + 8, total[m][1]);
    }
}
#else
static void block_rows(const uint8_t *w, const float *sc, const float *sz, const int8_t *xq, const float *xs,
                       const float *xsum, int64_t Kp, int64_t G, int64_t groups, const int mt, float *out) {
    const int64_t steps = G / 8;
    for (int m = 0; m < mt; m++) {
        for (int r = 0; r < RB; r++) {
            float total = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t acc = 0;
                for (int64_t j = 0; j < steps; j++) {
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = w[(g * steps + j) * 64 + 4 * r + i];
                        const int8_t *xm = xq + m * Kp + g * G + 8 * j;
                        acc += (int32_t)(byte & 0x0F) * xm[i] + (int32_t)(byte >> 4) * xm[4 + i];
                    }
                }
                const float scale = sc[g * RB + r] * xs[m * groups + g];
                total = fmaf((float)acc, scale, total);
                total = fmaf(-sz[g * RB + r], xsum[m * groups + g], total);
            }
            out[m * RB + r] = total;
        }
    }
}
#endif

/* One row's outputs of a block (`rows` of its 16) into y at `at`, rounded as f32_to_bf16 does (to nearest even,
 * NaN -> 0x7fc0) where y is bf16. One masked vector store: scalar stores of every output were ~15% of a prefill
 * call (M x N of them). */
static inline void store_outputs(const float *out, void *y, int64_t at, int64_t rows, int y_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __mmask16 mask = (__mmask16)((1u << rows) - 1);
    store16(y, at, mask, _mm512_maskz_loadu_ps(mask, out), y_bf16);
#else
    for (int64_t r = 0; r < rows; r++) store_from_f32(y, at + r, out[r], y_bf16);
#endif
}

int ember_int4_linear(const void *x, int x_bf16, const uint8_t *w, const float *sc, const float *sz, void *y,
                      int y_bf16, int64_t M, int64_t N, int64_t K, int64_t G, int num_threads) {
    if (M <= 0 || N <= 0 || K <= 0 || G <= 0 || G % 8 != 0) return 1;
    const int64_t groups = (K + G - 1) / G, Kp = groups * G, blocks = (N + RB - 1) / RB;
    int8_t *xq = malloc((size_t)(M * Kp));
    float *xs = malloc(sizeof(float) * (size_t)(M * groups)), *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return 2;
    }
    quantize_rows(x, x_bf16, M, K, G, groups, xq, xs, xsum);
    const int64_t block_bytes = Kp / 8 * 64, block_scales = groups * RB;
    /* Work items (rows of x in blocks that stay in L2, XQ_BLOCK_BYTES of xq; output block), output blocks fastest.
     * With every row in one block, each output block streamed all of xq from L3 at prefill sizes (2 MB at 2048
     * rows of 1024 inputs, for each of gate_up's 352 blocks). The weights are read once per row block: a few MB
     * from L3 for the 1-8 blocks of a prefill chunk. */
    int64_t rows_per_block = XQ_BLOCK_BYTES / Kp / MT * MT;
    if (rows_per_block < MT) rows_per_block = MT;
    const int64_t row_blocks = (M + rows_per_block - 1) / rows_per_block, items = row_blocks * blocks;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        float out[MT * RB];
        const int64_t b = item % blocks, m_begin = item / blocks * rows_per_block;
        const int64_t m_end = m_begin + rows_per_block < M ? m_begin + rows_per_block : M;
        const int64_t n0 = b * RB, rows = N - n0 < RB ? N - n0 : RB;
        for (int64_t m0 = m_begin; m0 < m_end; m0 += MT) {
            const int64_t mt = m_end - m0 < MT ? m_end - m0 : MT;
            const int8_t *xm = xq + m0 * Kp;
            const float *xsm = xs + m0 * groups, *xsumm = xsum + m0 * groups;
            const uint8_t *wb = w + b * block_bytes;
            const float *scb = sc + b * block_scales, *szb = sz + b * block_scales;
            /* Constant mt for each call, so the loops over rows unroll into registers. */
            switch (mt) {
            case 4: block_rows(wb, scb, szb, xm, xsm, xsumm, Kp, G, groups, 4, out); break;
            case 3: block_rows(wb, scb, szb, xm, xsm, xsumm, Kp, G, groups, 3, out); break;
            case 2: block_rows(wb, scb, szb, xm, xsm, xsumm, Kp, G, groups, 2, out); break;
            default: block_rows(wb, scb, szb, xm, xsm, xsumm, Kp, G, groups, 1, out); break;
            }
            for (int64_t m = 0; m < mt; m++) store_outputs(out + m * RB, y, (m0 + m) * N + n0, rows, y_bf16);
        }
    }
    free(xq), free(xs), free(xsum);
    return 0;
}

/* values [N, K] uint8 (0..15), scales [N, groups] and zeros [N, groups] float32 -> the layout above:
 * w [blocks][Kp / 8][16][4] bytes, sc and sz [blocks][groups][16]. Padding rows and inputs are zero. */
int ember_int4_pack(const uint8_t *values, const float *scales, const float *zeros, uint8_t *w, float *sc,
                    float *sz, int64_t N, int64_t K, int64_t G) {
    if (N <= 0 || K <= 0 || G <= 0 || G % 8 != 0) return 1;
    const int64_t groups = (K + G - 1) / G, Kp = groups * G, blocks = (N + RB - 1) / RB;
    memset(w, 0, (size_t)(blocks * (Kp / 8) * 64));
    memset(sc, 0, sizeof(float) * (size_t)(blocks * groups * RB));
    memset(sz, 0, sizeof(float) * (size_t)(blocks * groups * RB));
    for (int64_t n = 0; n < N; n++) {
        const int64_t b = n / RB, r = n % RB;
        uint8_t *wb = w + b * (Kp / 8) * 64;
        for (int64_t k = 0; k < K; k++) {
            const int64_t j = k / 8, within = k % 8, i = within % 4;
            const uint8_t v = values[n * K + k] & 0x0F;
            wb[j * 64 + 4 * r + i] |= within < 4 ? v : (uint8_t)(v << 4);
        }
        for (int64_t g = 0; g < groups; g++) {
            const float s = scales[n * groups + g];
            sc[(b * groups + g) * RB + r] = s;
            sz[(b * groups + g) * RB + r] = s * zeros[n * groups + g];
        }
    }
    return 0;
}
