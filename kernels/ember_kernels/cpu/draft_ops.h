/* What the native drafters (eagle3_draft.c, draft_llama.c) share: one-row vector math, RMSNorm, RoPE, and the
 * attention of one query over a request's paged context plus a few keys kept outside it (the positions a chain
 * drafts at: their blocks may not be allocated yet, and their K/V is only a guess, so it never enters the cache).
 * Included by each of them (build.py hashes it with the sources). */
#ifndef EMBER_DRAFT_OPS_H
#define EMBER_DRAFT_OPS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* In place: x[i] = exp(x[i] - max) / sum. */
static inline void softmax(float *x, int64_t n) {
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    const __m256 tv = _mm256_set1_ps(top);
    __m256 sv = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), tv));
        _mm256_storeu_ps(x + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; i < n; i++) sum += (x[i] = expf(x[i] - top));
    const float inv = 1.0f / sum;
    for (i = 0; i < n; i++) x[i] *= inv;
}

#if defined(__AVX512F__)
/* scores[t] = q . keys[t] * scale for n contiguous key rows of hd floats, 16 lanes: four keys at a time
 * (independent FMA chains), their four sums folded together by unpacks (10 ops for four keys, where a
 * horizontal sum each costs 8). The 8-lane build below took as long as the drafters' linears. */
static inline void score_rows(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
    int64_t t = 0;
    if (hd % 16 == 0)
        for (; t + 4 <= n; t += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *k0 = keys + t * hd;
            for (int64_t i = 0; i < hd; i += 16) {
                const __m512 qv = _mm512_loadu_ps(q + i);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + i), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + hd + i), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 2 * hd + i), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 3 * hd + i), a3);
            }
            /* per 128-bit lane: [a0 a1 a2 a3] partial sums, then the four lanes added */
            const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
            const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
            const __m512 u = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
            const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(scores + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    for (; t < n; t++) scores[t] = dot(q, keys + t * hd, hd) * scale;
}

/* o += sum_t p[t] * values[t] over n contiguous value rows: 64 floats at a time in two sets of four 16-lane
 * accumulators (even and odd t), so two FMA chains run per register's latency. */
static inline void accumulate_rows(float *o, const float *p, const float *values, int64_t n, int64_t hd) {
    if (hd % 64 != 0) {
        for (int64_t t = 0; t < n; t++) axpy(o, p[t], values + t * hd, hd);
        return;
    }
    for (int64_t i = 0; i < hd; i += 64) {
        __m512 even[4], odd[4];
        for (int c = 0; c < 4; c++) even[c] = _mm512_loadu_ps(o + i + 16 * c), odd[c] = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 2 <= n; t += 2) {
            const __m512 a = _mm512_set1_ps(p[t]), b = _mm512_set1_ps(p[t + 1]);
            const float *v = values + t * hd + i;
            for (int c = 0; c < 4; c++) {
                even[c] = _mm512_fmadd_ps(a, _mm512_loadu_ps(v + 16 * c), even[c]);
                odd[c] = _mm512_fmadd_ps(b, _mm512_loadu_ps(v + hd + 16 * c), odd[c]);
            }
        }
        if (t < n)
            for (int c = 0; c < 4; c++)
                even[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(values + t * hd + i + 16 * c), even[c]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + i + 16 * c, _mm512_add_ps(even[c], odd[c]));
    }
}
#else
/* scores[t] = q . keys[t] * scale for n contiguous key rows of hd floats: four keys at a time (independent FMA
 * chains: one key's chain alone waits on FMA latency). */
static inline void score_rows(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
    int64_t t = 0;
    if (hd % 8 == 0)
        for (; t + 4 <= n; t += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *k0 = keys + t * hd;
            for (int64_t i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + hd + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * hd + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * hd + i), a3);
            }
            scores[t] = hsum(a0) * scale, scores[t + 1] = hsum(a1) * scale;
            scores[t + 2] = hsum(a2) * scale, scores[t + 3] = hsum(a3) * scale;
        }
    for (; t < n; t++) scores[t] = dot(q, keys + t * hd, hd) * scale;
}

