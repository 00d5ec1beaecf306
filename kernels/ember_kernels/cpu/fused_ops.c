/* Fused elementwise ops for the decode hot path: RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.
 *
 * Why: at batch 1 each of these is 3-10 tiny torch ops (and as many dispatches and allocations) on a
 * few thousand elements, so a decode step spent milliseconds in dispatch. One call each does the same
 * arithmetic with the same roundings as the torch formulas (see each function): rotary is bit-identical;
 * RMSNorm is bit-identical given the same mean of squares (the kernel's is a correctly rounded one, torch's
 * float sum can be an ulp off); SiLU differs only by its exp (~1 ulp in float32).
 *
 * dtype: 0 = float32, 1 = bfloat16 (uint16 bits) for every tensor argument. bf16 math is done in float32
 * and rounded back (round-to-nearest-even, NaN -> 0x7fc0, as c10::BFloat16) wherever torch rounds, i.e.
 * after every op of the formula. No FMA contraction (-std=c11 turns fp-contract off), as torch's separate
 * ops. AVX2 loops of 8 with scalar tails that compute the same values (gcc's own vectorization of the bf16
 * scalar code was 3-4x slower than float32); SiLU's tail goes through the vector code, as its exp differs.
 *
 * Threads: over rows (tokens), only from MIN_PARALLEL_ELEMS elements on: a 1-row decode call never wakes
 * the OpenMP team (~10 us with a passive wait policy, more than these kernels take).
 * All return 0, or 1 for bad sizes.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#ifndef MIN_PARALLEL_ELEMS
#define MIN_PARALLEL_ELEMS (1 << 16)
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD 1
#else
#define SIMD 0
#endif

/* v as a tensor of the dtype holds it: rounded for bf16, unchanged for fp32. */
static inline float rnd(float v, const int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline int use_threads(int64_t elems, int num_threads, int64_t rows) {
    return num_threads > 1 && rows > 1 && elems >= MIN_PARALLEL_ELEMS;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------------- */

/* One row. Sum of squares in double, in a fixed order (8 lanes, the tail into lane 0, then a fixed tree):
 * deterministic, the same with or without AVX2, and the mean is rounded to float once, where torch's float
 * sum (whose order we do not copy) can be an ulp off. */
static inline __attribute__((always_inline)) void rms_row(const void *x, const void *res, void *res_out,
                                                          const void *w, void *out, int64_t dim, float eps,
                                                          const int bf16) {
    const void *h = x;
    int64_t i = 0;
    if (res) { /* h = x + residual in the dtype; the normed input is the stored (rounded) sum */
#if SIMD
        for (; i + 8 <= dim; i += 8) store8(res_out, i, _mm256_add_ps(load8_as_f32(x, i, bf16), load8_as_f32(res, i, bf16)), bf16);
#endif
        for (; i < dim; i++) store_from_f32(res_out, i, load_as_f32(x, i, bf16) + load_as_f32(res, i, bf16), bf16);
        h = res_out;
    }
    double acc[8] = {0};
    i = 0;
#if SIMD
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8_as_f32(h, i, bf16);
        const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        lo = _mm256_fmadd_pd(a, a, lo); /* the square is exact, so this is the scalar mul + add */
        hi = _mm256_fmadd_pd(b, b, hi);
    }
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
#else
    for (; i + 8 <= dim; i += 8)
        for (int l = 0; l < 8; l++) {
            double v = load_as_f32(h, i + l, bf16);
            acc[l] += v * v; /* exact square: 24-bit mantissas fit in a double's 53 */
        }
#endif
    for (; i < dim; i++) {
        double v = load_as_f32(h, i, bf16);
        acc[0] += v * v;
    }
    double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    /* torch's rsqrt(var + eps) is 1 / sqrt(var + eps) in float */
    const float inv = 1.0f / sqrtf((float)(s / (double)dim) + eps);
    i = 0;
#if SIMD
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8)
        store8(out, i, _mm256_mul_ps(load8_as_f32(w, i, bf16), rnd8(_mm256_mul_ps(load8_as_f32(h, i, bf16), inv8), bf16)), bf16);
#endif
    for (; i < dim; i++) store_from_f32(out, i, load_as_f32(w, i, bf16) * rnd(load_as_f32(h, i, bf16) * inv, bf16), bf16);
}

