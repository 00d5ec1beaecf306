/* `ember_amx_gemm`: y[M, N] = x[M, K] (bfloat16) @ (w[N, K] * scale[N]).T for int8 or e4m3 weights on CPUs with
 * AMX (Intel Sapphire Rapids and later): the prefill / large-batch path of the weight-only int8 and fp8 linears.
 *
 * Why: on an AMX CPU oneDNN runs the dense bf16 GEMM on the tile unit (TDPBF16PS: 16 x 16 x 32 products per
 * instruction), 4-8x what the AVX512_BF16 `ember_bf16_gemm` reaches, so a quantized linear beyond a few rows
 * can only keep up by using the same unit. The weights are widened exactly into bf16 (every int8 and e4m3 value
 * is a bf16 number) a block at a time, straight into the tile unit's pair-interleaved ("VNNI") layout, in a
 * per-thread buffer that stays in L2; no full-precision copy of the layer exists.
 *
 * Layout: x is copied once per call into xp[M32][K32] (rows padded to a multiple of 32, columns to 32, zeros), so
 * every A tile (16 rows x 32 bf16) is a plain strided load. A work item is NB = 64 weight rows: widened to
 * wv[NB / 16][K32 / 32][16 pairs][16 rows][2], one B tile (16 k-pairs x 16 outputs) per 1 KiB. Per block of 32
 * rows of x by 32 outputs: 4 accumulator tiles (2 A x 2 B), TDPBF16PS over k in order; then each accumulator
 * tile goes through a 1 KiB buffer, times the channel scales, into y (float32, or bf16 rounded to nearest even).
 * Each (m, n) is one float32 chain over k in 32-wide steps, the same whatever M is: a row's result does not
 * depend on the rows batched with it. TDPBF16PS treats bf16 subnormal inputs as zero and flushes its sums'
 * subnormals: activations below 2^-126 count as zero (as `ember_bf16_gemm`'s vdpbf16ps).
 * Returns 0, 1 for bad sizes, 2 if memory ran out, 3 where the CPU or OS offers no AMX. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define KIND_INT8 0
#define KIND_E4M3 1
#define KIND_INT4 2

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define NB 64 /* weight rows per work item: 4 B-tile columns, 64 x K32 bf16 in L2 */

static int amx_state = -1; /* -1 unknown, 0 refused, 1 granted */

