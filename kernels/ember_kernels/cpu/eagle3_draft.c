/* EAGLE-3's draft head for one request in one call: the catch-up over the step's kept rows, then a greedy chain.
 *
 * Why: the head is one small decoder layer (on the example model ~1M parameters), so at batch 1 a draft position
 * costs a few microseconds of arithmetic and ~40 torch ops of dispatch (norms, concat, fused qkv, RoPE, a gather of
 * the paged context, a mask, attention, the MLP, the LM head, argmax, the embedding of the drafted token). Those
 * ops cost as much as the target's own step, which is what kept speculation from paying. Here one call runs the
 * whole draft of a request.
 *
 * What it computes (plugins/ember_plugins/speculators/eagle3_model.py is the reference, same weights):
 * Positions in `gaps` (ranges whose K/V the head skipped writing) are masked out of every row's attention.
 *   catch-up, rows r < R at positions p0 + r: hidden = fc(concat(aux0, aux1, aux2)); the layer (below) on
 *     (embed(next_id[r]), hidden), its K/V written to the head's paged cache at the request's slot for p0 + r,
 *     each row attending to the paged positions 0 .. p0 + r; out[r] = the layer's output.
 *   chain, j < k: token j = draft_vocab[argmax(lm_head(norm(h)))] with h = out[R - 1] for j = 0, then the layer on
 *     (embed(token j - 1), h) at position p0 + R - 1 + j, attending to the paged positions 0 .. p0 + R - 1 and the
 *     chain's own keys (kept in a scratch buffer, never in the paged cache: their blocks may not be allocated yet).
 *   the layer on (e, h): x = [rms(e, w_in) | rms(h, w_hidden)]; q, k, v = x @ w_qkv (RoPE on q and k, halves
 *     rotated); a = attention; h2 = h + a @ w_o; out = h2 + w_down(silu(g) * u) with [g | u] = rms(h2, w_post) @ w_gu.
 *
 * Drafts need not be bit-identical to the torch path (the target verifies every draft; only acceptance depends on
 * them), but they are the same math in float32, so they agree but for near-ties.
 *
 * Weights: the matrices (fc, qkv, o, gate_up, down, the LM head's draft rows) float32, bfloat16 (widened exactly
 * in the linear kernel) or int8 with a float32 scale per output row (`format`): the draft is bound by streaming
 * them (~4 MB in float32 on the example, more than its L2 holds, once per draft position), so narrower weights
 * make a draft position cheaper; norms and the embedding table stay float32.
 * Layouts (row-major, contiguous, float32 unless said): weights as nn.Linear ([out, in]); caches [num_blocks, Hkv, S, hd];
 * table int32 [T], the request's blocks; aux rows: three pointers to [R, D]; cos/sin [R + k - 1, hd].
 * Returns 0; 1 for bad arguments (a block id, position or token out of range); 2 if memory ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int ember_dense_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads);
int ember_int8_linear(const void *x, int x_bf16, const int8_t *w, const float *scale, void *y, int y_bf16,
                      int64_t M, int64_t N, int64_t K, int num_threads);
int ember_dense_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads);

/* Order of the weight pointers. */
enum { W_FC, W_IN_NORM, W_HIDDEN_NORM, W_QKV, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_NORM, W_LM_HEAD, W_EMBED };
/* Order of dims. */
enum { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_DRAFT_VOCAB, D_VOCAB, D_COUNT };

typedef struct {
    const float *const *w;
    int format; /* the matrices' (fc, qkv, o, gate_up, down, lm_head): FORMAT_* */
    const float *const *scales; /* FORMAT_INT8: each matrix's per-row scales, by W_* index */
    int64_t d, h, hkv, hd, inter, n, v;
    float eps, scale;
    float *k_cache, *v_cache;
    int64_t s, num_blocks;
    const int32_t *table;
    int64_t table_len;
    const int64_t *gaps; /* [n_gaps, 2]: position ranges [a, b) whose K/V were never written, masked out */
    int64_t n_gaps;
    int threads;
} Head;