static void rms_rows(const void *x, const void *res, void *res_out, const void *w, void *out, int64_t r,
                     int64_t dim, float eps, const int bf16) {
    const int64_t off = r * dim * (bf16 ? 2 : 4);
    const char *xr = (const char *)x + off;
    if (bf16) rms_row(xr, res ? (const char *)res + off : 0, res ? (char *)res_out + off : 0, w,
                      (char *)out + off, dim, eps, 1);
    else rms_row(xr, res ? (const char *)res + off : 0, res ? (char *)res_out + off : 0, w,
                 (char *)out + off, dim, eps, 0);
}

/* out = weight * rms_normalize(h).to(dtype), h = x + residual (stored to residual_out, which may be
 * residual itself) or x when residual is NULL. x, residual, residual_out, out: [rows, dim]; weight: [dim]. */
int ember_rms_norm(const void *x, const void *residual, void *residual_out, const void *weight, void *out,
                   int64_t rows, int64_t dim, float eps, int dtype, int num_threads) {
    if (rows < 0 || dim < 1 || (dtype != 0 && dtype != 1) || (residual && !residual_out)) return 1;
    const int bf16 = dtype == 1;
    if (use_threads(rows * dim, num_threads, rows)) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_rows(x, residual, residual_out, weight, out, r, dim, eps, bf16);
    } else {
        for (int64_t r = 0; r < rows; r++) rms_rows(x, residual, residual_out, weight, out, r, dim, eps, bf16);
    }
    return 0;
}

/* ---- Rotary (GPT-NeoX half split) ------------------------------------------------------------------ */

/* One head in place: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype (the
 * sum by the store). r(-a) == -r(a) under round-to-nearest-even, so -r(x2 * sin) is torch's r((-x2) * sin). */
static inline __attribute__((always_inline)) void rope_head(void *p, const void *c, const void *s, int64_t half,
                                                            const int bf16) {
    int64_t j = 0;
#if SIMD
    for (; j + 8 <= half; j += 8) {
        const __m256 a = load8_as_f32(p, j, bf16), b = load8_as_f32(p, j + half, bf16);
        const __m256 na = _mm256_sub_ps(rnd8(_mm256_mul_ps(a, load8_as_f32(c, j, bf16)), bf16),
                                        rnd8(_mm256_mul_ps(b, load8_as_f32(s, j, bf16)), bf16));
        const __m256 nb = _mm256_add_ps(rnd8(_mm256_mul_ps(b, load8_as_f32(c, j + half, bf16)), bf16),
                                        rnd8(_mm256_mul_ps(a, load8_as_f32(s, j + half, bf16)), bf16));
        store8(p, j, na, bf16);
        store8(p, j + half, nb, bf16);
    }
#endif
    for (; j < half; j++) {
        const float a = load_as_f32(p, j, bf16), b = load_as_f32(p, j + half, bf16);
        const float na = rnd(a * load_as_f32(c, j, bf16), bf16) - rnd(b * load_as_f32(s, j, bf16), bf16);
        const float nb = rnd(b * load_as_f32(c, j + half, bf16), bf16) + rnd(a * load_as_f32(s, j + half, bf16), bf16);
        store_from_f32(p, j, na, bf16);
        store_from_f32(p, j + half, nb, bf16);
    }
}

static void rope_token(void *x, int64_t t, int64_t heads, int64_t head_dim, int64_t token_stride,
                       const void *cos, const void *sin, const int bf16) {
    const int esize = bf16 ? 2 : 4;
    char *xt = (char *)x + t * token_stride * esize;
    const char *ct = (const char *)cos + t * head_dim * esize, *st = (const char *)sin + t * head_dim * esize;
    for (int64_t h = 0; h < heads; h++) {
        if (bf16) rope_head(xt + h * head_dim * esize, ct, st, head_dim / 2, 1);
        else rope_head(xt + h * head_dim * esize, ct, st, head_dim / 2, 0);
    }
}

/* In place on heads [tokens, heads, head_dim] starting at x, token t at x + t * token_stride elements
 * (a q or k slice of a fused qkv row); cos, sin: [tokens, head_dim]. */
int ember_rotary(void *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                 const void *cos, const void *sin, int dtype, int num_threads) {
    if (tokens < 0 || heads < 1 || head_dim < 2 || head_dim % 2 || (dtype != 0 && dtype != 1) ||
        (tokens > 1 && token_stride < heads * head_dim)) /* overlapping tokens would race */
        return 1;
    const int bf16 = dtype == 1;
    if (use_threads(tokens * heads * head_dim, num_threads, tokens)) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < tokens; t++) rope_token(x, t, heads, head_dim, token_stride, cos, sin, bf16);
    } else {
        for (int64_t t = 0; t < tokens; t++) rope_token(x, t, heads, head_dim, token_stride, cos, sin, bf16);
    }
    return 0;
}