/* Linux grants a process the tile registers' state on request (once per process; oneDNN asks too). */
int ember_amx_available(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void configure_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { /* 0-3 accumulators (16 x 16 float32), 4-5 A (16 x 32 bf16), 6-7 B (16 x 16 pairs) */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* e4m3 magnitudes (7 bits) as bf16 bits: exact (3 mantissa bits), looked up 32 at a time from 4 registers. */
static uint16_t e4m3_bf16_bits[128];

__attribute__((constructor)) static void fill_e4m3_bf16_bits(void) {
    for (int b = 0; b < 128; b++) {
        const int e = b >> 3, m = b & 7;
        const float f = e == 0 ? (float)m * 0x1p-9f : (1.0f + (float)m / 8.0f) * (float)(1 << e) * 0x1p-7f;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        e4m3_bf16_bits[b] = (uint16_t)(u >> 16);
    }
}

/* 32 weights (n of them read, the rest zero) widened exactly to bf16. */
static inline __attribute__((always_inline)) __m512i widen32(const uint8_t *src, int64_t n, const int kind,
                                                             const __m512i lut[4]) {
    const __m256i bytes = n >= 32 ? _mm256_loadu_si256((const __m256i *)src)
                                  : _mm256_maskz_loadu_epi8((__mmask32)((1ull << n) - 1), src);
    if (kind == KIND_INT8) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi16(0x7f));
    const __m512i lo = _mm512_permutex2var_epi16(lut[0], magnitude, lut[1]);
    const __m512i hi = _mm512_permutex2var_epi16(lut[2], magnitude, lut[3]);
    const __m512i bits = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(magnitude, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
}

/* Rows n0..n0+NB of w widened into wv (see the layout above), 32 inputs of 16 rows at a time straight from w into
 * registers and transposed there; rows past N and inputs past K are zeros. */
static void widen_block(const uint8_t *w, int kind, int64_t N, int64_t K, int64_t K32, int64_t n0, uint16_t *wv) {
    const int64_t KC = K32 / 32;
    const __m512i lut[4] = {_mm512_loadu_si512(e4m3_bf16_bits), _mm512_loadu_si512(e4m3_bf16_bits + 32),
                            _mm512_loadu_si512(e4m3_bf16_bits + 64), _mm512_loadu_si512(e4m3_bf16_bits + 96)};
    for (int s = 0; s < NB / 16; s++) {
        uint16_t *dst = wv + (int64_t)s * KC * 512;
        const int64_t first = n0 + s * 16;
        if (first >= N) {
            memset(dst, 0, (size_t)KC * 1024);
            continue;
        }
        const int rows = N - first < 16 ? (int)(N - first) : 16;
        for (int64_t c = 0; c < KC; c++) {
            __m512i r[16];
            const int64_t k0 = c * 32, n = K - k0 < 32 ? K - k0 : 32;
            for (int j = 0; j < 16; j++) {
                if (j >= rows) {
                    r[j] = _mm512_setzero_si512();
                    continue;
                }
                const uint8_t *src = w + (first + j) * K + k0;
                _mm_prefetch((const char *)(src + 256), _MM_HINT_T0); /* 16 row streams: help the prefetcher */
                r[j] = kind == KIND_INT8 ? widen32(src, n, KIND_INT8, lut) : widen32(src, n, KIND_E4M3, lut);
            }
            transpose16(r); /* r[p] = the pair p of each of the 16 rows: one row of the B tile */
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + c * 512 + p * 32, r[p]);
        }
    }
}

/* Int4 weights in int4_linear.c's layout (blocks of 16 rows; per 8 inputs 64 bytes, one 32-bit lane per row, byte i
 * = q[8j + i] | q[8j + 4 + i] << 4; sc / sz [block][group][16] = s and s * z): the rows n0..n0+NB as
 * bf16(s q - s z) straight into the tile layout, 16 rows at a time = one int4 block. Unlike int8 and e4m3 the
 * dequantized weight is rounded to bf16 (as int4's dense path's dequantize(bf16) would): a relative 2^-9, next to
 * int4's own step of 1/15 of a group's range. */
static void widen_block_int4(const uint8_t *w, const float *sc, const float *sz, int64_t N, int64_t K, int64_t G,
                             int64_t K32, int64_t n0, uint16_t *wv) {
    const int64_t KC = K32 / 32, groups = (K + G - 1) / G, J = groups * G / 8; /* J: 8-input steps stored */
    for (int s = 0; s < NB / 16; s++) {
        const int64_t b = n0 / 16 + s;
        uint16_t *dst = wv + (int64_t)s * KC * 512;
        if (b * 16 >= N) {
            memset(dst, 0, (size_t)KC * 1024);
            continue;
        }
        const uint8_t *wb = w + b * J * 64;
        for (int64_t j = 0; j < KC * 4; j++) { /* 4 steps of 8 inputs per 32-input chunk: 4 rows of pairs each */
            uint16_t *rows = dst + (j / 4) * 512 + (j % 4) * 4 * 32;
            if (j >= J) {
                memset(rows, 0, 4 * 64);
                continue;
            }
            const int64_t g = j * 8 / G;
            const __m512 scale = _mm512_loadu_ps(sc + (b * groups + g) * 16),
                         offset = _mm512_loadu_ps(sz + (b * groups + g) * 16);
            const __m512i v = _mm512_loadu_si512(wb + j * 64), nibble = _mm512_set1_epi32(0xF);
            for (int pp = 0; pp < 4; pp++) { /* inputs 8j + 2pp, 8j + 2pp + 1: bytes (2pp % 4, + 1), nibble pp / 2 */
                const int shift = 8 * (2 * pp % 4) + 4 * (pp / 2);
                const __m512 w0 = _mm512_fmsub_ps(
                    _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), nibble)), scale, offset);
                const __m512 w1 = _mm512_fmsub_ps(
                    _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift + 8), nibble)), scale, offset);
                const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w0)),
                              hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w1));
                _mm512_storeu_si512(rows + pp * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
}

