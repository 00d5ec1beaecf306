/* Weight-only quantized linears on CPU: y[M, N] = x[M, K] @ (w[N, K] * scale[N]).T, computed in float32,
 * for int8 weights and fp8 e4m3 (torch.float8_e4m3fn) weights; and the exact widening of such weights into
 * float32 or bfloat16 tiles, for the large-batch path that hands them to a dense GEMM.
 *
 * Decode is bound by reading weights: the linears stream each quantized weight row from memory and widen it
 * to float32 in registers, so they move a quarter of the bytes of an fp32 GEMV (torch's _weight_int8pack_mm
 * reached ~2 GB/s on an AVX2 CPU, this ~6-9 GB/s, the machine's bandwidth).
 *
 * Work: output rows in blocks of NB, spread over OpenMP threads; within a block, activation rows in
 * groups of up to MG, so a block's weights (NB x K bytes) stay in L1/L2 while every group uses them.
 * Every (m, n) is the same sequence of float operations whatever M and the grouping are, so a row's
 * result never depends on the rows batched with it (batching and speculation leave greedy output alone).
 * Beyond a few rows the widening and FMAs (8 lanes, 16 with AVX-512) cost more than a bf16 GEMM library's
 * arithmetic, so callers switch to `ember_widen_weights` + a GEMM there (see ember_kernels.cpu.quantized_linear).
 *
 * e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities) decodes as a float16 by bit moves:
 * its 7 magnitude bits moved under a float16's exponent field (bit 7 up) and its sign to bit 15 make a float16
 * equal to the value times 2^-8, for normal and subnormal e4m3 alike (an e4m3 subnormal lands on a float16
 * subnormal), and the F16C conversion widens it to float32 exactly. The 2^-8 is folded into the channel scale
 * (a power of two: the products and sums are the same numbers scaled, exactly). 4 ops per 8 weights where int8
 * takes 2; a float32 bit layout instead took 7. The NaN codes (0x7f, 0xff) decode to +-480: quantizers never
 * store them.
 *
 * Layouts (row-major, contiguous): x [M, K] float32 or bfloat16, w [N, K] int8 or e4m3 bytes, scale [N]
 * float32, y [M, N] float32 or bfloat16. bf16 activations are widened once (exact) and bf16 outputs rounded
 * from the float32 result, as x.float() before and y.to(bfloat16) after would: the same numbers, two torch
 * ops fewer per linear (they cost about as much as a small layer's weights at decode).
 * Returns 0, 1 for bad sizes, or 2 if memory for widening x ran out.
 */
#include <stdint.h>
#include <stdlib.h>

#define NB 16 /* output rows per work item */
/* Below this many multiply-adds one thread: waking another (OpenMP, passive wait) costs more than it saves, as
 * for the dense linears (dense_linear.c); at batch 1 a small model's every linear, and a drafter's, is below it. */
#ifndef MIN_PARALLEL_WORK
#define MIN_PARALLEL_WORK (1 << 20)
#endif
#define MG 4  /* activation rows per pass over a weight row: 4 accumulators + 4 widened weights fit in registers */

#define KIND_INT8 0
#define KIND_E4M3 1

#include "simd.h"

/* What the decoded weights are multiplied by (see above): 1 for int8, 2^-8 for e4m3. */
#define E4M3_UNIT 0x1p-8f
#define UNIT(kind) ((kind) == KIND_E4M3 ? E4M3_UNIT : 1.0f)

/* e4m3 -> float32 times 2^-8 (the float32 layout trick: the magnitude bits under the exponent at bit 20 give the
 * value times 2^-120; times 2^112 is exact). */
static inline float e4m3_to_f32_unit(uint8_t b) {
    uint32_t u = ((uint32_t)(b & 0x7f) << 20) | ((uint32_t)(b & 0x80) << 24);
    float f;
    memcpy(&f, &u, sizeof f);
    return f * 0x1p112f;
}

/* Weight i decoded, times UNIT(kind). */
static inline float weight_to_f32(const uint8_t *w, int64_t i, const int kind) {
    return kind == KIND_E4M3 ? e4m3_to_f32_unit(w[i]) : (float)((const int8_t *)w)[i];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* 8 weights from w as float32 times UNIT(kind), exactly. `kind` is a compile-time constant after inlining. */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *w, const int kind) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)w);
    if (kind == KIND_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    /* byte << 8: sign at bit 15, magnitude at 8..14; >> 1 (arithmetic): magnitude at 7..13, the sign copied into
     * bit 14 too, which the mask clears. */
    const __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8), 1),
                                       _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(half);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 weights from w as float32 times UNIT(kind), exactly (as widen8 below, 16 lanes). */
