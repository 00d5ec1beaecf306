/* Helpers shared by the AVX2 kernels (included by each .c file; build.py hashes it with the sources). */
#ifndef EMBER_SIMD_H
#define EMBER_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bfloat16 is the top half of a float32: widening is exact. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounding to nearest even as torch does (NaN -> 0x7fc0, as c10::BFloat16). A
 * select rather than a branch, so that gcc vectorizes the loops that call it. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7fc0 : rounded;
}

/* Element i of a float32 (bf16 == 0) or bfloat16 (bf16 != 0) array, as float32; and its store. */
static inline float load_as_f32(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_from_f32(void *p, int64_t i, float value, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(value);
    else
        ((float *)p)[i] = value;
}

/* x [n] as float32: x itself, or (x_bf16) a widened copy in *owned (the caller frees it). NULL if that copy's
 * memory ran out. A linear's activations, widened once per call rather than in every tile that reads them. */
static inline const float *as_f32_rows(const void *x, int x_bf16, int64_t n, float **owned) {
    *owned = NULL;
    if (!x_bf16) return (const float *)x;
    float *widened = malloc(sizeof(float) * (size_t)n);
    if (widened)
        for (int64_t i = 0; i < n; i++) widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    return *owned = widened;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

/* The sum of a vector's 8 floats. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 elements from i of a float32 (bf16 == 0) or bfloat16 array, as float32 (bf16 widened exactly). */
static inline __m256 load8_as_f32(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* 8 floats as a tensor of the dtype holds them: for bf16, f32_to_bf16 on 8 lanes, kept in the high half of each
 * float; float32 unchanged. */
static inline __m256 rnd8(__m256 v, const int bf16) {
    if (!bf16) return v;
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* 8 floats stored from i of a float32 or bfloat16 (rounded as rnd8) array. */
static inline void store8(void *p, int64_t i, __m256 v, const int bf16) {
    if (bf16) {
        const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(rnd8(v, 1)), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

/* exp of 8 floats, Cephes-style: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, then
 * 2^n through exponent bits, applied as two halves so that n = -126 and n = 128 stay representable.
 * Within ~1 ulp of expf (torch's vectorized exp is too); glibc's expf is scalar only. Below -87.3 it
 * gives 0 (so a masked score of -inf gives exactly 0), above ln(FLT_MAX) inf; a NaN gives a number,
 * which callers whose NaN input propagates anyway (silu's g / ...) do not mind. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.72283935546875f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), overflow = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 in two parts so that n * ln2_hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i e1 = _mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23);
    const __m256i e2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e1)), _mm256_castsi256_ps(e2));
    return _mm256_blendv_ps(_mm256_andnot_ps(underflow, y), _mm256_set1_ps(INFINITY), overflow);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 rows of 16 dwords transposed in registers: r[i] lane j <- r[j] lane i. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Now r[4b + q] holds, in each 128-bit lane L, the dwords (row 4b..4b+3, column 4L + q). */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);      /* lanes 0, 2 of r[i], then of r[i + 4] */
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);  /* lanes 1, 3 */
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
    /* r[i] is now column i: the transpose. */
}
#endif

#if defined(__AVX512BW__)
/* The `mask` lanes of v into y at element `at`: float32, or bf16 rounded as f32_to_bf16 does (to nearest even,
 * NaN -> 0x7fc0) where y_bf16. The output store of the AVX-512 GEMMs. */
static inline __attribute__((always_inline)) void store16(void *y, int64_t at, __mmask16 mask, __m512 v,
                                                          int y_bf16) {
    if (!y_bf16) {
        _mm512_mask_storeu_ps((float *)y + at, mask, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, _mm512_cvtepi32_epi16(r));
}
#endif

#endif