/* What a call widens: int8 / e4m3 rows (w [N, K], kind), or int4 blocks (w, sc, sz, G). */
struct weights {
    const uint8_t *w;
    int kind;
    const float *sc, *sz;
    int64_t G;
};

static inline __attribute__((always_inline)) void store_tile(const float *acc, const float *scale, void *y, int y_bf16,
                                                             int64_t M, int64_t N, int64_t m0, int64_t n0) {
    if (n0 >= N) return;
    const int nn = N - n0 < 16 ? (int)(N - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << nn) - 1);
    const __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.0f);
    for (int i = 0; i < 16 && m0 + i < M; i++) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + i * 16), s);
        const int64_t at = (m0 + i) * N + n0;
        store16(y, at, mask, v, y_bf16);
    }
}

static int amx_gemm(const uint16_t *x, const struct weights *wt, const float *scale, void *y, int y_bf16, int64_t M,
                    int64_t N, int64_t K, int num_threads) {
    if (!ember_amx_available()) return 3;
    if (num_threads < 1) num_threads = 1;
    const int64_t K32 = (K + 31) / 32 * 32, M32 = (M + 31) / 32 * 32, KC = K32 / 32;
    /* xp's row stride: K32 plus one cache line, so that the 16 rows of an A tile do not fall into the same few
     * L1 sets (a stride of a multiple of 4 KiB maps them all onto one). */
    const int64_t XS = K32 + 32;
    uint16_t *xp = aligned_alloc(64, (size_t)(M32 * XS * 2));
    if (!xp) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= (1 << 15))
    for (int64_t m = 0; m < M32; m++) {
        uint16_t *dst = xp + m * XS;
        if (m < M) {
            memcpy(dst, x + m * K, (size_t)K * 2);
            memset(dst + K, 0, (size_t)(K32 - K) * 2);
        } else {
            memset(dst, 0, (size_t)K32 * 2);
        }
    }
    const int64_t num_blocks = (N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *wv = aligned_alloc(64, (size_t)(NB * K32 * 2));
        float acc[4][256] __attribute__((aligned(64)));
        if (!wv) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles(); /* per thread: the tile configuration is thread state */
        }
        /* Dynamic: on a shared machine a preempted thread would hold a static split back. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_blocks; b++) {
            if (!wv) continue;
            const int64_t n0 = b * NB;
            if (wt->kind == KIND_INT4) widen_block_int4(wt->w, wt->sc, wt->sz, N, K, wt->G, K32, n0, wv);
            else widen_block(wt->w, wt->kind, N, K, K32, n0, wv);
            const int subs = (int)((N - n0 + 15) / 16 < NB / 16 ? (N - n0 + 15) / 16 : NB / 16);
            for (int64_t m0 = 0; m0 < M32; m0 += 32) {
                const uint16_t *a0 = xp + m0 * XS, *a1 = a0 + 16 * XS;
                for (int s = 0; s < subs; s += 2) {
                    const uint16_t *b0 = wv + (int64_t)s * KC * 512, *b1 = b0 + KC * 512;
                    const int two = s + 1 < subs;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    /* The next 32 rows of x into L2 during the first pair of outputs: past L2's size the tile
                     * loads' 32 strided streams are more than the hardware prefetcher follows. */
                    const uint16_t *next = s == 0 && m0 + 32 < M32 ? a0 + 32 * XS : NULL;
                    if (m0 + 16 < M) {
                        for (int64_t c = 0; c < KC; c++) {
                            if (next)
                                for (int r = 0; r < 32; r++)
                                    _mm_prefetch((const char *)(next + r * XS + c * 32), _MM_HINT_T1);
                            _tile_loadd(4, a0 + c * 32, XS * 2);
                            _tile_loadd(5, a1 + c * 32, XS * 2);
                            _tile_loadd(6, b0 + c * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two) {
                                _tile_loadd(7, b1 + c * 512, 64);
                                _tile_dpbf16ps(1, 4, 7);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                        }
                    } else { /* the last rows fit one A tile (16 rows): half the products (decode-sized batches) */
                        for (int64_t c = 0; c < KC; c++) {
                            _tile_loadd(4, a0 + c * 32, XS * 2);
                            _tile_loadd(6, b0 + c * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (two) {
                                _tile_loadd(7, b1 + c * 512, 64);
                                _tile_dpbf16ps(1, 4, 7);
                            }
                        }
                    }
                    const int64_t nA = n0 + s * 16;
                    _tile_stored(0, acc[0], 64);
                    store_tile(acc[0], scale, y, y_bf16, M, N, m0, nA);
                    if (two) {
                        _tile_stored(1, acc[1], 64);
                        store_tile(acc[1], scale, y, y_bf16, M, N, m0, nA + 16);
                    }
                    if (m0 + 16 < M) {
                        _tile_stored(2, acc[2], 64);
                        store_tile(acc[2], scale, y, y_bf16, M, N, m0 + 16, nA);
                        if (two) {
                            _tile_stored(3, acc[3], 64);
                            store_tile(acc[3], scale, y, y_bf16, M, N, m0 + 16, nA + 16);
                        }
                    }
                }
            }
        }
        _tile_release();
        free(wv);
    }
    free(xp);
    return failed ? 2 : 0;
}