/* o += sum_t p[t] * values[t] over n contiguous value rows; o kept in registers 64 floats at a time. */
static inline void accumulate_rows(float *o, const float *p, const float *values, int64_t n, int64_t hd) {
    if (hd % 64 != 0) {
        for (int64_t t = 0; t < n; t++) axpy(o, p[t], values + t * hd, hd);
        return;
    }
    for (int64_t i = 0; i < hd; i += 64) {
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(o + i + 8 * c);
        for (int64_t t = 0; t < n; t++) {
            const __m256 a = _mm256_set1_ps(p[t]);
            const float *v = values + t * hd + i;
            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(a, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + i + 8 * c, acc[c]);
    }
}
#endif
#else
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static inline void softmax(float *x, int64_t n) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    for (int64_t i = 0; i < n; i++) sum += (x[i] = expf(x[i] - top));
    for (int64_t i = 0; i < n; i++) x[i] /= sum;
}

static inline void score_rows(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
    for (int64_t t = 0; t < n; t++) scores[t] = dot(q, keys + t * hd, hd) * scale;
}

static inline void accumulate_rows(float *o, const float *p, const float *values, int64_t n, int64_t hd) {
    for (int64_t t = 0; t < n; t++) axpy(o, p[t], values + t * hd, hd);
}
#endif

static inline void rms(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = dot(x, x, n);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* RoPE on one head in place, the halves rotated (Llama's rotate_half), cos/sin of the row's position. */
static inline void rope(float *x, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One layer's paged K/V of one request: caches [num_blocks, hkv, s, hd] float32, `table` its blocks. */
typedef struct {
    float *k, *v;
    int64_t s, num_blocks, hkv, hd;
    const int32_t *table;
    int64_t table_len;
    const int64_t *gaps; /* [n_gaps, 2]: position ranges [a, b) whose K/V were never written, masked out */
    int64_t n_gaps;
} PagedKV;

/* Offset of (position p, KV head g) in the caches, or -1 if the position's block is not in the table. */
static inline int64_t paged_row(const PagedKV *c, int64_t p, int64_t g) {
    const int64_t b = p / c->s;
    if (p < 0 || b >= c->table_len) return -1;
    const int64_t block = c->table[b];
    if (block < 0 || block >= c->num_blocks) return -1;
    return ((block * c->hkv + g) * c->s + p % c->s) * c->hd;
}

/* Whether every block holding positions 0 .. n - 1 is in the table and in range. */
static inline int paged_context_ok(const PagedKV *c, int64_t n) {
    if (n > 0 && (n - 1) / c->s >= c->table_len) return 0;
    for (int64_t b = 0; b * c->s < n; b++)
        if (c->table[b] < 0 || c->table[b] >= c->num_blocks) return 0;
    return 1;
}

/* o[hd] = attention of query q (KV head g) over paged positions 0 .. nc - 1 (but the gaps) and then `ne` extra
 * keys / values (contiguous rows of hd floats). The paged context must be checked (paged_context_ok); scores:
 * nc + ne floats of work memory. Scores come block by block (each block's rows of KV head g are contiguous), one
 * max, exp and sum over all of them. */
static inline void attend(const PagedKV *c, const float *q, int64_t g, int64_t nc, const float *ek, const float *ev,
                          int64_t ne, float scale, float *scores, float *o) {
    const int64_t s = c->s, hd = c->hd;
    for (int64_t b = 0; b * s < nc; b++) {
        const float *keys = c->k + ((int64_t)c->table[b] * c->hkv + g) * s * hd;
        score_rows(q, keys, nc - b * s < s ? nc - b * s : s, hd, scale, scores + b * s);
    }
    for (int64_t i = 0; i < c->n_gaps; i++)
        for (int64_t p = c->gaps[2 * i] > 0 ? c->gaps[2 * i] : 0; p < c->gaps[2 * i + 1] && p < nc; p++)
            scores[p] = -INFINITY;
    for (int64_t e = 0; e < ne; e++) scores[nc + e] = dot(q, ek + e * hd, hd) * scale;
    softmax(scores, nc + ne);
    memset(o, 0, sizeof(float) * (size_t)hd);
    for (int64_t b = 0; b * s < nc; b++) {
        const float *values = c->v + ((int64_t)c->table[b] * c->hkv + g) * s * hd;
        accumulate_rows(o, scores + b * s, values, nc - b * s < s ? nc - b * s : s, hd);
    }
    for (int64_t e = 0; e < ne; e++) axpy(o, scores[nc + e], ev + e * hd, hd);
}

/* y[M, N] = x[M, K] @ w[N, K].T with w float32, bfloat16 or int8 with a float32 scale per row (FORMAT_*).
 * int8 matrices come packed (`packed_int8_linear`), as draft_weights.py lays them out. */
enum { FORMAT_F32, FORMAT_BF16, FORMAT_INT8 };

int ember_dense_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads);
int ember_dense_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads);

/* Packed int8: the outputs in blocks of PACK (the last padded with zero rows and zero scales), each block's
 * weights [K][PACK], the block's outputs fastest. One 16-byte load is 16 outputs' weights at one input, so the
 * products are a broadcast input times a vector and the sums build up in 16 outputs' lanes at once. Laid out by
 * row ([N][K]), a drafter's small matrices (K of 256-768) spent as long on each output's horizontal sum and
 * scalar store as on its products: the drafters' linears ran at ~17 GMAC/s, a third of this core's widening rate.
 * Sums are in float32 over the exactly widened weights, in a different order from the row layout's. */
#define PACK 16
#define PACK_ROWS 4  /* input rows per pass over a block: 4 x 4 accumulators + the widened weights in registers */

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void packed_block(const float *x, const int8_t *wb, const float *sc,
                                                               float *y, int64_t N, int64_t K, int64_t n0,
                                                               const int mg) {
    __m512 a[PACK_ROWS][4]; /* four partial sums per row: independent FMA chains */
    for (int m = 0; m < mg; m++)
        for (int u = 0; u < 4; u++) a[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int u = 0; u < 4; u++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(wb + (k + u) * PACK))));
            for (int m = 0; m < mg; m++) a[m][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k + u]), w, a[m][u]);
        }
    for (; k < K; k++) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + k * PACK))));
        for (int m = 0; m < mg; m++) a[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, a[m][0]);
    }
    const __mmask16 mask = N - n0 >= PACK ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    const __m512 s = _mm512_loadu_ps(sc + n0);
    for (int m = 0; m < mg; m++) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
        _mm512_mask_storeu_ps(y + m * N + n0, mask, _mm512_mul_ps(sum, s));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void packed_block(const float *x, const int8_t *wb, const float *sc,
                                                               float *y, int64_t N, int64_t K, int64_t n0,
                                                               const int mg) {
    __m256 a[PACK_ROWS][2][2]; /* [row][half of the block][partial sum] */
    for (int m = 0; m < mg; m++)
        for (int h = 0; h < 2; h++) a[m][h][0] = a[m][h][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2)
        for (int u = 0; u < 2; u++)
            for (int h = 0; h < 2; h++) {
                const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(wb + (k + u) * PACK + 8 * h))));
                for (int m = 0; m < mg; m++)
                    a[m][h][u] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k + u]), w, a[m][h][u]);
            }
    for (; k < K; k++)
        for (int h = 0; h < 2; h++) {
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(wb + k * PACK + 8 * h))));
            for (int m = 0; m < mg; m++) a[m][h][0] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), w, a[m][h][0]);
        }
    float out[PACK];
    for (int m = 0; m < mg; m++) {
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_add_ps(a[m][h][0], a[m][h][1]),
                                                        _mm256_loadu_ps(sc + n0 + 8 * h)));
        for (int64_t n = n0; n < N && n < n0 + PACK; n++) y[m * N + n] = out[n - n0];
    }
}
#else
static inline void packed_block(const float *x, const int8_t *wb, const float *sc, float *y, int64_t N, int64_t K,
                                int64_t n0, const int mg) {
    for (int m = 0; m < mg; m++)
        for (int64_t n = n0; n < N && n < n0 + PACK; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * K + k] * (float)wb[k * PACK + n - n0];
            y[m * N + n] = s * sc[n];
        }
}
#endif

