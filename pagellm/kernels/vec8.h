/* Eight floats (and int32 lanes) in GCC/clang vector extensions, shared by the kernels
 * that vectorise without intrinsics (layer_ops.c, sampling.c). */
#ifndef PG_VEC8_H
#define PG_VEC8_H

#include <stdint.h>

/* Eight floats in GCC/clang vector extensions: AVX2 registers in the SIMD build, pairs of
 * SSE2 registers (or scalars elsewhere) in the portable one, the same results in both. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* static functions only: no ABI is crossed */
#endif
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f v8_select(v8i mask, v8f a, v8f b) { /* mask ? a : b, lane by lane */
    return (v8f)((mask & (v8i)a) | (~mask & (v8i)b));
}

/* e^x lane by lane: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so n * ln2_hi is
 * exact), e^r by its degree-7 Taylor polynomial, 2^n put into the exponent bits. Within a
 * few ulp of expf; x is first clamped to [-87.3, 88.3] (e^-87.3 ~ 1e-38, e^88.3 ~ 2e38:
 * silu's g / (1 + e^-g) is then ~0 or g either way). */
static inline v8f v8_exp(v8f x) {
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8f hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    x = v8_select(x < lo, lo, x);
    x = v8_select(x > hi, hi, x);
    v8f t = x * 1.44269504f + 0.5f;
    v8i n = __builtin_convertvector(t, v8i); /* toward zero; floor below */
    n += (v8i)(__builtin_convertvector(n, v8f) > t); /* true lanes are -1 */
    v8f nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * 0.693145751953125f;
    r = r - nf * 1.428606765330187e-06f;
    v8f p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v8f)((n + 127) << 23); /* n in [-126, 127]: 2^n is a normal float */
}

#endif