int ember_amx_gemm(const uint16_t *x, const uint8_t *w, int kind, const float *scale, void *y, int y_bf16,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1 || (kind != KIND_INT8 && kind != KIND_E4M3)) return 1;
    const struct weights wt = {w, kind, NULL, NULL, 0};
    return amx_gemm(x, &wt, scale, y, y_bf16, M, N, K, num_threads);
}

/* y[M, N] = x[M, K] (bfloat16) @ W.T for int4 weights in int4_linear.c's layout (`ember_int4_pack`). */
int ember_amx_gemm_int4(const uint16_t *x, const uint8_t *w, const float *sc, const float *sz, void *y, int y_bf16,
                        int64_t M, int64_t N, int64_t K, int64_t G, int num_threads) {
    if (M < 1 || N < 1 || K < 1 || G < 8 || G % 8) return 1;
    const struct weights wt = {w, KIND_INT4, sc, sz, G};
    return amx_gemm(x, &wt, NULL, y, y_bf16, M, N, K, num_threads);
}

#if defined(__AMX_INT8__)
/* `ember_amx_int8_gemm`: y[M, N] = ((float)(xq[M, K] @ w[N, K].T) * row_scale[M]) * scale[N], int8 x int8 with
 * exact int32 sums on the tile unit (TDPBSSD: 16 x 16 x 64 products per instruction, twice TDPBF16PS's): the W8A8
 * path of the int8 linear (x quantized per row by `ember_quantize_rows_int8`, the map of `int8_gemm`, rounding for
 * rounding: its sums are exact, its two scalings in the same order). Where bf16 needs its weights widened, int8
 * weights are only regrouped (4 inputs of a row per 32-bit lane, 16 rows transposed in registers), and a tile of
 * either operand holds twice the products: a prefill chunk runs about twice as fast as the bf16 GEMM could.
 * Layout: xp[M32][XS] bytes (rows padded to 32, columns to 64, zeros); a work item is NB weight rows regrouped into
 * wv[NB / 16][K64 / 64][16 quads][16 rows][4]. Returns as `ember_amx_gemm`. */