/* One block's outputs for every row of x. */
static inline void packed_block_rows(const float *x, const int8_t *w, const float *scale, float *y, int64_t M,
                                     int64_t N, int64_t K, int64_t b) {
    const int8_t *wb = w + b * K * PACK;
    for (int64_t m0 = 0; m0 < M; m0 += PACK_ROWS) {
        const int64_t mg = M - m0 < PACK_ROWS ? M - m0 : PACK_ROWS;
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        switch (mg) { /* constant row counts, so the accumulators stay in registers */
            case 4: packed_block(xm, wb, scale, ym, N, K, b * PACK, 4); break;
            case 3: packed_block(xm, wb, scale, ym, N, K, b * PACK, 3); break;
            case 2: packed_block(xm, wb, scale, ym, N, K, b * PACK, 2); break;
            default: packed_block(xm, wb, scale, ym, N, K, b * PACK, 1); break;
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* W8A8 on a CPU with AVX512-VNNI (and VBMI's byte permute): each row of x rounded to int8 on a scale of its own
 * (max |x| / 127), then vpdpbusd sums four products of bytes per instruction into int32: 64 multiply-adds where
 * the widening path above does 16 with two conversions. Where the weights are in cache (on the example, EAGLE-3's
 * ~1M int8 weights fit L2 once the first draft position read them) the widening path is bound by instructions:
 * EAGLE-3's draft call went 111 -> 79 us warm. It rounds activations: a draft may differ from the float32 head's
 * at a near-tie, which only the acceptance can see (the target verifies every draft; mean accepted length on the
 * held-out prompts 2.9555 against the float32 head's 2.9493).
 *
 * The weights stay in the packed layout: four inputs' 16-byte rows (64 bytes) are permuted so that each output's
 * lane holds its four weights, and flipped to unsigned (w + 128, vpdpbusd's unsigned operand); the rows' 128 *
 * sum(x) is subtracted after. Inputs past the last four run on their own (scalar products of int8 in int32). */
#define DRAFT_W8A8 1
#define W8A8_STACK_BYTES 16384

/* Byte j of the permuted 64 bytes is output j / 4's weight at input j % 4 of the four: byte (j % 4) * 16 + j / 4. */
static inline __m512i w8a8_transpose_index(void) {
    uint8_t idx[64];
    for (int j = 0; j < 64; j++) idx[j] = (uint8_t)((j % 4) * PACK + j / 4);
    return _mm512_loadu_si512(idx);
}

/* Rows of x rounded to int8 (the row's scale in xs[m]); qsum[m] = 128 * the sum of the row's int8 values over
 * the inputs of whole fours (what the unsigned weights add). */
static inline void w8a8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, int32_t *qsum) {
    const int64_t whole = K / 4 * 4;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        int8_t *q = xq + m * K;
        __m512 vmax = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
        float amax = _mm512_reduce_max_ps(vmax);
        for (; k < K; k++) amax = row[k] > amax ? row[k] : (-row[k] > amax ? -row[k] : amax);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs[m] = amax / 127.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        __m512i vsum = _mm512_setzero_si512();
        int32_t sum = 0;
        for (k = 0; k + 16 <= K; k += 16) {
            /* to nearest, ties to even (the default rounding mode), as torch.round */
            const __m512i r = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(
                _mm512_mul_ps(_mm512_loadu_ps(row + k), vinv))));
            _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(r));
            if (k + 16 <= whole) vsum = _mm512_add_epi32(vsum, r);
            else
                for (int64_t j = k; j < whole; j++) sum += q[j];
        }
        for (; k < K; k++) {
            float r = nearbyintf(row[k] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q[k] = (int8_t)r;
            if (k < whole) sum += (int32_t)r;
        }
        qsum[m] = 128 * (sum + _mm512_reduce_add_epi32(vsum));
    }
}

static inline __attribute__((always_inline)) void w8a8_block(const int8_t *xq, const float *xs, const int32_t *qsum,
                                                             const int8_t *wb, const float *sc, float *y, int64_t N,
                                                             int64_t K, int64_t n0, const int mg,
                                                             const __m512i index) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a[PACK_ROWS][2]; /* two chains per row: vpdpbusd's latency */
    for (int m = 0; m < mg; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
    const int64_t fours = K / 4;
    int64_t g = 0;
    for (; g + 2 <= fours; g += 2)
        for (int u = 0; u < 2; u++) {
            const __m512i w = _mm512_xor_si512(
                _mm512_permutexvar_epi8(index, _mm512_loadu_si512(wb + (g + u) * 4 * PACK)), flip);
            for (int m = 0; m < mg; m++) {
                int32_t four;
                memcpy(&four, xq + m * K + (g + u) * 4, 4);
                a[m][u] = _mm512_dpbusd_epi32(a[m][u], w, _mm512_set1_epi32(four));
            }
        }
    for (; g < fours; g++) {
        const __m512i w = _mm512_xor_si512(_mm512_permutexvar_epi8(index, _mm512_loadu_si512(wb + g * 4 * PACK)),
                                           flip);
        for (int m = 0; m < mg; m++) {
            int32_t four;
            memcpy(&four, xq + m * K + g * 4, 4);
            a[m][0] = _mm512_dpbusd_epi32(a[m][0], w, _mm512_set1_epi32(four));
        }
    }
    for (int64_t k = fours * 4; k < K; k++) { /* the last inputs, signed, unflipped */
        const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + k * PACK)));
        for (int m = 0; m < mg; m++)
            a[m][1] = _mm512_add_epi32(a[m][1], _mm512_mullo_epi32(w, _mm512_set1_epi32(xq[m * K + k])));
    }
    const __mmask16 mask = N - n0 >= PACK ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    const __m512 s = _mm512_loadu_ps(sc + n0);
    for (int m = 0; m < mg; m++) {
        const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(a[m][0], a[m][1]), _mm512_set1_epi32(qsum[m]));
        _mm512_mask_storeu_ps(y + m * N + n0, mask,
                              _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(xs[m]), s)));
    }
}

