/* A Llama draft model's step for one request in one call: the pass over the tokens its cache lacks, then a greedy
 * chain of k drafts.
 *
 * Why: a draft model small enough to pay (the example's: 2 layers of width 128, ~0.9M parameters) is a few
 * microseconds of arithmetic per position, while a pass through torch ops costs ~25 op dispatches per layer, and
 * at batch 1 the three passes of a step cost about half the target's own step: the draft ran at 1.2x of no
 * speculation with 2.6 tokens accepted per step. Here one call does a request's whole step.
 *
 * What it computes (the engine's Llama, plugins/ember_plugins/speculators/draft_chain.py being the torch path):
 *   catch-up, rows r < R (tokens ids[r] at positions p0 + r): x = embed(ids); per layer: a = attention of
 *     rms(x, w_in) @ w_qkv (RoPE on q and k, halves rotated) over the paged positions 0 .. p0 + r, its K/V first
 *     written to the layer's paged cache at the request's slot for p0 + r; x += a @ w_o; x += w_down(silu(g) * u)
 *     with [g | u] = rms(x, w_post) @ w_gate_up. Token 0 = argmax(lm_head(rms(x[R - 1], w_norm))). The last layer
 *     runs its attention and MLP for the last row only (the others' K/V is all that is kept of them).
 *   chain, j = 1 .. k - 1: the same on token j - 1 at position p0 + R - 1 + j, attending to the paged positions
 *     0 .. p0 + R - 1 and the chain's own keys, which stay in a scratch buffer (their blocks may not be allocated,
 *     and they are guesses the next step rewrites): token j = its argmax.
 * Drafts need not be bit-identical to the torch path (the target verifies every draft; only acceptance depends on
 * them): in float32 they agree but for near-ties.
 *
 * Weights: pointers in the order W_* then L_* per layer; the matrices (qkv, o, gate_up, down, lm_head) float32,
 * bfloat16 or int8 with a float32 scale per output row, packed in blocks of 16 outputs (`format`, draft_ops.h);
 * norms and the embedding float32.
 * A draft position streams every matrix (the example's are 3.7 MB in float32, more than a core's L2 cache), so
 * narrower ones make a draft position cheaper.
 * Layouts (row-major, contiguous): matrices as nn.Linear ([out, in]); caches per layer [num_blocks, Hkv, S, hd]
 * float32; table int32 [T], the request's blocks; cos/sin [R + k - 1, hd] for positions p0 ...
 * Returns 0; 1 for bad arguments (a token, block id or position out of range); 2 if memory ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "draft_ops.h"

/* The model's weights, then each layer's L_COUNT. */
enum { W_EMBED, W_NORM, W_LM_HEAD, W_GLOBAL };
enum { L_IN_NORM, L_QKV, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, L_COUNT };
/* Order of dims. */
enum { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_LAYERS, D_COUNT };

typedef struct {
    const void *const *w;
    const float *const *scales; /* FORMAT_INT8: each matrix's per-row scales, by weight index */
    int format;
    int64_t d, h, hkv, hd, inter, v, layers;
    float eps, scale;
    PagedKV *kv; /* per layer */
    int threads;
} Model;

static inline const float *norm_weight(const Model *m, int64_t layer, int which) {
    return (const float *)m->w[W_GLOBAL + layer * L_COUNT + which];
}

/* y[M, N] = x[M, K] @ w.T for the matrix at weight index `index`. */
static inline void matmul(const Model *m, int64_t index, const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    linear_in_format(m->format, m->w[index], m->scales[index], x, y, M, N, K, m->threads);
}

static int64_t decoder_scratch(const Model *m, int64_t R, int64_t max_keys) {
    return R * (m->d + (m->h + 2 * m->hkv) * m->hd + m->h * m->hd + m->d + 3 * m->inter) + max_keys;
}

/* Every layer over R rows of the residual stream x [R, d], in place. Row r is at position pos[r]; its K/V go to
 * the paged cache (extra_index < 0) or to slot extra_index of the scratch keys (ek / ev: per layer
 * [hkv, max_extra, hd]); it attends to paged positions 0 .. ctx[r] - 1 and scratch keys 0 .. n_extra - 1.
 * last_only: the last layer's attention and MLP for row R - 1 only (x[R - 1] is then the only row that is right).
 * Returns 0 or 1 (a position off the table). */
