/* Paged attention for short query runs (decode, speculative 1 + k tokens) on CPU.
 *
 * One work item per (request, KV head), spread over OpenMP threads. An item walks its request's
 * blocks in place through the block table -- nothing is gathered or copied -- and keeps an online
 * softmax (running max, running sum, accumulator) for every query row that shares the KV head
 * (G query heads x Q query tokens), so each key and value row is read from memory once and used
 * by all of them. Scores and accumulation are float32 whatever the cache dtype.
 *
 * Layouts (row-major, contiguous):
 *   q        [B, Q, H, D]  float32 (the entry point also takes bf16 / strided q), scaled here
 *   q_pos    [B, Q]        int64 context position of each query; -1 marks a padding query
 *   k, v     [N, Hkv, S, D] float32 or bfloat16 (S = block size)
 *   tables   [B, T]        int32 block ids; first_block/end_block [B] int64 bound the blocks read
 *   out      [B, Q, H, D]  float32 (or bf16, see the entry point); a query that sees no key gets zeros
 *
 * Two implementations of one item: a portable one (plain loops, any head size), and on AVX2 + FMA
 * CPUs for head sizes that are a multiple of 8 an explicit one. Decode on a small model is bound by
 * this kernel (a 5M-parameter model reads more KV than weights per step at a few hundred tokens of
 * context), and the portable loops ran at a third of the memory bandwidth: a latency-bound dot per
 * key and row, a scalar expf per score, and a read-modify-write of the accumulator per key. The
 * AVX2 item scores four keys at a time (independent FMA chains, one horizontal reduction for the
 * four), takes exp of a row's block of scores eight lanes at a time, and accumulates values with
 * the accumulator in registers across the block.
 *
 * Batch independence: every row's result depends only on its own query and context. Each score is
 * one accumulator over D in a fixed order; a row's block maximum, exp and sum do not depend on the
 * other rows or on how many keys other rows see. So batching and speculative verification do not
 * change a request's attention output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

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

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_ITEM 1

/* The four horizontal sums of a0..a3, in lanes 0..3. Each sum is ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)),
 * whichever lane its vector came in, so a score does not depend on the keys grouped with it. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* n rows of a block (row stride D) as float32: the rows themselves, or their conversion into buf. */
static inline const float *block_f32(const void *base, int is_bf16, int64_t first_row, int64_t n, int64_t D,
                                     float *buf) {
    if (!is_bf16) return (const float *)base + first_row * D;
    const uint16_t *src = (const uint16_t *)base + first_row * D;
    for (int64_t i = 0; i < n * D; i += 8) _mm256_storeu_ps(buf + i, load8_as_f32(src, i, 1));
    return buf;
}

/* scores[t] = q . keys[t] for t < n, four keys at a time (a partial group pads with zero vectors). */
static inline void score_block(const float *q, const float *keys, int64_t n, int64_t D, float *scores,
                               const char *next_k, const char *next_v, int64_t next_bytes) {
    /* The next block's lines are requested a share per group of keys, not all at once: a burst of a
     * hundred prefetches only waits for the core's few miss buffers. */
    const int64_t span = (next_bytes / (n / 4 + 1) + 63) / 64 * 64;
    int64_t fetched = 0;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        for (int64_t end = fetched + span < next_bytes ? fetched + span : next_bytes; next_k && fetched < end;
             fetched += 64) {
            _mm_prefetch(next_k + fetched, _MM_HINT_T0);
            _mm_prefetch(next_v + fetched, _MM_HINT_T0);
        }
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *k0 = keys + t * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
        }
        _mm_storeu_ps(scores + t, hsum4(a0, a1, a2, a3));
    }
    for (; next_k && fetched < next_bytes; fetched += 64) {
        _mm_prefetch(next_k + fetched, _MM_HINT_T0);
        _mm_prefetch(next_v + fetched, _MM_HINT_T0);
    }
    if (t < n) {
        __m256 acc[3] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; t + i < n; i++)
            for (int64_t d = 0; d < D; d += 8)
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys + (t + i) * D + d), acc[i]);
        float four[4];
        _mm_storeu_ps(four, hsum4(acc[0], acc[1], acc[2], _mm256_setzero_ps()));
        for (int64_t i = 0; t + i < n; i++) scores[t + i] = four[i];
    }
}

/* acc[0:D] = acc * correction + sum over t in [t0, t1) of p[t] * values[t], four vectors of D at a time
 * kept in registers across the keys. */
