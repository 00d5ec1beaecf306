/* Small-batch dense linear on CPU: y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]), float32 out, M small.
 *
 * Why: speculative decoding verifies 2-9 tokens per step, and MKL's float32 GEMM on AVX2 CPUs costs
 * 2-4x more per row at 2-8 rows than its GEMV at one row, which ate most of what speculation saved.
 * Decode at a few rows is bound by streaming the weights, so this reads each weight row once for
 * all the rows of x: an MR x NR tile of accumulators stays in registers while the MR rows of x and
 * the NR weight rows stream through L1.
 *
 * Exactness: every (m, n) is one 8-lane (16 with AVX-512) accumulator fed by FMAs over k in ascending
 * order, then a fixed horizontal sum, the scalar tail of K, and the bias, whatever M, the tile shape or the thread
 * count is. So a row's result never depends on the rows batched with it: batching and speculative
 * verification leave greedy output alone.
 *
 * Weights: float32, or bfloat16 widened to float32 in registers (exact: bf16 is the top half of an
 * fp32), so a bf16 checkpoint moves half the bytes and is computed in float32.
 *
 * Layouts (row-major, contiguous): x [M, K] float32 (bfloat16 for the _bf16_io entry), w [N, K] float32 or
 * bfloat16 (uint16 bits), bias [N] float32 or NULL, y [M, N] float32 (bfloat16 for _bf16_io). Returns 0, 1 for
 * bad arguments, 2 if memory ran out.
 */
#include <stdint.h>

#include "simd.h"

#define NB 48    /* output columns per work item: a multiple of every tile width below */
#define MR 4     /* most rows of x per tile */
#define NR 8     /* most weight rows per tile */
/* Below this many multiply-adds one thread is as fast or faster: waking the others (OpenMP, passive
 * wait) cost ~10 us on a 2-core EPYC, and e.g. 512x256 at 1 row took 11 us on one thread, 21 on two;
 * at ~1M (1376x256 at 5 rows, 4096x256 at 1) two threads start to win. */
#ifndef MIN_PARALLEL_WORK
#define MIN_PARALLEL_WORK (1 << 20)
#endif

#if defined(__AVX512F__)

/* 16 elements from i of a float32 (bf16 == 0) or bfloat16 array, as float32 (bf16 widened exactly). */
static inline __m512 load16_as_f32(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* The AVX-512 build of the tile below: 16-lane accumulators, so each (m, n) is one 16-lane accumulator fed in
 * ascending k, a fixed horizontal sum (_mm512_reduce_add_ps), the scalar tail of K and the bias. Half the
 * instructions of the 8-lane tile per multiply-add: at 2-8 rows (speculative verification) the 8-lane tile was
 * bound by its instructions, not by the weights it streams (tiny-llama's linears at 4 rows took 2.4x their
 * 1-row time; 1.6x with this, on a Zen 5 core). */
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, const float *bias,
                                                       void *y, int y_bf16, int64_t y0, int64_t N, int64_t K, int64_t n,
                                                       const int mr, const int nr, const int bf16, const char *fetch,
                                                       const int64_t fetch_rows) {
    __m512 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) acc[m][j] = _mm512_setzero_ps();
    const int esize = bf16 ? 2 : 4;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (fetch_rows && (k * esize) % 64 == 0)
            for (int64_t j = 0; j < fetch_rows; j++) _mm_prefetch(fetch + (j * K + k) * esize, _MM_HINT_T0);
        __m512 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = load16_as_f32(w, (n + j) * K + k, bf16);
        for (int m = 0; m < mr; m++) {
            __m512 xv = _mm512_loadu_ps(x + m * K + k);
            for (int j = 0; j < nr; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) {
            float s = _mm512_reduce_add_ps(acc[m][j]);
            for (int64_t t = k; t < K; t++) s += x[m * K + t] * load_as_f32(w, (n + j) * K + t, bf16);
            if (bias) s += bias[n + j];
            store_from_f32(y, (y0 + m) * N + n + j, s, y_bf16);
        }
}
#elif defined(__AVX2__) && defined(__FMA__)

/* y[m, n + j] for m < mr, j < nr. mr, nr and bf16 are compile-time constants after inlining, so the
 * accumulators live in registers (mr * nr <= 12 of the 16 ymm registers). */
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, const float *bias,
                                                       void *y, int y_bf16, int64_t y0, int64_t N, int64_t K, int64_t n,
                                                       const int mr, const int nr, const int bf16, const char *fetch,
                                                       const int64_t fetch_rows) {
    __m256 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) acc[m][j] = _mm256_setzero_ps();
    /* Prefetch: `fetch_rows` weight rows from `fetch` on are asked for while this tile's stream through
     * (see block()). Each weight row is its own few-KB stream, and the hardware prefetcher stops at every
     * page, so without this the weights arrive at a fraction of the memory bandwidth. */
    const int esize = bf16 ? 2 : 4;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (fetch_rows && (k * esize) % 64 == 0)
            for (int64_t j = 0; j < fetch_rows; j++) _mm_prefetch(fetch + (j * K + k) * esize, _MM_HINT_T0);
        __m256 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = load8_as_f32(w, (n + j) * K + k, bf16);
        for (int m = 0; m < mr; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            for (int j = 0; j < nr; j++) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) {
            float s = hsum(acc[m][j]);
            for (int64_t t = k; t < K; t++) s += x[m * K + t] * load_as_f32(w, (n + j) * K + t, bf16);
            if (bias) s += bias[n + j];
            store_from_f32(y, (y0 + m) * N + n + j, s, y_bf16);
        }
}
#else
/* Portable fallback: the same contract (one fixed order per (m, n)), plain loops. */
static inline void tile(const float *x, const void *w, const float *bias, void *y, int y_bf16, int64_t y0,
                        int64_t N, int64_t K, int64_t n, const int mr, const int nr, const int bf16, const char *fetch,
                        const int64_t fetch_rows) {
    (void)fetch, (void)fetch_rows;
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * K + k] * load_as_f32(w, (n + j) * K + k, bf16);
            if (bias) s += bias[n + j];
            store_from_f32(y, (y0 + m) * N + n + j, s, y_bf16);
        }
}
#endif

