/* What the native drafters (eagle3_draft.c, draft_llama.c) share: one-row vector math, RMSNorm, RoPE, and the
 * attention of one query over a request's paged context plus a few keys kept outside it (the positions a chain
 * drafts at: their blocks may not be allocated yet, and their K/V is only a guess, so it never enters the cache).
 * Included by each of them (build.py hashes it with the sources). */
#ifndef EMBER_DRAFT_OPS_H
#define EMBER_DRAFT_OPS_H

#include <math.h>
#include <stdint.h>
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

/* y[M, N] = x[M, K] @ w[N, K].T with w float32, bfloat16 or int8 with a float32 scale per row (FORMAT_*). */
enum { FORMAT_F32, FORMAT_BF16, FORMAT_INT8 };

int ember_dense_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads);
int ember_int8_linear(const void *x, int x_bf16, const int8_t *w, const float *scale, void *y, int y_bf16,
                      int64_t M, int64_t N, int64_t K, int num_threads);
int ember_dense_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads);

static inline void linear_in_format(int format, const void *w, const float *row_scale, const float *x, float *y,
                                    int64_t M, int64_t N, int64_t K, int threads) {
    if (format == FORMAT_INT8)
        ember_int8_linear(x, 0, (const int8_t *)w, row_scale, y, 0, M, N, K, threads);
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
