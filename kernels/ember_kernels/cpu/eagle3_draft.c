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
 * in the linear kernel) or int8 with a float32 scale per output row, packed in blocks of 16 outputs (`format`,
 * draft_ops.h): the draft is bound by streaming them (~4 MB in float32 on the example, more than its L2 holds,
 * once per draft position), so narrower weights make a draft position cheaper; norms and the embedding table stay
 * float32.
 * Layouts (row-major, contiguous, float32 unless said): weights as nn.Linear ([out, in]); caches [num_blocks, Hkv, S, hd];
 * table int32 [T], the request's blocks; aux rows: three pointers to [R, D]; cos/sin [R + k - 1, hd].
 * Returns 0; 1 for bad arguments (a block id, position or token out of range); 2 if memory ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "draft_ops.h"

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
    PagedKV kv; /* the head's cache, the request's table and gaps */
    int threads;
} Head;

/* y[M, N] = x[M, K] @ w[N, K].T, w in the head's matrix format. */
static inline void linear(const Head *m, const float *x, int which, float *y, int64_t M, int64_t N, int64_t K,
                          int threads) {
    linear_in_format(m->format, m->w[which], m->scales[which], x, y, M, N, K, threads);
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
                const int64_t at = paged_row(&m->kv, pos[r], g);
                if (at < 0) return 1;
                kd = m->kv.k + at, vd = m->kv.v + at;
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
        if (!paged_context_ok(&m->kv, nc)) return 1;
        for (int64_t head = 0; head < h; head++) {
            const int64_t g = head / group;
            attend(&m->kv, qkv + r * qkv_w + head * hd, g, nc, ek + g * max_extra * hd, ev + g * max_extra * hd, ne,
                   m->scale, scores, att + r * h * hd + head * hd);
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
    return vocab[argmax(logits, m->n)];
}

int ember_eagle3_draft(const float *const *weights, int format, const float *const *scales, const int64_t *dims, float eps, float scale,
                       const float *aux0, const float *aux1, const float *aux2, const int64_t *next_ids,
                       const float *cos, const float *sin, int64_t R, int64_t p0, float *k_cache, float *v_cache,
                       int64_t S, int64_t num_blocks, const int32_t *table, int64_t table_len,
                       const int64_t *gaps, int64_t n_gaps, int64_t k,
                       const int64_t *vocab, float *out, int64_t *tokens, int num_threads) {
    Head m = {weights, format, scales, dims[D_HIDDEN], dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_DIM], dims[D_INTER],
              dims[D_DRAFT_VOCAB], dims[D_VOCAB], eps, scale,
              {k_cache, v_cache, S, num_blocks, dims[D_KV_HEADS], dims[D_HEAD_DIM], table, table_len, gaps, n_gaps},
              num_threads};
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

/* The drafters' packed int8 linear alone (draft_ops.h), for tests: y[M, N] float32. */
int ember_packed_int8_linear(const float *x, const int8_t *w, const float *scale, float *y, int64_t M, int64_t N,
                             int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    packed_int8_linear(x, w, scale, y, M, N, K, num_threads);
    return 0;
}

/* 8 where packed int8 linears round their inputs to int8 (W8A8: a CPU with AVX512-VNNI), else 32. */
int ember_packed_int8_activation_bits(void) { return packed_int8_activation_bits(); }