enum { FORMAT_F32, FORMAT_BF16, FORMAT_INT8 };

/* y[M, N] = x[M, K] @ w[N, K].T, w in the head's matrix format. */
static inline void linear(const Head *m, const float *x, int which, float *y, int64_t M, int64_t N, int64_t K,
                          int threads) {
    if (m->format == FORMAT_INT8)
        ember_int8_linear(x, 0, (const int8_t *)m->w[which], m->scales[which], y, 0, M, N, K, threads);
    else if (m->format == FORMAT_BF16)
        ember_dense_linear_bf16(x, (const uint16_t *)m->w[which], NULL, y, M, N, K, threads);
    else
        ember_dense_linear_f32(x, m->w[which], NULL, y, M, N, K, threads);
}

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
static void softmax(float *x, int64_t n) {
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
static void score_rows(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
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
static void accumulate_rows(float *o, const float *p, const float *values, int64_t n, int64_t hd) {
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

static void softmax(float *x, int64_t n) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    for (int64_t i = 0; i < n; i++) sum += (x[i] = expf(x[i] - top));
    for (int64_t i = 0; i < n; i++) x[i] /= sum;
}

static void score_rows(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
    for (int64_t t = 0; t < n; t++) scores[t] = dot(q, keys + t * hd, hd) * scale;
}

static void accumulate_rows(float *o, const float *p, const float *values, int64_t n, int64_t hd) {
    for (int64_t t = 0; t < n; t++) axpy(o, p[t], values + t * hd, hd);
}
#endif

static void rms(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = dot(x, x, n);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static void rope(float *x, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* The paged cache row of (position p, KV head g), or NULL if the position's block is not in the table. */
static inline int64_t paged_row(const Head *m, int64_t p, int64_t g) {
    const int64_t b = p / m->s;
    if (b < 0 || b >= m->table_len) return -1;
    const int64_t block = m->table[b];
    if (block < 0 || block >= m->num_blocks) return -1;
    return ((block * m->hkv + g) * m->s + p % m->s) * m->hd;
}

/* The layer over R rows. Row r's own K/V go to the paged cache at position pos[r] (extra_index[r] < 0) or to the
 * scratch keys at extra_index[r]; it attends to paged positions 0 .. ctx[r] - 1 and scratch keys
 * 0 .. n_extra[r] - 1. scratch: work memory (layer_scratch floats). Returns 0 or 1 (a position off the table). */
static int64_t layer_scratch(const Head *m, int64_t R, int64_t max_keys) {
    return R * (2 * m->d + (m->h + 2 * m->hkv) * m->hd + m->h * m->hd + m->d + m->d + 2 * m->inter + m->inter)
           + max_keys;
}

static int layer(const Head *m, int64_t R, const float *embeds, const float *hidden, float *out, const float *cos,
                 const float *sin, const int64_t *pos, const int64_t *ctx, float *ek, float *ev,
                 const int64_t *extra_index, const int64_t *n_extra, int64_t max_extra, float *scratch) {
    const int64_t d = m->d, hd = m->hd, h = m->h, hkv = m->hkv, qkv_w = (h + 2 * hkv) * hd, inter = m->inter;
    float *x = scratch, *qkv = x + R * 2 * d, *att = qkv + R * qkv_w, *h2 = att + R * h * hd, *x2 = h2 + R * d;
    float *gu = x2 + R * d, *act = gu + R * 2 * inter, *scores = act + R * inter;
    for (int64_t r = 0; r < R; r++) {
        rms(embeds + r * d, m->w[W_IN_NORM], x + r * 2 * d, d, m->eps);
        rms(hidden + r * d, m->w[W_HIDDEN_NORM], x + r * 2 * d + d, d, m->eps);
    }
    linear(m, x, W_QKV, qkv, R, qkv_w, 2 * d, m->threads);
    for (int64_t r = 0; r < R; r++) {
        float *row = qkv + r * qkv_w;
        for (int64_t i = 0; i < h + hkv; i++) rope(row + i * hd, cos + r * hd, sin + r * hd, hd);
        for (int64_t g = 0; g < hkv; g++) {
            const float *kk = row + (h + g) * hd, *vv = row + (h + hkv + g) * hd;
            float *kd, *vd;
            if (extra_index[r] < 0) {
                const int64_t at = paged_row(m, pos[r], g);
                if (at < 0) return 1;
                kd = m->k_cache + at, vd = m->v_cache + at;
            } else {
                kd = ek + (g * max_extra + extra_index[r]) * hd, vd = ev + (g * max_extra + extra_index[r]) * hd;
            }
            memcpy(kd, kk, sizeof(float) * (size_t)hd);
            memcpy(vd, vv, sizeof(float) * (size_t)hd);
        }
    }
    const int64_t group = h / hkv;
    for (int64_t r = 0; r < R; r++) {
        const int64_t nc = ctx[r], ne = n_extra[r];
        if (nc > 0 && (nc - 1) / m->s >= m->table_len) return 1;
        for (int64_t b = 0; b * m->s < nc; b++)
            if (m->table[b] < 0 || m->table[b] >= m->num_blocks) return 1;
        for (int64_t head = 0; head < h; head++) {
            const int64_t g = head / group;
            const float *q = qkv + r * qkv_w + head * hd;
            /* Scores: the paged context block by block (each block's rows of KV head g are contiguous), then the
             * scratch keys; one max, exp and sum over all. */
            for (int64_t b = 0; b * m->s < nc; b++) {
                const float *keys = m->k_cache + ((int64_t)m->table[b] * hkv + g) * m->s * hd;
                const int64_t n = nc - b * m->s < m->s ? nc - b * m->s : m->s;
                score_rows(q, keys, n, hd, m->scale, scores + b * m->s);
            }
            for (int64_t i = 0; i < m->n_gaps; i++)
                for (int64_t p = m->gaps[2 * i] > 0 ? m->gaps[2 * i] : 0; p < m->gaps[2 * i + 1] && p < nc; p++)
                    scores[p] = -INFINITY;
            for (int64_t e = 0; e < ne; e++) scores[nc + e] = dot(q, ek + (g * max_extra + e) * hd, hd) * m->scale;
            softmax(scores, nc + ne);
            float *o = att + r * h * hd + head * hd;
            memset(o, 0, sizeof(float) * (size_t)hd);
            for (int64_t b = 0; b * m->s < nc; b++) {
                const float *values = m->v_cache + ((int64_t)m->table[b] * hkv + g) * m->s * hd;
                const int64_t n = nc - b * m->s < m->s ? nc - b * m->s : m->s;
                accumulate_rows(o, scores + b * m->s, values, n, hd);
            }
            for (int64_t e = 0; e < ne; e++) axpy(o, scores[nc + e], ev + (g * max_extra + e) * hd, hd);
        }
    }
    linear(m, att, W_O, h2, R, d, h * hd, m->threads);
    for (int64_t r = 0; r < R; r++) {
        for (int64_t i = 0; i < d; i++) h2[r * d + i] += hidden[r * d + i];
        rms(h2 + r * d, m->w[W_POST_NORM], x2 + r * d, d, m->eps);
    }
    linear(m, x2, W_GATE_UP, gu, R, 2 * inter, d, m->threads);
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < inter; i++) {
            const float g = gu[r * 2 * inter + i];
            act[r * inter + i] = g / (1.0f + expf(-g)) * gu[r * 2 * inter + inter + i];
        }
    linear(m, act, W_DOWN, out, R, d, inter, m->threads);
    for (int64_t i = 0; i < R * d; i++) out[i] += h2[i];
    return 0;
}

/* The head's greedy choice from its output h: a target token id. */
static int64_t choose(const Head *m, const int64_t *vocab, const float *h, float *normed, float *logits) {
    rms(h, m->w[W_NORM], normed, m->d, m->eps);
    linear(m, normed, W_LM_HEAD, logits, 1, m->n, m->d, 1);
    int64_t best = 0;
    for (int64_t i = 1; i < m->n; i++)
        if (logits[i] > logits[best]) best = i;  /* the first of equal maxima, as torch.argmax */
    return vocab[best];
}

int ember_eagle3_draft(const float *const *weights, int format, const float *const *scales, const int64_t *dims, float eps, float scale,
                       const float *aux0, const float *aux1, const float *aux2, const int64_t *next_ids,
                       const float *cos, const float *sin, int64_t R, int64_t p0, float *k_cache, float *v_cache,
                       int64_t S, int64_t num_blocks, const int32_t *table, int64_t table_len,
                       const int64_t *gaps, int64_t n_gaps, int64_t k,
                       const int64_t *vocab, float *out, int64_t *tokens, int num_threads) {
    Head m = {weights, format, scales, dims[D_HIDDEN], dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_DIM], dims[D_INTER],
              dims[D_DRAFT_VOCAB], dims[D_VOCAB], eps, scale, k_cache, v_cache, S, num_blocks, table, table_len,
              gaps, n_gaps, num_threads};
    if (R < 1 || k < 0 || p0 < 0 || m.hkv < 1 || m.h % m.hkv != 0 || m.hd % 2 != 0 || S < 1) return 1;
    for (int64_t r = 0; r < R; r++)
        if (next_ids[r] < 0 || next_ids[r] >= m.v) return 1;
    const int64_t d = m.d, extra = k > 1 ? k - 1 : 1, last = p0 + R - 1;
    const int64_t rows = R > 1 ? R : 1, need = layer_scratch(&m, rows, last + 1 + extra);
    const int64_t small = 3 * R * d + R * d + R * d + 2 * R + 2 * R + 2 * extra * m.hkv * m.hd + 3 * d + m.n;
    float *work = malloc(sizeof(float) * (size_t)(need + small));
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(5 * R + 5));
    if (!work || !idx) {
        free(work), free(idx);
        return 2;
    }
    float *scratch = work, *cat = scratch + need, *hidden = cat + 3 * R * d, *embeds = hidden + R * d;
    float *ek = embeds + R * d + 4 * R, *ev = ek + extra * m.hkv * m.hd, *h = ev + extra * m.hkv * m.hd;
    float *normed = h + d, *next_h = normed + d, *logits = next_h + d;
    int64_t *pos = idx, *ctx = pos + R, *xi = ctx + R, *ne = xi + R;
    int rc = 0;
    /* catch-up */
    for (int64_t r = 0; r < R; r++) {
        memcpy(cat + r * 3 * d, aux0 + r * d, sizeof(float) * (size_t)d);
        memcpy(cat + r * 3 * d + d, aux1 + r * d, sizeof(float) * (size_t)d);
        memcpy(cat + r * 3 * d + 2 * d, aux2 + r * d, sizeof(float) * (size_t)d);
        memcpy(embeds + r * d, weights[W_EMBED] + next_ids[r] * d, sizeof(float) * (size_t)d);
        pos[r] = p0 + r, ctx[r] = p0 + r + 1, xi[r] = -1, ne[r] = 0;
    }
    linear(&m, cat, W_FC, hidden, R, d, 3 * d, num_threads);
    rc = layer(&m, R, embeds, hidden, out, cos, sin, pos, ctx, ek, ev, xi, ne, extra, scratch);
    /* chain */
    memcpy(h, out + (R - 1) * d, sizeof(float) * (size_t)d);
    for (int64_t j = 0; rc == 0 && j < k; j++) {
        tokens[j] = choose(&m, vocab, h, normed, logits);
        if (tokens[j] < 0 || tokens[j] >= m.v) {
            rc = 1;
            break;
        }
        if (j + 1 == k) break;
        const int64_t p = last + 1 + j, c = last + 1, x = j, n_e = j + 1;
        rc = layer(&m, 1, weights[W_EMBED] + tokens[j] * d, h, next_h, cos + (R + j) * m.hd, sin + (R + j) * m.hd,
                   &p, &c, ek, ev, &x, &n_e, extra, scratch);
        memcpy(h, next_h, sizeof(float) * (size_t)d);
    }
    free(work);
    free(idx);
    return rc;
}