static inline __attribute__((always_inline)) __m512 widen16(const uint8_t *w, const int kind) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)w);
    if (kind == KIND_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8), 1),
                                          _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(half);
}

/* The AVX-512 build of row_dots (below): 16-lane accumulators, half the widening and FMA instructions per weight.
 * At a few rows the 8-lane loop was bound by them, not by the bytes it streams: llama-150m's gate_up at 4 rows took
 * longer in int8 than the bf16 native kernel (AVX-512) did. Each (m, n) is one 16-lane accumulator in ascending k,
 * a fixed horizontal sum, then the scalar tail: the same operations whatever M. */
static inline __attribute__((always_inline)) void row_dots(const float *x, const uint8_t *w, int64_t K,
                                                           const int mg, const int kind, float *out) {
    __m512 acc[MG];
    for (int m = 0; m < mg; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512 w0 = widen16(w + k, kind), w1 = widen16(w + k + 16, kind), w2 = widen16(w + k + 32, kind),
               w3 = widen16(w + k + 48, kind);
        for (int m = 0; m < mg; m++) {
            const float *xm = x + m * K + k;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xm), w0);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), w1, a);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 32), w2, a);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 48), w3, a);
            acc[m] = _mm512_add_ps(acc[m], a);
        }
    }
    for (; k + 16 <= K; k += 16) {
        __m512 w0 = widen16(w + k, kind);
        for (int m = 0; m < mg; m++) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc[m]);
    }
    for (int m = 0; m < mg; m++) {
        float s = _mm512_reduce_add_ps(acc[m]);
        for (int64_t j = k; j < K; j++) s += x[m * K + j] * weight_to_f32(w, j, kind);
        out[m] = s;
    }
}
#else
/* Dot products of one weight row with `mg` (<= MG, a compile-time constant after inlining) rows of x. */
static inline __attribute__((always_inline)) void row_dots(const float *x, const uint8_t *w, int64_t K,
                                                           const int mg, const int kind, float *out) {
    __m256 acc[MG];
    for (int m = 0; m < mg; m++) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 w0 = widen8(w + k, kind), w1 = widen8(w + k + 8, kind), w2 = widen8(w + k + 16, kind),
               w3 = widen8(w + k + 24, kind);
        for (int m = 0; m < mg; m++) {
            const float *xm = x + m * K + k;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xm), w0);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w1, a);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w2, a);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w3, a);
            acc[m] = _mm256_add_ps(acc[m], a);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = widen8(w + k, kind);
        for (int m = 0; m < mg; m++) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m]);
    }
    for (int m = 0; m < mg; m++) {
        float s = hsum(acc[m]);
        for (int64_t j = k; j < K; j++) s += x[m * K + j] * weight_to_f32(w, j, kind);
        out[m] = s;
    }
}
#endif
#else
static inline void row_dots(const float *x, const uint8_t *w, int64_t K, const int mg, const int kind,
                            float *out) {
    for (int m = 0; m < mg; m++) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += x[m * K + k] * weight_to_f32(w, k, kind);
        out[m] = s;
    }
}
#endif

static inline __attribute__((always_inline)) void block(const float *x, const uint8_t *w, const float *scale,
                                                        void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                                                        int64_t n0, int64_t n1, const int kind) {
    float dots[MG];
    for (int64_t m0 = 0; m0 < M; m0 += MG) {
        int64_t mg = M - m0 < MG ? M - m0 : MG;
        const float *xg = x + m0 * K;
        for (int64_t n = n0; n < n1; n++) {
            switch (mg) { /* constant group sizes, so the accumulators stay in registers */
                case 4: row_dots(xg, w + n * K, K, 4, kind, dots); break;
                case 3: row_dots(xg, w + n * K, K, 3, kind, dots); break;
                case 2: row_dots(xg, w + n * K, K, 2, kind, dots); break;
                default: row_dots(xg, w + n * K, K, 1, kind, dots); break;
            }
            const float channel = scale[n] / UNIT(kind); /* exact: a power of two */
            for (int64_t m = 0; m < mg; m++) store_from_f32(y, (m0 + m) * N + n, dots[m] * channel, y_bf16);
        }
    }
}

