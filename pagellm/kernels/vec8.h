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
#define PG_EXP_LANES(V, VI, sel, x)                                                            \
    do {                                                                                       \
        const V lo_ = (V){0} + -87.3f, hi_ = (V){0} + 88.3f;                                   \
        x = sel(x < lo_, lo_, x);                                                              \
        x = sel(x > hi_, hi_, x);                                                              \
        V t_ = x * 1.44269504f + 0.5f;                                                         \
        VI n_ = __builtin_convertvector(t_, VI); /* toward zero; floor below */                \
        n_ += (VI)(__builtin_convertvector(n_, V) > t_); /* true lanes are -1 */               \
        V nf_ = __builtin_convertvector(n_, V);                                                \
        V r_ = x - nf_ * 0.693145751953125f;                                                   \
        r_ = r_ - nf_ * 1.428606765330187e-06f;                                                \
        V p_ = r_ * (1.0f / 5040.0f) + 1.0f / 720.0f;                                          \
        p_ = p_ * r_ + 1.0f / 120.0f;                                                          \
        p_ = p_ * r_ + 1.0f / 24.0f;                                                           \
        p_ = p_ * r_ + 1.0f / 6.0f;                                                            \
        p_ = p_ * r_ + 0.5f;                                                                   \
        p_ = p_ * r_ + 1.0f;                                                                   \
        p_ = p_ * r_ + 1.0f;                                                                   \
        x = p_ * (V)((n_ + 127) << 23); /* n in [-126, 127]: 2^n is a normal float */          \
    } while (0)

/* The same steps on wider vectors give the same lanes (no contraction: -std=c11), so a
 * kernel may take 16 lanes at a time (amx_gemm.c's gated product) with v8_exp's numbers. */
static inline v8f v8_exp(v8f x) {
    PG_EXP_LANES(v8f, v8i, v8_select, x);
    return x;
}

/* The gates, on any lane count: silu(g) = g / (1 + e^-g); GELU's tanh form
 * 0.5 g (1 + tanh(u)) = g / (1 + e^-2u), u = sqrt(2 / pi) (g + 0.044715 g^3). */
#define PG_SILU(g, exp_fn) ((g) / (1.0f + exp_fn(-(g))))
#define PG_GELU_TANH(g, exp_fn) \
    ((g) / (1.0f + exp_fn(-2.0f * (0.7978845608028654f * ((g) + 0.044715f * (g) * (g) * (g))))))

#endif
