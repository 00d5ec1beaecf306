/* Helpers shared by the AVX2 kernels (included by each .c file; build.py hashes it with the sources). */
#ifndef EMBER_SIMD_H
#define EMBER_SIMD_H

#include <stdint.h>
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The sum of a vector's 8 floats. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
