/* The small per-layer ops of a decoder step, each fused into one pass over its rows, in
 * float32: residual add + RMSNorm, rotary embedding of q and k in place, SiLU-and-mul.
 * Their torch compositions live beside their callers (layers/layernorm.py,
 * rotary_embedding.py, activation.py) and are what tests compare these against.
 *
 * Plain C that -O3 vectorises with whatever the build allows (AVX2 with the SIMD flags,
 * SSE2 without), and GCC/clang vector types for the exponential: no intrinsics, no libm
 * calls in inner loops. Rows are
 * `ld*` floats apart, elements of a row contiguous. Rows are split across threads only
 * when there are enough of them to pay for waking a team.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PG_ROWS_PARALLEL_MIN 65536 /* elements below which one thread does all rows */

/* Sum of squares of n floats, in 8 interleaved partial sums (vectorisable without
 * reassociating, which -O3 alone may not do), added pairwise at the end. */
static inline float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += x[i] * x[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* For each of T rows of width N: when `res` is given, x += res (in place: x becomes the
 * new residual stream); then out = x * rsqrt(mean(x^2) + eps) * w. The same products as
 * Hugging Face's LlamaRMSNorm in float32; only the order of the squares' sum differs. */
void pg_add_rms_norm(float *x, int64_t ldx, const float *res, int64_t ldr, const float *w,
                     int64_t T, int64_t N, float eps, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (T * N >= PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * ldx, *o = out + t * ldo;
        if (res != NULL) {
            const float *r = res + t * ldr;
            for (int64_t i = 0; i < N; i++) xr[i] += r[i];
        }
        float inv = 1.0f / sqrtf(sum_squares(xr, N) / (float)N + eps);
        for (int64_t i = 0; i < N; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* Rotary embedding ("rotate half", NeoX/Hugging Face layout) of `heads` heads of D values
 * per row, in place. Row t holds its heads D apart from x + t * ldx (q heads then k heads
 * of a fused qkv output) and sits at position pos[t]; cos/sin are the tables of
 * RotaryEmbedding ([max_pos, D]: cos repeated for both halves, sin negated in the first):
 *     x[i]       <- x[i] * cos[i]             + x[i + D/2] * sin[i]
 *     x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
 * which is x * cos + roll(x, D/2) * sin, product for product. */
void pg_rope(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t D, const int64_t *pos,
             const float *cos_table, const float *sin_table) {
    int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T * heads * D >= PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + pos[t] * D, *s = sin_table + pos[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ldx + h * D, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                float lo = a[i], hi = b[i];
                a[i] = lo * c[i] + hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

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

/* o[i] = silu(g[i]) * u[i] for i < n, eight at a time; the tail is padded into a vector
 * (memcpy of a constant 32 bytes compiles to one unaligned load or store). */
static void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        v8f ov = gv / (1.0f + v8_exp(-gv)) * uv;
        memcpy(o + i, &ov, sizeof ov);
    }
    if (i < n) {
        v8f gv = {0}, uv = {0};
        memcpy(&gv, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(&uv, u + i, (size_t)(n - i) * sizeof(float));
        v8f ov = gv / (1.0f + v8_exp(-gv)) * uv;
        memcpy(o + i, &ov, (size_t)(n - i) * sizeof(float));
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] for i < I: the gate and up halves of a fused
 * gate_up output, silu(g) = g / (1 + e^-g). */
void pg_silu_and_mul(const float *x, int64_t ldx, int64_t T, int64_t I, float *out,
                     int64_t ldo) {
#pragma omp parallel for schedule(static) if (T * I >= PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        silu_mul_row(x + t * ldx, x + t * ldx + I, out + t * ldo, I);
    }
}

/* out[t] = the index of the largest of row t's N values, as torch.argmax: the first one
 * when several are equal, the first NaN when the row has any. Eight lanes each keep
 * their best value and its index (a strict `>` keeps the earliest); the lanes are then
 * merged, the lowest index winning ties, and the tail is scanned after them. */
void pg_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T * N >= 4 * PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        v8f best = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                    -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, idx = at, nan = {0};
        int64_t i = 0;
        for (; i + 8 <= N && i + 8 <= INT32_MAX; i += 8, idx += 8) {
            v8f v;
            memcpy(&v, r + i, sizeof v);
            const v8i better = v > best;
            nan |= v != v;
            best = (v8f)(((v8i)v & better) | ((v8i)best & ~better));
            at = (idx & better) | (at & ~better);
        }
        int64_t k = at[0];
        float b = best[0];
        int any_nan = nan[0] != 0;
        for (int j = 1; j < 8; j++) {
            any_nan |= nan[j] != 0;
            if (best[j] > b || (best[j] == b && at[j] < k)) {
                b = best[j];
                k = at[j];
            }
        }
        for (; i < N; i++) {
            any_nan |= r[i] != r[i];
            if (r[i] > b) {
                b = r[i];
                k = i;
            }
        }
        if (any_nan)
            for (k = 0; r[k] == r[k]; k++) {
            }
        out[t] = k;
    }
}