static int run(const void *x, int x_bf16, const uint8_t *w, const float *scale, void *y, int y_bf16, int64_t M,
               int64_t N, int64_t K, int num_threads, const int kind) {
    if (M < 1 || N < 1 || K < 1) return 1;
    float *widened;
    const float *xf = as_f32_rows(x, x_bf16, M * K, &widened);
    if (!xf) return 2;
    int64_t num_blocks = (N + NB - 1) / NB;
    if (num_threads < 1 || M * N * K < MIN_PARALLEL_WORK) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * NB, n1 = n0 + NB < N ? n0 + NB : N;
        if (kind == KIND_E4M3) block(xf, w, scale, y, y_bf16, M, N, K, n0, n1, KIND_E4M3);
        else block(xf, w, scale, y, y_bf16, M, N, K, n0, n1, KIND_INT8);
    }
    free(widened);
    return 0;
}

int ember_int8_linear(const void *x, int x_bf16, const int8_t *w, const float *scale, void *y, int y_bf16,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    return run(x, x_bf16, (const uint8_t *)w, scale, y, y_bf16, M, N, K, num_threads, KIND_INT8);
}

int ember_fp8_linear(const void *x, int x_bf16, const uint8_t *w, const float *scale, void *y, int y_bf16,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
    return run(x, x_bf16, w, scale, y, y_bf16, M, N, K, num_threads, KIND_E4M3);
}

/* Widening [n] quantized weights (kind 0: int8, 1: e4m3) into float32 or bfloat16, exactly (no scale: int8
 * values and e4m3 values are all bfloat16 numbers, so the bf16 copy is the top half of the float32 one). */
#if defined(__AVX512BW__)
/* e4m3 -> bf16 with AVX-512: the 128 magnitudes' bf16 bits are a table in four registers, looked up 32 at a time
 * (two 64-entry permutes and a blend on bit 6), the sign OR-ed back: 8 ops per 32 weights, where decoding
 * through float32 takes ~40 (the tiled GEMM path widens a whole layer per call, so this is its cost). */
static uint16_t e4m3_bf16[128];

__attribute__((constructor)) static void fill_e4m3_bf16(void) {
    for (int b = 0; b < 128; b++) {
        float f = e4m3_to_f32_unit((uint8_t)b) / E4M3_UNIT;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        e4m3_bf16[b] = (uint16_t)(u >> 16); /* exact: 3 mantissa bits */
    }
}

static void widen_e4m3_bf16_avx512(const uint8_t *w, uint16_t *out, int64_t i0, int64_t i1) {
    const __m512i t0 = _mm512_loadu_si512(e4m3_bf16), t1 = _mm512_loadu_si512(e4m3_bf16 + 32),
                  t2 = _mm512_loadu_si512(e4m3_bf16 + 64), t3 = _mm512_loadu_si512(e4m3_bf16 + 96);
    const __m512i low7 = _mm512_set1_epi16(0x7f), bit6 = _mm512_set1_epi16(0x40), bit7 = _mm512_set1_epi16(0x80);
    int64_t i = i0;
    for (; i + 32 <= i1; i += 32) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + i)));
        const __m512i magnitude = _mm512_and_si512(v, low7);
        const __m512i lo = _mm512_permutex2var_epi16(t0, magnitude, t1), hi = _mm512_permutex2var_epi16(t2, magnitude, t3);
        const __m512i bits = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(magnitude, bit6), lo, hi);
        const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, bit7), 8);
        _mm512_storeu_si512(out + i, _mm512_or_si512(bits, sign));
    }
    for (; i < i1; i++) out[i] = (uint16_t)(e4m3_bf16[w[i] & 0x7f] | ((w[i] & 0x80) << 8));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __attribute__((always_inline)) void widen_span(const uint8_t *w, void *out, int out_bf16,
                                                             int64_t i0, int64_t i1, const int kind) {
    int64_t i = i0;
    const __m256 unbias = _mm256_set1_ps(1.0f / UNIT(kind));
    for (; i + 8 <= i1; i += 8) {
        const __m256 v = kind == KIND_INT8 ? widen8(w + i, kind) : _mm256_mul_ps(widen8(w + i, kind), unbias);
        if (out_bf16) {
            const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16); /* exact: see above */
            const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
            _mm_storeu_si128((__m128i *)((uint16_t *)out + i), packed);
        } else {
            _mm256_storeu_ps((float *)out + i, v);
        }
    }
    for (; i < i1; i++) store_from_f32(out, i, weight_to_f32(w, i, kind) / UNIT(kind), out_bf16);
}
#else
static inline void widen_span(const uint8_t *w, void *out, int out_bf16, int64_t i0, int64_t i1, const int kind) {
    for (int64_t i = i0; i < i1; i++) store_from_f32(out, i, weight_to_f32(w, i, kind) / UNIT(kind), out_bf16);
}
#endif