static void regroup_block_int8(const int8_t *w, int64_t N, int64_t K, int64_t K64, int64_t n0, int8_t *wv) {
    const int64_t KC = K64 / 64;
    for (int s = 0; s < NB / 16; s++) {
        int8_t *dst = wv + (int64_t)s * KC * 1024;
        const int64_t first = n0 + s * 16;
        if (first >= N) {
            memset(dst, 0, (size_t)KC * 1024);
            continue;
        }
        const int rows = N - first < 16 ? (int)(N - first) : 16;
        for (int64_t c = 0; c < KC; c++) {
            __m512i r[16];
            const int64_t k0 = c * 64, n = K - k0 < 64 ? K - k0 : 64;
            const __mmask64 mask = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
            for (int j = 0; j < 16; j++) {
                const int8_t *src = w + (first + j) * K + k0;
                if (j < rows) _mm_prefetch((const char *)(src + 512), _MM_HINT_T0); /* 16 row streams */
                r[j] = j < rows ? _mm512_maskz_loadu_epi8(mask, src) : _mm512_setzero_si512();
            }
            transpose16(r); /* r[q] = inputs 4q..4q+3 of each of the 16 rows: one row of the B tile */
            for (int q = 0; q < 16; q++) _mm512_storeu_si512(dst + c * 1024 + q * 64, r[q]);
        }
    }
}

static inline __attribute__((always_inline)) void store_tile_int32(const int32_t *acc, const float *row_scale,
                                                                   const float *scale, void *y, int y_bf16,
                                                                   int64_t M, int64_t N, int64_t m0, int64_t n0) {
    if (n0 >= N) return;
    const int nn = N - n0 < 16 ? (int)(N - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << nn) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
    for (int i = 0; i < 16 && m0 + i < M; i++) {
        const __m512 v = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + i * 16)), _mm512_set1_ps(row_scale[m0 + i])),
            s);
        const int64_t at = (m0 + i) * N + n0;
        store16(y, at, mask, v, y_bf16);
    }
}