static inline void w8a8_block_rows(const int8_t *xq, const float *xs, const int32_t *qsum, const int8_t *w,
                                   const float *scale, float *y, int64_t M, int64_t N, int64_t K, int64_t b,
                                   const __m512i index) {
    const int8_t *wb = w + b * K * PACK;
    for (int64_t m0 = 0; m0 < M; m0 += PACK_ROWS) {
        const int64_t mg = M - m0 < PACK_ROWS ? M - m0 : PACK_ROWS;
        const int8_t *xm = xq + m0 * K;
        float *ym = y + m0 * N;
        switch (mg) {
            case 4: w8a8_block(xm, xs + m0, qsum + m0, wb, scale, ym, N, K, b * PACK, 4, index); break;
            case 3: w8a8_block(xm, xs + m0, qsum + m0, wb, scale, ym, N, K, b * PACK, 3, index); break;
            case 2: w8a8_block(xm, xs + m0, qsum + m0, wb, scale, ym, N, K, b * PACK, 2, index); break;
            default: w8a8_block(xm, xs + m0, qsum + m0, wb, scale, ym, N, K, b * PACK, 1, index); break;
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ (w * scale).T for packed int8 w (above): W8A8 where the CPU has VNNI (DRAFT_W8A8), the
 * widened int8 weights times float32 x elsewhere (and if memory for the rounded rows runs out). Blocks over
 * threads only where the work pays for waking them (as quantized_linear.c decides); one thread runs outside
 * OpenMP (an if(0) region still costs a GOMP_parallel call, a few percent of a drafter's step). */
static inline void packed_int8_linear(const float *x, const int8_t *w, const float *scale, float *y, int64_t M,
                                      int64_t N, int64_t K, int threads) {
    const int64_t blocks = (N + PACK - 1) / PACK;
    const int parallel = threads > 1 && M * N * K >= (1 << 20);
#ifdef DRAFT_W8A8
    /* the rounded rows, their scales and sums: on the stack for a drafter's few rows, else from the heap */
    const size_t bytes = (size_t)M * (sizeof(float) + sizeof(int32_t)) + (size_t)(M * K);
    _Alignas(64) char stack[W8A8_STACK_BYTES];
    char *buffer = bytes <= sizeof stack ? stack : (char *)malloc(bytes);
    if (buffer != NULL) {
        float *xs = (float *)buffer;
        int32_t *qsum = (int32_t *)(buffer + M * sizeof(float));
        int8_t *xq = (int8_t *)(buffer + M * (sizeof(float) + sizeof(int32_t)));
        w8a8_quantize(x, M, K, xq, xs, qsum);
        const __m512i index = w8a8_transpose_index();
        if (!parallel) {
            for (int64_t b = 0; b < blocks; b++) w8a8_block_rows(xq, xs, qsum, w, scale, y, M, N, K, b, index);
        } else {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t b = 0; b < blocks; b++) w8a8_block_rows(xq, xs, qsum, w, scale, y, M, N, K, b, index);
        }
        if (buffer != stack) free(buffer);
        return;
    }
#endif
    if (!parallel) {
        for (int64_t b = 0; b < blocks; b++) packed_block_rows(x, w, scale, y, M, N, K, b);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) packed_block_rows(x, w, scale, y, M, N, K, b);
}

/* Whether packed int8 linears round their inputs to int8 (W8A8, DRAFT_W8A8) on this build: 8, else 32. */
static inline int packed_int8_activation_bits(void) {
#ifdef DRAFT_W8A8
    return 8;
#else
    return 32;
#endif
}

static inline void linear_in_format(int format, const void *w, const float *row_scale, const float *x, float *y,
                                    int64_t M, int64_t N, int64_t K, int threads) {
    if (format == FORMAT_INT8)
        packed_int8_linear(x, (const int8_t *)w, row_scale, y, M, N, K, threads);
    else if (format == FORMAT_BF16)
        ember_dense_linear_bf16(x, (const uint16_t *)w, NULL, y, M, N, K, threads);
    else
        ember_dense_linear_f32(x, (const float *)w, NULL, y, M, N, K, threads);
}

/* The index of the largest of n floats: the first of equal maxima, as torch.argmax. */
static inline int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

#endif