#define WIDEN_SPAN 4096 /* elements per work item */
#define MIN_PARALLEL_WIDEN (1 << 16)

int ember_widen_weights(const uint8_t *w, int kind, void *out, int out_bf16, int64_t n, int num_threads) {
    if (n < 1 || (kind != KIND_INT8 && kind != KIND_E4M3)) return 1;
    if (num_threads < 1 || n < MIN_PARALLEL_WIDEN) num_threads = 1;
    int64_t num_spans = (n + WIDEN_SPAN - 1) / WIDEN_SPAN;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t s = 0; s < num_spans; s++) {
        int64_t i0 = s * WIDEN_SPAN, i1 = i0 + WIDEN_SPAN < n ? i0 + WIDEN_SPAN : n;
#if defined(__AVX512BW__)
        if (kind == KIND_E4M3 && out_bf16) {
            widen_e4m3_bf16_avx512(w, out, i0, i1);
            continue;
        }
#endif
        if (kind == KIND_E4M3) widen_span(w, out, out_bf16, i0, i1, KIND_E4M3);
        else widen_span(w, out, out_bf16, i0, i1, KIND_INT8);
    }
    return 0;
}

/* The int8 GEMM path's two passes around torch._int_mm (W8A8 for many rows):
 * `ember_quantize_rows_int8`: each row of x [M, K] (float32 or bfloat16) to int8 with its own scale,
 *   s = max|x| / 127 (at least FLT_MIN), q = round-half-even(x / s): the formula of the torch reference, one pass.
 * `ember_scale_int32`: y[m, n] = ((float)acc[m, n] * row_scale[m]) * col_scale[n] into float32 or bfloat16,
 *   the reference's order of roundings, in one pass instead of three torch ops over the output. */
#include <float.h>
#include <math.h>

#define MIN_PARALLEL_ELEMENTS (1 << 15)

int ember_quantize_rows_int8(const void *x, int x_bf16, int8_t *xq, float *row_scale, int64_t M, int64_t K,
                             int num_threads) {
    if (M < 1 || K < 1) return 1;
    if (num_threads < 1 || M * K < MIN_PARALLEL_ELEMENTS) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = fabsf(load_as_f32(x, m * K + k, x_bf16));
            amax = v > amax ? v : amax;
        }
        float s = amax / 127.0f;
        s = s < FLT_MIN ? FLT_MIN : s;
        row_scale[m] = s;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = (int8_t)nearbyintf(load_as_f32(x, m * K + k, x_bf16) / s);
    }
    return 0;
}

int ember_scale_int32(const int32_t *acc, const float *row_scale, const float *col_scale, void *y, int y_bf16,
                      int64_t M, int64_t N, int num_threads) {
    if (M < 1 || N < 1) return 1;
    if (num_threads < 1 || M * N < MIN_PARALLEL_ELEMENTS) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t m = 0; m < M; m++) {
        const float r = row_scale[m];
        if (y_bf16)
            for (int64_t n = 0; n < N; n++)
                ((uint16_t *)y)[m * N + n] = f32_to_bf16(((float)acc[m * N + n] * r) * col_scale[n]);
        else
            for (int64_t n = 0; n < N; n++) ((float *)y)[m * N + n] = ((float)acc[m * N + n] * r) * col_scale[n];
    }
    return 0;
}

/* `ember_bf16_gemm`: y[M, N] = x[M, K] (bfloat16) @ (w[N, K] * scale[N]).T for int8 or e4m3 weights, with
 * AVX512_BF16's vdpbf16ps (16 lanes x 2 bf16 products per instruction, float32 accumulation): the path for
 * bf16 activations beyond a few rows, where the float32 FMAs above fall behind and the tiled widening into
 * torch's GEMM pays a GEMM call and an output pass per tile.
 *
 * The weights stay in their row-major storage. Work item: a tile of NT weight rows, widened exactly into
 * bf16 once (the same widening as `ember_widen_weights`, into a per-thread buffer of NT x K that stays in L2)
 * and then used by every row of x. The activations are the vector operand: x is interleaved once per call
 * into xi[M / 16][K / 2][16] 32-bit pairs (x[m, 2p], x[m, 2p + 1]) for 16 rows m, zero-padded; each weight
 * pair is broadcast (embedded in the instruction). Register tile: MV x 16 rows of x by NT weight rows, 24
 * accumulators. Each (m, n) is one chain of vdpbf16ps over k in order whatever M is, so a row's result never
 * depends on the rows batched with it. vdpbf16ps treats bf16 subnormal inputs as zero and rounds its float32
 * sums to nearest even: activations below 2^-126 count as zero (every widened int8/e4m3 value is normal).
 * Returns 0, 1 for bad sizes, 2 if memory ran out, 3 where the CPU has no AVX512_BF16 (callers check
 * `ember_bf16_gemm_available` first). */