int ember_amx_int8_gemm(const int8_t *xq, const float *row_scale, const int8_t *w, const float *scale, void *y,
                        int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    if (!ember_amx_available()) return 3;
    if (num_threads < 1) num_threads = 1;
    const int64_t K64 = (K + 63) / 64 * 64, M32 = (M + 31) / 32 * 32, KC = K64 / 64;
    const int64_t XS = K64 + 64; /* one cache line past K64: see amx_gemm */
    int8_t *xp = aligned_alloc(64, (size_t)(M32 * XS));
    if (!xp) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M32; m++) {
        int8_t *dst = xp + m * XS;
        if (m < M) {
            memcpy(dst, xq + m * K, (size_t)K);
            memset(dst + K, 0, (size_t)(K64 - K));
        } else {
            memset(dst, 0, (size_t)K64);
        }
    }
    const int64_t num_blocks = (N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *wv = aligned_alloc(64, (size_t)(NB * K64));
        int32_t acc[4][256] __attribute__((aligned(64)));
        if (!wv) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles(); /* the same shapes: 16 rows of 64 bytes for every tile */
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_blocks; b++) {
            if (!wv) continue;
            const int64_t n0 = b * NB;
            regroup_block_int8(w, N, K, K64, n0, wv);
            const int subs = (int)((N - n0 + 15) / 16 < NB / 16 ? (N - n0 + 15) / 16 : NB / 16);
            for (int64_t m0 = 0; m0 < M32; m0 += 32) {
                const int8_t *a0 = xp + m0 * XS, *a1 = a0 + 16 * XS;
                for (int s = 0; s < subs; s += 2) {
                    const int8_t *b0 = wv + (int64_t)s * KC * 1024, *b1 = b0 + KC * 1024;
                    const int two = s + 1 < subs;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const int8_t *next = s == 0 && m0 + 32 < M32 ? a0 + 32 * XS : NULL;
                    if (m0 + 16 < M) {
                        for (int64_t c = 0; c < KC; c++) {
                            if (next)
                                for (int r = 0; r < 32; r++)
                                    _mm_prefetch((const char *)(next + r * XS + c * 64), _MM_HINT_T1);
                            _tile_loadd(4, a0 + c * 64, XS);
                            _tile_loadd(5, a1 + c * 64, XS);
                            _tile_loadd(6, b0 + c * 1024, 64);
                            _tile_dpbssd(0, 4, 6);
                            _tile_dpbssd(2, 5, 6);
                            if (two) {
                                _tile_loadd(7, b1 + c * 1024, 64);
                                _tile_dpbssd(1, 4, 7);
                                _tile_dpbssd(3, 5, 7);
                            }
                        }
                    } else { /* the last rows fit one A tile */
                        for (int64_t c = 0; c < KC; c++) {
                            _tile_loadd(4, a0 + c * 64, XS);
                            _tile_loadd(6, b0 + c * 1024, 64);
                            _tile_dpbssd(0, 4, 6);
                            if (two) {
                                _tile_loadd(7, b1 + c * 1024, 64);
                                _tile_dpbssd(1, 4, 7);
                            }
                        }
                    }
                    const int64_t nA = n0 + s * 16;
                    _tile_stored(0, acc[0], 64);
                    store_tile_int32(acc[0], row_scale, scale, y, y_bf16, M, N, m0, nA);
                    if (two) {
                        _tile_stored(1, acc[1], 64);
                        store_tile_int32(acc[1], row_scale, scale, y, y_bf16, M, N, m0, nA + 16);
                    }
                    if (m0 + 16 < M) {
                        _tile_stored(2, acc[2], 64);
                        store_tile_int32(acc[2], row_scale, scale, y, y_bf16, M, N, m0 + 16, nA);
                        if (two) {
                            _tile_stored(3, acc[3], 64);
                            store_tile_int32(acc[3], row_scale, scale, y, y_bf16, M, N, m0 + 16, nA + 16);
                        }
                    }
                }
            }
        }
        _tile_release();
        free(wv);
    }
    free(xp);
    return failed ? 2 : 0;
}

int ember_amx_int8_available(void) { return ember_amx_available(); }
#else
int ember_amx_int8_available(void) { return 0; }

int ember_amx_int8_gemm(const int8_t *xq, const float *row_scale, const int8_t *w, const float *scale, void *y,
                        int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)xq, (void)row_scale, (void)w, (void)scale, (void)y, (void)y_bf16, (void)M, (void)N, (void)K,
        (void)num_threads;
    return 3;
}
#endif

#else
int ember_amx_available(void) { return 0; }

int ember_amx_gemm_int4(const uint16_t *x, const uint8_t *w, const float *sc, const float *sz, void *y, int y_bf16,
                        int64_t M, int64_t N, int64_t K, int64_t G, int num_threads) {
    (void)x, (void)w, (void)sc, (void)sz, (void)y, (void)y_bf16, (void)M, (void)N, (void)K, (void)G, (void)num_threads;
    return 3;
}

int ember_amx_gemm(const uint16_t *x, const uint8_t *w, int kind, const float *scale, void *y, int y_bf16,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)x, (void)w, (void)kind, (void)scale, (void)y, (void)y_bf16, (void)M, (void)N, (void)K, (void)num_threads;
    return 3;
}

int ember_amx_int8_available(void) { return 0; }

int ember_amx_int8_gemm(const int8_t *xq, const float *row_scale, const int8_t *w, const float *scale, void *y,
                        int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)xq, (void)row_scale, (void)w, (void)scale, (void)y, (void)y_bf16, (void)M, (void)N, (void)K,
        (void)num_threads;
    return 3;
}
#endif
