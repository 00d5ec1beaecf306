/* Paged attention for short query runs (decode, speculative 1 + k tokens) on CPU.
 *
 * One work item per (request, KV head), spread over OpenMP threads. An item walks its request's
 * blocks in place through the block table -- nothing is gathered or copied -- and keeps an online
 * softmax (running max, running sum, accumulator) for every query row that shares the KV head
 * (G query heads x Q query tokens), so each key and value row is read from memory once and used
 * by all of them. Scores and accumulation are float32 whatever the cache dtype.
 *
 * Layouts (row-major, contiguous):
 *   q        [B, Q, H, D]  float32, pre-scaling is done here (scale)
 *   q_pos    [B, Q]        int64 context position of each query; -1 marks a padding query
 *   k, v     [N, Hkv, S, D] float32 or bfloat16 (S = block size)
 *   tables   [B, T]        int32 block ids; first_block/end_block [B] int64 bound the blocks read
 *   out      [B, Q, H, D]  float32; a query that sees no key gets zeros
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* A key or value row as float32: the row itself, or its conversion into buf. */
static inline const float *row_f32(const void *base, int is_bf16, int64_t index, int64_t D, float *buf) {
    if (!is_bf16) return (const float *)base + index * D;
    const uint16_t *src = (const uint16_t *)base + index * D;
    for (int64_t i = 0; i < D; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

static int attend_item(const float *q, const int64_t *q_pos, const void *k, const void *v, int is_bf16,
                       const int32_t *tables, const int64_t *first_block, const int64_t *end_block, float *out,
                       int64_t b, int64_t h, int64_t Q, int64_t H, int64_t Hkv, int64_t D, int64_t S, int64_t T,
                       int64_t window, float scale) {
    const int64_t G = H / Hkv, rows = G * Q;
    float *mem = malloc(sizeof(float) * (size_t)(rows * (D + S + 2) + 2 * D));
    if (!mem) return -1;
    float *acc = mem, *scores = acc + rows * D, *run_max = scores + rows * S, *run_sum = run_max + rows;
    float *kbuf = run_sum + rows, *vbuf = kbuf + D;
    int64_t max_pos = -1;
    for (int64_t j = 0; j < Q; j++) max_pos = q_pos[b * Q + j] > max_pos ? q_pos[b * Q + j] : max_pos;
    memset(acc, 0, sizeof(float) * (size_t)(rows * D));
    for (int64_t r = 0; r < rows; r++) { run_max[r] = -INFINITY; run_sum[r] = 0.0f; }

    for (int64_t blk_i = first_block[b]; blk_i < end_block[b]; blk_i++) {
        const int64_t p0 = blk_i * S;
        if (p0 > max_pos) break;  /* every later key is in every query's future */
        const int64_t n = (max_pos - p0 + 1) < S ? (max_pos - p0 + 1) : S;  /* keys some query may see */
        const int64_t base = ((int64_t)tables[b * T + blk_i] * Hkv + h) * S;
        for (int64_t t = 0; t < n; t++) {
            const float *krow = row_f32(k, is_bf16, base + t, D, kbuf);
            for (int64_t j = 0; j < Q; j++) {
                const int64_t qp = q_pos[b * Q + j], p = p0 + t;
                const int visible = p <= qp && (window <= 0 || p > qp - window);
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = g * Q + j;
                    scores[r * S + t] = visible ? scale * dot(q + ((b * Q + j) * H + h * G + g) * D, krow, D)
                                                : -INFINITY;
                }
            }
        }
        /* Online softmax update per row: rescale what was accumulated if the max grew. */
        for (int64_t r = 0; r < rows; r++) {
            float block_max = -INFINITY;
            for (int64_t t = 0; t < n; t++) block_max = scores[r * S + t] > block_max ? scores[r * S + t] : block_max;
            if (block_max == -INFINITY) { for (int64_t t = 0; t < n; t++) scores[r * S + t] = 0.0f; continue; }
            const float new_max = block_max > run_max[r] ? block_max : run_max[r];
            const float correction = run_max[r] == -INFINITY ? 0.0f : expf(run_max[r] - new_max);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const float e = scores[r * S + t] == -INFINITY ? 0.0f : expf(scores[r * S + t] - new_max);
                scores[r * S + t] = e;
                sum += e;
            }
            run_sum[r] = run_sum[r] * correction + sum;
            run_max[r] = new_max;
            if (correction != 1.0f) {
                float *a = acc + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] *= correction;
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const float *vrow = row_f32(v, is_bf16, base + t, D, vbuf);
            for (int64_t r = 0; r < rows; r++)
                if (scores[r * S + t] != 0.0f) axpy(acc + r * D, scores[r * S + t], vrow, D);
        }
    }
    for (int64_t j = 0; j < Q; j++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = g * Q + j;
            float *o = out + ((b * Q + j) * H + h * G + g) * D;
            const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
            for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
        }
    free(mem);
    return 0;
}

/* Returns 0, or -1 if memory ran out (the caller falls back to its portable path). */
int ember_paged_attention(const float *q, const int64_t *q_pos, const void *k, const void *v, int is_bf16,
                          const int32_t *tables, const int64_t *first_block, const int64_t *end_block, float *out,
                          int64_t B, int64_t Q, int64_t H, int64_t Hkv, int64_t D, int64_t S, int64_t T,
                          int64_t window, float scale, int num_threads) {
    int failed = 0;
    const int64_t items = B * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < items; item++)
        failed |= attend_item(q, q_pos, k, v, is_bf16, tables, first_block, end_block, out, item / Hkv, item % Hkv,
                              Q, H, Hkv, D, S, T, window, scale) != 0;
    return failed ? -1 : 0;
}