/* Register tile: 12 weight rows (broadcast operands) x 2 vectors of 16 rows of x: 24 accumulators + 3 operands in
 * 32 registers. Measured against 8 x 3, 6 x 4 and 16 x 1 at 16-512 rows: 12 x 2 was as fast or faster. */
#define BG_NT 12
_Static_assert(BG_NT <= 16, "bg_tile transposes its weight rows as 16 lanes");
#define BG_MV 2
#define BG_X_BYTES (768 * 1024) /* interleaved x per block of rows: most of a 1 MB L2, the smallest of the targets */

int ember_bf16_gemm_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void bg_tile(const uint32_t *xi, const uint32_t *wb, int64_t P,
                                                          const float *scale, void *y, int y_bf16, int64_t M,
                                                          int64_t N, int64_t n0, int64_t mb0, const int mv,
                                                          const uint8_t *next) {
    __m512 acc[BG_NT][BG_MV];
    for (int j = 0; j < BG_NT; j++)
        for (int v = 0; v < mv; v++) acc[j][v] = _mm512_setzero_ps();
    const uint32_t *a_ptr = xi + mb0 * P * 16;
    for (int64_t p = 0; p < P; p++) {
        /* The next tile's bytes (NT rows, contiguous: 2 * NT bytes per pair) into cache while this one computes:
         * else each tile waits for memory before its arithmetic starts, and a few rows are memory-bound. */
        if (next) _mm_prefetch((const char *)(next + p * 2 * BG_NT), _MM_HINT_T0);
        __m512bh a[BG_MV];
        for (int v = 0; v < mv; v++) a[v] = (__m512bh)_mm512_load_si512(a_ptr + (v * P + p) * 16);
        for (int j = 0; j < BG_NT; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)wb[j * P + p]);
            for (int v = 0; v < mv; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], a[v], b);
        }
    }
    /* The tile transposed in registers: r[j] = the 16 rows' outputs for weight row n0 + j (scaled), padded to 16
     * with zeros; after transpose16, r[l] = row m0 + l's NT outputs, stored contiguously. A gather per row from a
     * stack buffer did the same at ~10% of the call with K = 1024 (16 gathers per tile and vector of rows). */
    const int nn = N - n0 < BG_NT ? (int)(N - n0) : BG_NT;
    const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
    for (int v = 0; v < mv; v++) {
        __m512i r[16];
        for (int j = 0; j < BG_NT; j++)
            r[j] = j < nn ? _mm512_castps_si512(_mm512_mul_ps(acc[j][v], _mm512_set1_ps(scale[n0 + j])))
                          : _mm512_setzero_si512();
        for (int j = BG_NT; j < 16; j++) r[j] = _mm512_setzero_si512();
        transpose16(r);
        const int64_t m0 = (mb0 + v) * 16;
        for (int l = 0; l < 16 && m0 + l < M; l++)
            store16(y, (m0 + l) * N + n0, nmask, _mm512_castsi512_ps(r[l]), y_bf16);
    }
}

#endif