static int decoder(const Model *m, int64_t R, float *x, const float *cos, const float *sin, const int64_t *pos,
                   const int64_t *ctx, float *ek, float *ev, int64_t extra_index, int64_t n_extra, int64_t max_extra,
                   int last_only, float *scratch) {
    const int64_t d = m->d, hd = m->hd, h = m->h, hkv = m->hkv, qkv_w = (h + 2 * hkv) * hd, inter = m->inter;
    const int64_t group = h / hkv;
    float *normed = scratch, *qkv = normed + R * d, *att = qkv + R * qkv_w, *tmp = att + R * h * hd;
    float *gu = tmp + R * d, *scores = gu + R * 3 * inter;
    for (int64_t l = 0; l < m->layers; l++) {
        const int64_t base = W_GLOBAL + l * L_COUNT;
        const PagedKV *kv = &m->kv[l];
        float *ekl = ek + l * hkv * max_extra * hd, *evl = ev + l * hkv * max_extra * hd;
        for (int64_t r = 0; r < R; r++) rms(x + r * d, norm_weight(m, l, L_IN_NORM), normed + r * d, d, m->eps);
        matmul(m, base + L_QKV, normed, qkv, R, qkv_w, d);
        for (int64_t r = 0; r < R; r++) {
            float *row = qkv + r * qkv_w;
            for (int64_t i = 0; i < h + hkv; i++) rope(row + i * hd, cos + r * hd, sin + r * hd, hd);
            for (int64_t g = 0; g < hkv; g++) {
                float *kd, *vd;
                if (extra_index < 0) {
                    const int64_t at = paged_row(kv, pos[r], g);
                    if (at < 0) return 1;
                    kd = kv->k + at, vd = kv->v + at;
                } else {
                    kd = ekl + (g * max_extra + extra_index) * hd, vd = evl + (g * max_extra + extra_index) * hd;
                }
                memcpy(kd, row + (h + g) * hd, sizeof(float) * (size_t)hd);
                memcpy(vd, row + (h + hkv + g) * hd, sizeof(float) * (size_t)hd);
            }
        }
        const int64_t first = last_only && l == m->layers - 1 ? R - 1 : 0, n = R - first;
        for (int64_t r = first; r < R; r++) {
            if (!paged_context_ok(kv, ctx[r])) return 1;
            for (int64_t head = 0; head < h; head++) {
                const int64_t g = head / group;
                attend(kv, qkv + r * qkv_w + head * hd, g, ctx[r], ekl + g * max_extra * hd,
                       evl + g * max_extra * hd, n_extra, m->scale, scores, att + r * h * hd + head * hd);
            }
        }
        float *xs = x + first * d;
        matmul(m, base + L_O, att + first * h * hd, tmp, n, d, h * hd);
        for (int64_t i = 0; i < n * d; i++) xs[i] += tmp[i];
        for (int64_t r = 0; r < n; r++) rms(xs + r * d, norm_weight(m, l, L_POST_NORM), normed + r * d, d, m->eps);
        matmul(m, base + L_GATE_UP, normed, gu, n, 2 * inter, d);
        float *act = gu + n * 2 * inter;
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gu[r * 2 * inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * gu[r * 2 * inter + inter + i];
            }
        matmul(m, base + L_DOWN, act, tmp, n, d, inter);
        for (int64_t i = 0; i < n * d; i++) xs[i] += tmp[i];
    }
    return 0;
}

/* The greedy token after residual-stream row x. */
static int64_t choose(const Model *m, const float *x, float *normed, float *logits) {
    rms(x, (const float *)m->w[W_NORM], normed, m->d, m->eps);
    matmul(m, W_LM_HEAD, normed, logits, 1, m->v, m->d);
    return argmax(logits, m->v);
}

int ember_draft_llama(const void *const *weights, const float *const *scales, int format, const int64_t *dims,
                      float eps, float scale, const int64_t *ids, int64_t R, int64_t p0, const float *cos,
                      const float *sin, float *const *k_caches, float *const *v_caches, int64_t S,
                      int64_t num_blocks, const int32_t *table, int64_t table_len, int64_t k, int64_t *tokens,
                      int num_threads) {
    Model m = {weights, scales, format, dims[D_HIDDEN], dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_DIM],
               dims[D_INTER], dims[D_VOCAB], dims[D_LAYERS], eps, scale, NULL, num_threads};
    if (R < 1 || k < 1 || p0 < 0 || m.layers < 1 || m.hkv < 1 || m.h % m.hkv != 0 || m.hd % 2 != 0 || S < 1)
        return 1;
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= m.v) return 1;
    const int64_t d = m.d, extra = k > 1 ? k - 1 : 1, last = p0 + R - 1;
    const int64_t need = decoder_scratch(&m, R, last + 1 + extra);
    const int64_t keys = 2 * m.layers * m.hkv * extra * m.hd;
    float *work = malloc(sizeof(float) * (size_t)(need + keys + R * d + 2 * d + m.v));
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(2 * R));
    PagedKV *kv = malloc(sizeof(PagedKV) * (size_t)m.layers);
    if (!work || !idx || !kv) {
        free(work), free(idx), free(kv);
        return 2;
    }
    for (int64_t l = 0; l < m.layers; l++)
        kv[l] = (PagedKV){k_caches[l], v_caches[l], S, num_blocks, m.hkv, m.hd, table, table_len, NULL, 0};
    m.kv = kv;
    float *scratch = work, *ek = scratch + need, *ev = ek + keys / 2, *x = ev + keys / 2, *normed = x + R * d;
    float *logits = normed + d;
    int64_t *pos = idx, *ctx = idx + R;
    for (int64_t r = 0; r < R; r++) {
        memcpy(x + r * d, (const float *)weights[W_EMBED] + ids[r] * d, sizeof(float) * (size_t)d);
        pos[r] = p0 + r, ctx[r] = p0 + r + 1;
    }
    int rc = decoder(&m, R, x, cos, sin, pos, ctx, ek, ev, -1, 0, extra, 1, scratch);
    float *h = x + (R - 1) * d;
    for (int64_t j = 0; rc == 0 && j < k; j++) {
        tokens[j] = choose(&m, h, normed, logits);
        if (j + 1 == k) break;
        const int64_t p = last + j + 1, c = last + 1;
        memcpy(h, (const float *)weights[W_EMBED] + tokens[j] * d, sizeof(float) * (size_t)d);
        rc = decoder(&m, 1, h, cos + (R + j) * m.hd, sin + (R + j) * m.hd, &p, &c, ek, ev, j, j + 1, extra, 0,
                     scratch);
    }
    free(work), free(idx), free(kv);
    return rc;
}