static inline void accumulate_block(float *acc, float correction, const float *p, const float *values,
                                    int64_t t0, int64_t t1, int64_t D) {
    const __m256 c = _mm256_set1_ps(correction);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c), o1 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8), c);
        __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 16), c), o3 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 24), c);
        for (int64_t t = t0; t < t1; t++) {
            const __m256 pv = _mm256_broadcast_ss(p + t);
            const float *vr = values + t * D + d;
            o0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr), o0);
            o1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8), o1);
            o2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 16), o2);
            o3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 24), o3);
        }
        _mm256_storeu_ps(acc + d, o0);
        _mm256_storeu_ps(acc + d + 8, o1);
        _mm256_storeu_ps(acc + d + 16, o2);
        _mm256_storeu_ps(acc + d + 24, o3);
    }
    for (; d < D; d += 8) {
        __m256 o = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        for (int64_t t = t0; t < t1; t++)
            o = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(values + t * D + d), o);
        _mm256_storeu_ps(acc + d, o);
    }
}

/* The AVX2 item (D a multiple of 8): same contract as attend_item below. */
static int attend_item_avx2(const float *q, const int64_t *q_pos, const void *k, const void *v, int is_bf16,
                            const int32_t *tables, const int64_t *first_block, const int64_t *end_block, float *out,
                            int64_t b, int64_t h, int64_t Q, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                            int64_t T, int64_t window, float scale) {
    const int64_t G = H / Hkv, rows = G * Q, SP = (S + 7) / 8 * 8; /* scores padded to whole vectors */
    float *mem = malloc(sizeof(float) * (size_t)(rows * (2 * D + SP + 2) + 2 * S * D));
    if (!mem) return -1;
    float *acc = mem, *qs = acc + rows * D, *scores = qs + rows * D, *run_max = scores + rows * SP;
    float *run_sum = run_max + rows, *kbuf = run_sum + rows, *vbuf = kbuf + S * D;
    int64_t max_pos = -1;
    for (int64_t j = 0; j < Q; j++) max_pos = q_pos[b * Q + j] > max_pos ? q_pos[b * Q + j] : max_pos;
    memset(acc, 0, sizeof(float) * (size_t)(rows * D));
    for (int64_t r = 0; r < rows; r++) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
        const float *src = q + ((b * Q + r % Q) * H + h * G + r / Q) * D;  /* row r = g * Q + j */
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = src[d] * scale;
    }
    for (int64_t blk_i = first_block[b]; blk_i < end_block[b]; blk_i++) {
        const int64_t p0 = blk_i * S;
        if (p0 > max_pos) break;  /* every later key is in every query's future */
        const int64_t n = (max_pos - p0 + 1) < S ? (max_pos - p0 + 1) : S;  /* keys some query may see */
        const int64_t base = ((int64_t)tables[b * T + blk_i] * Hkv + h) * S;
        const char *next_k = NULL, *next_v = NULL;
        const int64_t esize = is_bf16 ? 2 : 4;
        if (blk_i + 1 < end_block[b] && p0 + S <= max_pos) {
            const int64_t next = ((int64_t)tables[b * T + blk_i + 1] * Hkv + h) * S * D * esize;
            next_k = (const char *)k + next;
            next_v = (const char *)v + next;
        }
        const float *keys = block_f32(k, is_bf16, base, n, D, kbuf);
        const float *values = NULL;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t qp = q_pos[b * Q + r % Q];
            /* Keys [t0, t1) of this block are visible to the row: causal, then the sliding window. */
            const int64_t t1 = qp - p0 + 1 < n ? qp - p0 + 1 : n;
            const int64_t t0 = window > 0 && qp - window + 1 > p0 ? qp - window + 1 - p0 : 0;
            if (t1 <= t0) continue;
            float *sc = scores + r * SP;
            score_block(qs + r * D, keys + t0 * D, t1 - t0, D, sc + t0, r == 0 ? next_k : NULL, next_v,
                        S * D * esize);
            for (int64_t t = 0; t < t0; t++) sc[t] = -INFINITY;
            for (int64_t t = t1; t < SP; t++) sc[t] = -INFINITY;
            __m256 mv = _mm256_set1_ps(-INFINITY);
            for (int64_t t = 0; t < SP; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
            float lanes[8];
            _mm256_storeu_ps(lanes, mv);
            float block_max = lanes[0];
            for (int i = 1; i < 8; i++) block_max = lanes[i] > block_max ? lanes[i] : block_max;
            const float new_max = block_max > run_max[r] ? block_max : run_max[r];
            const float correction = run_max[r] == -INFINITY ? 0.0f : expf(run_max[r] - new_max);
            const __m256 m = _mm256_set1_ps(new_max);
            __m256 sv = _mm256_setzero_ps();
            for (int64_t t = 0; t < SP; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
                _mm256_storeu_ps(sc + t, e);
                sv = _mm256_add_ps(sv, e);
            }
            run_sum[r] = run_sum[r] * correction + hsum(sv);
            run_max[r] = new_max;
            if (!values) values = block_f32(v, is_bf16, base, n, D, vbuf);
            accumulate_block(acc + r * D, correction, sc, values, t0, t1, D);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + ((b * Q + r % Q) * H + h * G + r / Q) * D;
        const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
    free(mem);
    return 0;
}
#endif

/* Below this many multiply-adds (keys x query rows x D, all items) one thread runs the call: a decode
 * step at short context is a few microseconds of work per layer, less than waking a sleeping OpenMP
 * thread costs (~20 us under OMP_WAIT_POLICY=PASSIVE on a 2-vCPU VM). */
#define PARALLEL_MIN_WORK (1 << 18)

/* q may be bfloat16 and strided (a slice of a fused qkv output: token i's heads at q + i * q_stride),
 * and out bfloat16: they are converted here around the float32 items, which is what q.float() before
 * and out.to(bfloat16) after would do, without two torch ops and a copy per layer.
 * Returns 0, or -1 if memory ran out (the caller falls back to its portable path). */
int ember_paged_attention(const void *q, int q_bf16, int64_t q_stride, const int64_t *q_pos, const void *k,
                          const void *v, int is_bf16, const int32_t *tables, const int64_t *first_block,
                          const int64_t *end_block, void *out, int out_bf16, int64_t B, int64_t Q, int64_t H,
                          int64_t Hkv, int64_t D, int64_t S, int64_t T, int64_t window, float scale,
                          int num_threads) {
    const int64_t tokens = B * Q, row = H * D;
    const int pack_q = q_bf16 || q_stride != row;
    float *qf = pack_q ? malloc(sizeof(float) * (size_t)(tokens * row)) : (float *)q;
    float *of = out_bf16 ? malloc(sizeof(float) * (size_t)(tokens * row)) : (float *)out;
    int failed = !qf || !of;
    if (!failed && pack_q)
        for (int64_t i = 0; i < tokens; i++)
            for (int64_t e = 0; e < row; e++) qf[i * row + e] = load_as_f32(q, i * q_stride + e, q_bf16);
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += (end_block[b] - first_block[b]) * S;
    work *= H * Q * D;
    const int64_t items = failed ? 0 : B * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed) \
    if (work >= PARALLEL_MIN_WORK)
    for (int64_t item = 0; item < items; item++) {
#ifdef HAVE_AVX2_ITEM
        if (D % 8 == 0) {
            failed |= attend_item_avx2(qf, q_pos, k, v, is_bf16, tables, first_block, end_block, of, item / Hkv,
                                       item % Hkv, Q, H, Hkv, D, S, T, window, scale) != 0;
            continue;
        }
#endif
        failed |= attend_item(qf, q_pos, k, v, is_bf16, tables, first_block, end_block, of, item / Hkv, item % Hkv,
                              Q, H, Hkv, D, S, T, window, scale) != 0;
    }
    if (!failed && out_bf16)
        for (int64_t i = 0; i < tokens * row; i++) ((uint16_t *)out)[i] = f32_to_bf16(of[i]);
    if (pack_q) free(qf);
    if (out_bf16) free(of);
    return failed ? -1 : 0;
}