int ember_bf16_gemm(const uint16_t *x, const uint8_t *w, int kind, const float *scale, void *y, int y_bf16,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (M < 1 || N < 1 || K < 1 || (kind != KIND_INT8 && kind != KIND_E4M3)) return 1;
    if (num_threads < 1) num_threads = 1;
    const int L = 16; /* rows of x per vector */
    const int64_t P = (K + 1) / 2, Mb = (M + L - 1) / L;
    uint32_t *xi = aligned_alloc(64, (size_t)((Mb * P * L * 4 + 63) / 64 * 64)); /* a multiple of the alignment */
    if (!xi) return 2;
    /* Full pairs of every row, 16 at a time: 16 rows' 64 bytes loaded and transposed in registers (a pair is one
     * dword, so row-major x is already paired). The scalar loop was a third of the call at 1536 outputs and 2048
     * rows (7.5 ms of 20.6 on 2 threads): strided 4-byte stores, a cache line each. */
    const int64_t P16 = (K / 2) / 16 * 16;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= MIN_PARALLEL_ELEMENTS)
    for (int64_t mb = 0; mb < Mb; mb++) {
        uint32_t *dst = xi + mb * P * L;
        for (int64_t p0 = 0; p0 < P16; p0 += 16) {
            __m512i r[16];
            for (int l = 0; l < L; l++) {
                const int64_t m = mb * L + l;
                r[l] = m < M ? _mm512_loadu_si512(x + m * K + 2 * p0) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_si512(dst + (p0 + j) * L, r[j]);
        }
        for (int l = 0; l < L; l++) {
            const int64_t m = mb * L + l;
            const uint16_t *row = x + m * K;
            for (int64_t p = P16; p < P; p++) {
                uint32_t lo = 0, hi = 0;
                if (m < M) {
                    lo = row[2 * p];
                    hi = 2 * p + 1 < K ? row[2 * p + 1] : 0;
                }
                dst[p * L + l] = lo | (hi << 16);
            }
        }
    }
    const int64_t num_tiles = (N + BG_NT - 1) / BG_NT;
    /* Rows of x per block, in vectors of 16 and a multiple of BG_MV: as many as BG_X_BYTES hold, at least 64. */
    int64_t block_mb = BG_X_BYTES / (P * L * 4) / BG_MV * BG_MV;
    if (block_mb < 4) block_mb = 4;
    const int64_t num_blocks = (Mb + block_mb - 1) / block_mb;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* NT rows of 2P bf16: the weights of one tile, widened; rows past N and the odd column stay zero. */
        uint16_t *wb = aligned_alloc(64, (size_t)((BG_NT * P * 4 + 63) / 64 * 64));
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
        /* Work items (block of rows of x, tile), tiles fastest: the threads share one block of x at a time, which
         * stays in L2 (BG_X_BYTES) while every tile passes over it, and each item widens its tile again (a few
         * percent of its arithmetic). One block of all rows streamed the whole of x from L3 or memory per tile:
         * at 2048 rows gate_up ran 0.5x dense. Dynamic chunks of 4 items: on a shared machine a thread the OS
         * preempts would hold the whole call back under a static split (measured: 1.16x vs 0.75-1.0x dense at 512
         * rows, load average 11). */
        const int64_t num_items = num_blocks * num_tiles;
        int64_t widened = -1; /* the tile in wb: consecutive items of one thread often share it */
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_items; item++) {
            if (!wb) continue;
            const int64_t t = item % num_tiles, blk = item / num_tiles;
            const int64_t n0 = t * BG_NT;
            if (t != widened) {
                for (int j = 0; j < BG_NT; j++) {
                    uint16_t *row = wb + j * 2 * P;
                    if (n0 + j >= N) {
                        memset(row, 0, (size_t)(2 * P * 2));
                        continue;
                    }
                    const uint8_t *src = w + (n0 + j) * K;
                    if (kind == KIND_E4M3) widen_e4m3_bf16_avx512(src, row, 0, K);
                    else widen_span(src, row, 1, 0, K, KIND_INT8);
                    if (K & 1) row[K] = 0;
                }
                widened = t;
            }
            /* prefetched during the first pass over the rows of x: the next tile, this thread's unless its chunk ends */
            const uint8_t *next = t + 1 < num_tiles ? w + (n0 + BG_NT) * K : NULL;
            const int64_t first = blk * block_mb, mb_end = first + block_mb < Mb ? first + block_mb : Mb;
            for (int64_t mb0 = first; mb0 < mb_end; mb0 += BG_MV) {
                switch (mb_end - mb0 < BG_MV ? mb_end - mb0 : BG_MV) { /* constant counts: accumulators in registers */
                    case 2: bg_tile(xi, (const uint32_t *)wb, P, scale, y, y_bf16, M, N, n0, mb0, 2, mb0 == first ? next : NULL); break;
                    default: bg_tile(xi, (const uint32_t *)wb, P, scale, y, y_bf16, M, N, n0, mb0, 1, mb0 == first ? next : NULL); break;
                }
            }
        }
        free(wb);
    }
    free(xi);
    return failed ? 2 : 0;
#else
    (void)x, (void)w, (void)kind, (void)scale, (void)y, (void)y_bf16, (void)M, (void)N, (void)K, (void)num_threads;
    return 3;
#endif
}