/* ---- SiLU and mul ----------------------------------------------------------------------------------- */

#if SIMD
/* torch: silu(g) = g / (1 + exp(-g)) in float, rounded to the dtype; then silu * up (rounded by the store). */
static inline __attribute__((always_inline)) __m256 silu_mul8(__m256 g, __m256 up, const int bf16) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(rnd8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), bf16), up);
}

static inline __attribute__((always_inline)) void silu_row(const void *x, void *out, int64_t inter,
                                                           const int bf16) {
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) store8(out, i, silu_mul8(load8_as_f32(x, i, bf16), load8_as_f32(x, inter + i, bf16), bf16), bf16);
    if (i < inter) { /* the tail through the same vector code: an element's result never depends on where it is */
        float g[8] = {0}, up[8] = {0}, y[8];
        for (int64_t j = i; j < inter; j++) g[j - i] = load_as_f32(x, j, bf16), up[j - i] = load_as_f32(x, inter + j, bf16);
        _mm256_storeu_ps(y, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(up), bf16));
        for (int64_t j = i; j < inter; j++) store_from_f32(out, j, y[j - i], bf16);
    }
}
#else
/* torch: silu(g) = g / (1 + exp(-g)) in float, rounded to the dtype; then silu * up (rounded by the store). */
static inline void silu_row(const void *x, void *out, int64_t inter, const int bf16) {
    for (int64_t i = 0; i < inter; i++) {
        const float g = load_as_f32(x, i, bf16);
        store_from_f32(out, i, rnd(g / (1.0f + expf(-g)), bf16) * load_as_f32(x, inter + i, bf16), bf16);
    }
}
#endif

static void silu_rows(const void *x, void *out, int64_t r, int64_t inter, const int bf16) {
    const int esize = bf16 ? 2 : 4;
    const char *xr = (const char *)x + 2 * r * inter * esize;
    char *o = (char *)out + r * inter * esize;
    if (bf16) silu_row(xr, o, inter, 1);
    else silu_row(xr, o, inter, 0);
}

/* out [rows, inter] = silu(x[:, :inter]) * x[:, inter:], x: [rows, 2 * inter]. */
int ember_silu_and_mul(const void *x, void *out, int64_t rows, int64_t inter, int dtype, int num_threads) {
    if (rows < 0 || inter < 1 || (dtype != 0 && dtype != 1)) return 1;
    const int bf16 = dtype == 1;
    if (use_threads(rows * inter, num_threads, rows)) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) silu_rows(x, out, r, inter, bf16);
    } else {
        for (int64_t r = 0; r < rows; r++) silu_rows(x, out, r, inter, bf16);
    }
    return 0;
}

/* ---- Column gather ------------------------------------------------------------------------------------ */

/* out[r, j] = x[r, order[j]] for x, out [rows, cols] of `esize`-byte elements (2 or 4), order int32 [cols],
 * every entry in 0..cols-1 (checked by the caller once, when the order is installed).
 * Why: act-order GPTQ layers read their inputs in group order on every forward pass; torch's index_select along
 * the columns runs at a fraction of memory speed there (8 ms for 2048 x 1024 bf16 on 2 threads, a dense bf16
 * matmul of that layer costs about as much). A row is a few KB, so its reads stay in L1: this runs near a copy. */
static void gather_row16(const uint16_t *x, uint16_t *out, const int32_t *order, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) out[j] = x[order[j]];
}

static void gather_row32(const uint32_t *x, uint32_t *out, const int32_t *order, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) out[j] = x[order[j]];
}

int ember_gather_columns(const void *x, void *out, const int32_t *order, int64_t rows, int64_t cols, int esize,
                         int num_threads) {
    if (rows < 0 || cols < 1 || (esize != 2 && esize != 4)) return 1;
    const int threads = use_threads(rows * cols, num_threads, rows);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threads)
    for (int64_t r = 0; r < rows; r++) {
        if (esize == 2) gather_row16((const uint16_t *)x + r * cols, (uint16_t *)out + r * cols, order, cols);
        else gather_row32((const uint32_t *)x + r * cols, (uint32_t *)out + r * cols, order, cols);
    }
    return 0;
}