/* Store a step's new keys and values in their cache slots (slot = block id * S + offset), for each
 * token t and KV head h: cache row ((slot / S) * Hkv + h) * S + slot % S of D elements. k and v may
 * be strided (token t's heads at k + t * k_stride, as slices of a fused qkv output); the caches'
 * element type must be theirs (esize bytes), so this is a copy. At decode this replaces an index
 * computation and two index_copy_ calls per layer, which cost more than the attention itself.
 * Returns 0, or 1 if a slot is outside the num_blocks-block cache (then nothing is written). */
int ember_write_kv(void *k_cache, void *v_cache, const void *k, const void *v, int64_t k_stride, int64_t v_stride,
                   const int64_t *slots, int64_t T, int64_t Hkv, int64_t S, int64_t D, int64_t num_blocks,
                   int64_t esize) {
    const size_t row_bytes = (size_t)(D * esize);
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * S) return 1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        const int64_t base = (slot / S) * Hkv * S + slot % S;
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t dst = (base + h * S) * D * esize;
            memcpy((char *)k_cache + dst, (const char *)k + (t * k_stride + h * D) * esize, row_bytes);
            memcpy((char *)v_cache + dst, (const char *)v + (t * v_stride + h * D) * esize, row_bytes);
        }
    }
    return 0;
}