/* Columns [n0, n1) for rows [m0, m0 + mr), in tiles of nr columns and then single columns. Prefetching:
 * the first group of rows (m0 == 0) meets the block's weights first and streams them from memory, so each
 * of its tiles asks for the next tile's rows; the second group finds them in cache, so it asks for the
 * next block's, which the first group of that block then finds in cache too: memory and FMAs overlap.
 * A single row is pure streaming, which the hardware prefetcher alone did faster (by ~20%). */
#define COLUMNS(mr, nr)                                                                             \
    do {                                                                                            \
        int64_t n = n0;                                                                             \
        for (; n < n1; n += (n + (nr) <= n1 ? (nr) : 1)) {                                          \
            const int width = n + (nr) <= n1 ? (nr) : 1;                                            \
            const int64_t ahead = m0 == 0 ? n + width : (m0 == MR ? n + NB : N);                    \
            const int64_t rows = M == 1 ? 0 : ahead + width <= N ? width : (N > ahead ? N - ahead : 0); \
            const char *fetch = (const char *)w + ahead * K * (bf16 ? 2 : 4);                       \
            if (width == (nr)) tile(xg, w, bias, y, y_bf16, m0, N, K, n, (mr), (nr), bf16, fetch, rows); \
            else tile(xg, w, bias, y, y_bf16, m0, N, K, n, (mr), 1, bf16, fetch, rows);              \
        }                                                                                           \
    } while (0)

static inline __attribute__((always_inline)) void block(const float *x, const void *w, const float *bias,
                                                        void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                                                        int64_t n0, int64_t n1, const int bf16) {
    /* Rows in groups of up to MR; the block's weights (NB x K) stay in L1/L2 across the groups. */
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const float *xg = x + m0 * K;
#if defined(__AVX512F__)
        switch (M - m0 < MR ? M - m0 : MR) { /* widths dividing NB; measured best of 2-8 at 2-4 rows */
            case 4: COLUMNS(4, 4); break;
            case 3: COLUMNS(3, 6); break;
            case 2: COLUMNS(2, 4); break;
            default: COLUMNS(1, 8); break;
        }
#else
        switch (M - m0 < MR ? M - m0 : MR) { /* tile shapes with at most 12 accumulators */
            case 4: COLUMNS(4, 3); break;
            case 3: COLUMNS(3, 4); break;
            case 2: COLUMNS(2, 6); break;
            default: COLUMNS(1, 8); break;
        }
#endif
    }
}

/* x float32 or (x_bf16) bfloat16, widened once; y float32 or (y_bf16) bfloat16, rounded from each float32 sum as
 * torch rounds (nearest even). Returns 0, 1 for bad sizes, 2 if memory for widening x ran out. */
static int run(const void *x, int x_bf16, const void *w, const float *bias, void *y, int y_bf16, int64_t M, int64_t N,
               int64_t K, int num_threads, const int bf16) {
    if (M < 1 || N < 1 || K < 1) return 1;
    float *widened;
    const float *xf = as_f32_rows(x, x_bf16, M * K, &widened);
    if (!xf) return 2;
    int64_t num_blocks = (N + NB - 1) / NB;
    if (num_threads < 1 || M * N * K < MIN_PARALLEL_WORK) num_threads = 1;
    if (num_threads > num_blocks) num_threads = (int)num_blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * NB, n1 = n0 + NB < N ? n0 + NB : N;
        if (bf16) block(xf, w, bias, y, y_bf16, M, N, K, n0, n1, 1);
        else block(xf, w, bias, y, y_bf16, M, N, K, n0, n1, 0);
    }
    free(widened);
    return 0;
}

int ember_dense_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
    return run(x, 0, w, bias, y, 0, M, N, K, num_threads, 0);
}

int ember_dense_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int num_threads) {
    return run(x, 0, w, bias, y, 0, M, N, K, num_threads, 1);
}

/* A bfloat16 model's linear: x, w and y bfloat16 (the sums float32, as for every other layout), so a row's bits
 * still never depend on its batch. */
int ember_dense_linear_bf16_io(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int64_t M,
                               int64_t N, int64_t K, int num_threads) {
    return run(x, 1, w, bias, y, 1, M, N, K, num_threads, 1);
}
