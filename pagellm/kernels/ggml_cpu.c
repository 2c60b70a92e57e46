/* CPU kernels for GGUF block-quantized weights x float32 activations.
 *
 * A weight W [N, K] is stored as the GGUF file stores it: N rows, each row K/B blocks
 * of one ggml type (B values per block), `row_bytes` bytes per row. Activations and
 * results are float32; the weight values each kernel computes with are those of gguf's
 * reference dequantization (the same formulas, block by block), so results differ from
 * "dequantize, then a float32 matmul" only by summation order.
 *
 *   pg_gemm          Y[m, n] = sum_k X[m, k] * W[n, k]   (rows of Y strided by ldy)
 *   pg_dequant_rows  out[i, :] = W[ids ? ids[i] : n0 + i, :] as float32
 *
 * Threads: OpenMP over output rows, linked against the OpenMP runtime torch already
 * loaded (same soname), so the kernels and torch share one thread pool and one
 * thread count (torch.set_num_threads).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

/* ggml type ids (gguf.GGMLQuantizationType). */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_XS = 23,
    T_BF16 = 30,
};

/* ------------------------------------------------------------------ scalars */

static inline float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};

/* Values per block and bytes per block of each type; 0 for types without a kernel. */
static void type_traits(int type, int64_t *block, int64_t *bytes) {
    switch (type) {
        case T_F32: *block = 1; *bytes = 4; return;
        case T_F16: *block = 1; *bytes = 2; return;
        case T_BF16: *block = 1; *bytes = 2; return;
        case T_Q4_0: *block = 32; *bytes = 18; return;
        case T_Q4_1: *block = 32; *bytes = 20; return;
        case T_Q5_0: *block = 32; *bytes = 22; return;
        case T_Q5_1: *block = 32; *bytes = 24; return;
        case T_Q8_0: *block = 32; *bytes = 34; return;
        case T_Q2_K: *block = 256; *bytes = 84; return;
        case T_Q3_K: *block = 256; *bytes = 110; return;
        case T_Q4_K: *block = 256; *bytes = 144; return;
        case T_Q5_K: *block = 256; *bytes = 176; return;
        case T_Q6_K: *block = 256; *bytes = 210; return;
        case T_IQ4_XS: *block = 256; *bytes = 136; return;
        case PG_Q4_K_R16: *block = 256; *bytes = 148; return;
        case PG_Q5_K_R16: *block = 256; *bytes = 180; return;
        case PG_Q6_K_R16: *block = 256; *bytes = 210; return;
        case PG_Q4_0_R16: *block = 32; *bytes = 18; return;
        case PG_Q4_1_R16: *block = 32; *bytes = 20; return;
        case PG_Q8_0_R16: *block = 32; *bytes = 34; return;
        default: *block = 0; *bytes = 0; return;
    }
}

int pg_type_supported(int type) {
    int64_t b, s;
    type_traits(type, &b, &s);
    return b != 0;
}

/* ----------------------------------------------- 32 values at a time, portable
 * deq32_<type>(row, g, out): values 32g .. 32g+31 of a row into out[32]. The AVX2
 * build uses them only for the rarer types (Q2_K, Q3_K, IQ4_XS). */
#define PORTABLE static __attribute__((unused)) void

PORTABLE deq32_q4_0(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + g * 18, *qs = b + 2;
    float d = pg_f16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = ((qs[j] & 0x0F) - 8) * d;
        y[j + 16] = ((qs[j] >> 4) - 8) * d;
    }
}

PORTABLE deq32_q4_1(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + g * 20, *qs = b + 4;
    float d = pg_f16(b), m = pg_f16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = (qs[j] & 0x0F) * d + m;
        y[j + 16] = (qs[j] >> 4) * d + m;
    }
}

PORTABLE deq32_q5_0(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + g * 22, *qs = b + 6;
    float d = pg_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        int x0 = ((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16;
        int x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        y[j] = x0 * d;
        y[j + 16] = x1 * d;
    }
}

PORTABLE deq32_q5_1(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + g * 24, *qs = b + 8;
    float d = pg_f16(b), m = pg_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        int x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = x0 * d + m;
        y[j + 16] = x1 * d + m;
    }
}

PORTABLE deq32_q8_0(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + g * 34;
    const int8_t *qs = (const int8_t *)(b + 2);
    float d = pg_f16(b);
    for (int j = 0; j < 32; j++) y[j] = qs[j] * d;
}

PORTABLE deq32_q2_k(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 84, *scales = b, *qs = b + 16;
    int s = (int)(g & 7), h = s >> 2, j = s & 3, shift = 2 * j;
    float d = pg_f16(b + 80), dmin = pg_f16(b + 82);
    const uint8_t *q = qs + 32 * h;
    for (int half = 0; half < 2; half++) {
        uint8_t sc = scales[8 * h + 2 * j + half];
        float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
        for (int l = 0; l < 16; l++) y[16 * half + l] = dl * ((q[16 * half + l] >> shift) & 3) - ml;
    }
}

PORTABLE deq32_q3_k(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 110, *hm = b, *qs = b + 32;
    int s = (int)(g & 7), h = s >> 2, j = s & 3, shift = 2 * j;
    float d_all = pg_f16(b + 108);
    uint32_t aux[4];
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    memcpy(aux, b + 96, 12);
    uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    const int8_t *scales = (const int8_t *)aux;
    const uint8_t *q = qs + 32 * h;
    uint8_t m = (uint8_t)(1u << (4 * h + j));
    for (int half = 0; half < 2; half++) {
        float dl = d_all * (scales[8 * h + 2 * j + half] - 32);
        for (int l = 0; l < 16; l++) {
            int i = 16 * half + l;
            y[i] = dl * ((int8_t)((q[i] >> shift) & 3) - ((hm[i] & m) ? 0 : 4));
        }
    }
}

PORTABLE deq32_q4_k(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 144, *q = b + 16 + 32 * ((g & 7) >> 1);
    int s = (int)(g & 7);
    uint8_t sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float d = pg_f16(b) * sc, mn = pg_f16(b + 2) * m;
    if (s & 1) {
        for (int l = 0; l < 32; l++) y[l] = d * (q[l] >> 4) - mn;
    } else {
        for (int l = 0; l < 32; l++) y[l] = d * (q[l] & 0xF) - mn;
    }
}

PORTABLE deq32_q5_k(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 176, *qh = b + 16, *ql = b + 48 + 32 * ((g & 7) >> 1);
    int s = (int)(g & 7);
    uint8_t sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float d = pg_f16(b) * sc, mn = pg_f16(b + 2) * m;
    for (int l = 0; l < 32; l++) {
        int v = ((s & 1) ? (ql[l] >> 4) : (ql[l] & 0xF)) + (((qh[l] >> s) & 1) ? 16 : 0);
        y[l] = d * v - mn;
    }
}

PORTABLE deq32_q6_k(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 210;
    int s = (int)(g & 7), h = s >> 2, t = s & 3;
    const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * t;
    float d = pg_f16(b + 208);
    for (int l = 0; l < 32; l++) {
        int lo = (t >= 2) ? (ql[l] >> 4) : (ql[l] & 0xF);
        int q = (lo | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
        y[l] = d * sc[l >> 4] * q;
    }
}

PORTABLE deq32_iq4_xs(const uint8_t *row, int64_t g, float *y) {
    const uint8_t *b = row + (g >> 3) * 136;
    int ib = (int)(g & 7);
    uint16_t scales_h;
    memcpy(&scales_h, b + 2, 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8 + 16 * ib;
    int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
    float dl = pg_f16(b) * (ls - 32);
    for (int j = 0; j < 16; j++) {
        y[j] = dl * kvalues_iq4nl[qs[j] & 0xf];
        y[j + 16] = dl * kvalues_iq4nl[qs[j] >> 4];
    }
}

/* ----------------------------------------------- 32 values at a time, AVX2 */
#ifdef PG_AVX2

/* The AVX2 dequantizers leave a group's 32 values in four registers, w[0..3], so a
 * product can use them without a round trip through memory. */

static inline void u8x32_affine(__m256i q, __m256 d, __m256 m, __m256 *w) {
    /* w = float(q) * d + m for 32 unsigned bytes q */
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
}

static inline void i8x32_scaled(__m256i q, __m256 d0, __m256 d1, __m256 *w) {
    /* w = float(q) * d for 32 signed bytes q (d0 for the first 16, d1 for the rest) */
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d0);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d0);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d1);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d1);
}

static inline void avx_q4_0(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + g * 18;
    __m256i q = _mm256_sub_epi8(pg_nibbles_32(b + 2), _mm256_set1_epi8(8));
    __m256 d = _mm256_set1_ps(pg_f16(b));
    i8x32_scaled(q, d, d, w);
}

static inline void avx_q4_1(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + g * 20;
    u8x32_affine(pg_nibbles_32(b + 4), _mm256_set1_ps(pg_f16(b)), _mm256_set1_ps(pg_f16(b + 2)), w);
}

static inline void avx_q5_0(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + g * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m256i q = _mm256_or_si256(pg_nibbles_32(b + 6), pg_bits_to_0x10(qh));
    __m256 d = _mm256_set1_ps(pg_f16(b));
    i8x32_scaled(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, d, w);
}

static inline void avx_q5_1(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + g * 24;
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    __m256i q = _mm256_or_si256(pg_nibbles_32(b + 8), pg_bits_to_0x10(qh));
    u8x32_affine(q, _mm256_set1_ps(pg_f16(b)), _mm256_set1_ps(pg_f16(b + 2)), w);
}

static inline void avx_q8_0(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + g * 34;
    __m256 d = _mm256_set1_ps(pg_f16(b));
    i8x32_scaled(_mm256_loadu_si256((const __m256i *)(b + 2)), d, d, w);
}

static inline void avx_q4_k(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + (g >> 3) * 144;
    int s = (int)(g & 7);
    uint8_t sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
    if (s & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    float d = pg_f16(b) * sc, mn = pg_f16(b + 2) * m;
    u8x32_affine(q, _mm256_set1_ps(d), _mm256_set1_ps(-mn), w);
}

static inline void avx_q5_k(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + (g >> 3) * 176;
    int s = (int)(g & 7);
    uint8_t sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (s >> 1)));
    if (s & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
    q = _mm256_or_si256(q, _mm256_slli_epi16(qh, 4));
    float d = pg_f16(b) * sc, mn = pg_f16(b + 2) * m;
    u8x32_affine(q, _mm256_set1_ps(d), _mm256_set1_ps(-mn), w);
}

static inline void avx_q6_k(const uint8_t *row, int64_t g, __m256 *w) {
    const uint8_t *b = row + (g >> 3) * 210;
    int s = (int)(g & 7), h = s >> 2, t = s & 3;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
    if (t >= 2) ql = _mm256_srli_epi16(ql, 4);
    ql = _mm256_and_si256(ql, _mm256_set1_epi8(0x0F));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * t;
    float d = pg_f16(b + 208);
    i8x32_scaled(q, _mm256_set1_ps(d * sc[0]), _mm256_set1_ps(d * sc[1]), w);
}

/* One row of a type with an AVX2 dequantizer: into out[K], or dotted with x[K]. */
#define AVX_ROW_FUNCS(name)                                                              \
    static void row_##name(const uint8_t *row, int64_t groups, float *out) {             \
        for (int64_t g = 0; g < groups; g++) {                                           \
            __m256 w[4];                                                                 \
            avx_##name(row, g, w);                                                       \
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 32 * g + 8 * i, w[i]);    \
        }                                                                                \
    }                                                                                    \
    static float dot_##name(const uint8_t *row, int64_t groups, const float *x) {        \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                       \
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();                       \
        for (int64_t g = 0; g < groups; g++) {                                           \
            __m256 w[4];                                                                 \
            avx_##name(row, g, w);                                                       \
            const float *xg = x + 32 * g;                                                \
            a0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), a0);                          \
            a1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), a1);                      \
            a2 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a2);                     \
            a3 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), a3);                     \
        }                                                                                \
        return pg_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));        \
    }


AVX_ROW_FUNCS(q4_0)
AVX_ROW_FUNCS(q4_1)
AVX_ROW_FUNCS(q5_0)
AVX_ROW_FUNCS(q5_1)
AVX_ROW_FUNCS(q8_0)
AVX_ROW_FUNCS(q4_k)
AVX_ROW_FUNCS(q5_k)
AVX_ROW_FUNCS(q6_k)
#define ROW(name, row, groups, out) row_##name(row, groups, out)
#else
#define ROW(name, row, groups, out) \
    for (int64_t g = 0; g < (groups); g++) deq32_##name(row, g, (out) + 32 * g)
#endif

/* --------------------------------------------------------------- whole rows */

/* Row `row` (K values of `type`) as K float32 values in out. */
static void dequant_row(int type, const uint8_t *row, int64_t K, float *out) {
    int64_t groups = K / 32;
    switch (type) {
        case T_F32: memcpy(out, row, (size_t)K * 4); return;
        case T_F16: {
            int64_t k = 0;
#ifdef PG_AVX2
            for (; k + 8 <= K; k += 8)
                _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))));
#endif
            for (; k < K; k++) out[k] = pg_f16(row + 2 * k);
            return;
        }
        case T_BF16: {
            for (int64_t k = 0; k < K; k++) {
                uint16_t h;
                memcpy(&h, row + 2 * k, 2);
                out[k] = bf16_to_fp32(h);
            }
            return;
        }
#define ROW_CASE(T, name) \
        case T: ROW(name, row, groups, out); return;
        ROW_CASE(T_Q4_0, q4_0)
        ROW_CASE(T_Q4_1, q4_1)
        ROW_CASE(T_Q5_0, q5_0)
        ROW_CASE(T_Q5_1, q5_1)
        ROW_CASE(T_Q8_0, q8_0)
        ROW_CASE(T_Q4_K, q4_k)
        ROW_CASE(T_Q5_K, q5_k)
        ROW_CASE(T_Q6_K, q6_k)
#undef ROW_CASE
        case T_Q2_K: for (int64_t g = 0; g < groups; g++) deq32_q2_k(row, g, out + 32 * g); return;
        case T_Q3_K: for (int64_t g = 0; g < groups; g++) deq32_q3_k(row, g, out + 32 * g); return;
        case T_IQ4_XS: for (int64_t g = 0; g < groups; g++) deq32_iq4_xs(row, g, out + 32 * g); return;
        default: return;
    }
}

/* Row n of a Q4_K_R16 (Q5_K_R16: five) matrix as K float32 values: the file type's values
 * in each build (avx_q4_k's / avx_q5_k's u * d + -m in one rounding, the portable d * u - m). */
static void dequant_k16(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, int five, float *out) {
    const int r = (int)(n & 15);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = pg_k16_block(W, row_bytes, n, sb, five);
        for (int j = 0; j < 8; j++) {
            float d, m;
            uint8_t q[16];
            pg_k16_scale_min(b, r, j, &d, &m);
            pg_k16_values(b, r, j, q);
            float *y = out + 256 * sb + 32 * j;
#ifdef PG_AVX2
            __m256 w[4];
            const __m256i u = five ? _mm256_or_si256(pg_nibbles_32(q), pg_k16_fifth_0x10(b, r, j)) : pg_nibbles_32(q);
            u8x32_affine(u, _mm256_set1_ps(d), _mm256_set1_ps(-m), w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(y + 8 * i, w[i]);
#else
            const uint32_t fifth = five ? pg_k16_fifth_bits(b, r, j) : 0;
            for (int i = 0; i < 16; i++) {
                y[i] = d * ((q[i] & 0xF) | ((fifth >> i) & 1) << 4) - m;
                y[i + 16] = d * ((q[i] >> 4) | ((fifth >> (16 + i)) & 1) << 4) - m;
            }
#endif
        }
    }
}

/* Row n of a Q4_0_R16 / Q4_1_R16 / Q8_0_R16 matrix as K float32 values: the file's
 * blocks put back together, 32 at a time, and dequantized as the file's type. */
static void dequant_r16(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K,
                        float *out) {
    const int base = pg_r16_base(type);
    const int64_t bytes = pg_b32_bytes(base), groups = K / 32;
    uint8_t blocks[32 * 34];
    for (int64_t g0 = 0; g0 < groups; g0 += 32) {
        const int64_t count = groups - g0 < 32 ? groups - g0 : 32;
        for (int64_t g = 0; g < count; g++)
            pg_r16_file_block(W, row_bytes, n, g0 + g, base, blocks + g * bytes);
        dequant_row(base, blocks, 32 * count, out + 32 * g0);
    }
}

/* Row n of a Q6_K_R16 matrix as K float32 values: Q6_K's in each build (avx_q6_k's
 * float(u - 32) * (d * scale); the portable build dequantizes the file's blocks put back
 * together). */
static void dequant_q6_16(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, float *out) {
#ifdef PG_AVX2
    const int r = (int)(n & 15);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = pg_q6_16_block(W, row_bytes, n, sb);
        const float d = pg_f16(b + 2 * r);
        const int8_t *sc = (const int8_t *)(b + PG_Q6_16_SCALES) + r;
        for (int j = 0; j < 8; j++) {
            __m256 w[4];
            const __m256i q = _mm256_sub_epi8(pg_q6_16_values(b, r, j), _mm256_set1_epi8(32));
            i8x32_scaled(q, _mm256_set1_ps(d * sc[16 * (2 * j)]), _mm256_set1_ps(d * sc[16 * (2 * j + 1)]), w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 256 * sb + 32 * j + 8 * i, w[i]);
        }
    }
#else
    uint8_t block[210];
    for (int64_t sb = 0; sb < K / 256; sb++) {
        pg_q6_16_file_block(W, row_bytes, n, sb, block);
        dequant_row(T_Q6_K, block, 256, out + 256 * sb);
    }
#endif
}

/* Row n of W as K float32 values, whatever the layout. */
static void dequant_row_n(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K,
                          float *out) {
    if (pg_is_k16(type))
        dequant_k16(W, row_bytes, n, K, type == PG_Q5_K_R16, out);
    else if (type == PG_Q6_K_R16)
        dequant_q6_16(W, row_bytes, n, K, out);
    else if (pg_is_r16(type))
        dequant_r16(type, W, row_bytes, n, K, out);
    else
        dequant_row(type, W + n * row_bytes, K, out);
}

/* Row n of W (of `type`) as K float32 values (for ggml_gemm.c, which calls it per row
 * inside its own thread team). */
void pg_dequant_row(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, float *out) {
    dequant_row_n(type, W, row_bytes, n, K, out);
}

static int repack_q6_k_r16(const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, uint8_t *out);

/* K-quant rows [16i, 16i + 16) of W (N rows, N a multiple of 16, K a multiple of 256) into
 * out in their 16-row layout (ggml_common.h): Q4_K (type 12) as Q4_K_R16, row_bytes 148 *
 * K / 256 there; Q5_K (13) as Q5_K_R16, 180; Q6_K (14) as Q6_K_R16, 210 (the file's). -1
 * for another type or shapes that do not fit. */
int pg_repack_k_r16(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, uint8_t *out) {
    if (type == 14) return repack_q6_k_r16(W, row_bytes, N, K, out);
    const int five = type == 13;
    const int64_t file_bytes = five ? 176 : 144, sb_bytes = pg_k16_sb_bytes(five);
    if ((type != 12 && type != 13) || N % 16 != 0 || K % 256 != 0 || row_bytes != file_bytes * (K / 256))
        return -1;
    const int64_t nsb = K / 256, groups = N / 16;
#pragma omp parallel for schedule(static) if (N * K >= 1 << 20)
    for (int64_t i = 0; i < groups; i++) {
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + (i * nsb + sb) * sb_bytes;
            if (five) memset(o + PG_K16_HIGH, 0, 512);
            for (int r = 0; r < 16; r++) {
                const uint8_t *b = W + (16 * i + r) * row_bytes + sb * file_bytes;
                const uint8_t *qs = b + (five ? 48 : 16), *qh = b + 16;
                memcpy(o + 2 * r, b, 2);
                memcpy(o + 32 + 2 * r, b + 2, 2);
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    scale_min_k4(j, b + 4, &sc, &m);
                    o[PG_K16_SCALES + 16 * j + r] = sc;
                    o[PG_K16_MINS + 16 * j + r] = m;
                    const uint8_t *q = qs + 32 * (j >> 1);
                    for (int k = 0; k < 16; k++) { /* byte k of the row: dword k / 4's byte k % 4 */
                        const int lo = j & 1 ? q[k] >> 4 : q[k] & 0xF;
                        const int hi = j & 1 ? q[k + 16] >> 4 : q[k + 16] & 0xF;
                        o[PG_K16_VALUES + 256 * j + 64 * (k / 4) + 4 * r + k % 4] = (uint8_t)(lo | hi << 4);
                    }
                    if (five) /* value l's fifth bit: bit j of qh[l] */
                        for (int l = 0; l < 32; l++) {
                            const int u = l < 16 ? l >> 2 : 4 + ((l - 16) >> 2);
                            o[PG_K16_HIGH + 64 * j + 4 * r + (l & 3)] |= (uint8_t)(((qh[l] >> j) & 1) << u);
                        }
                }
            }
        }
    }
    return 0;
}

/* Q6_K rows [16i, 16i + 16) of W (N rows, N a multiple of 16, K a multiple of 256) into
 * out in the Q6_K_R16 layout (ggml_common.h): row_bytes stays 210 * K / 256. */
static int repack_q6_k_r16(const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, uint8_t *out) {
    if (N % 16 != 0 || K % 256 != 0 || row_bytes != 210 * (K / 256)) return -1;
    const int64_t nsb = K / 256, groups = N / 16;
#pragma omp parallel for schedule(static) if (N * K >= 1 << 20)
    for (int64_t i = 0; i < groups; i++) {
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + (i * nsb + sb) * PG_Q6_16_SB;
            for (int r = 0; r < 16; r++) {
                const uint8_t *b = W + (16 * i + r) * row_bytes + sb * 210;
                memcpy(o + 2 * r, b + 208, 2);
                for (int s = 0; s < 16; s++) o[PG_Q6_16_SCALES + 16 * s + r] = b[192 + s];
                uint8_t u[256]; /* the values (0-63) in order, four at a time (Q6_K's dequantization) */
                for (int h = 0; h < 2; h++) {
                    for (int l = 0; l < 32; l++) {
                        const int q0 = b[64 * h + l], q1 = b[64 * h + 32 + l], qh = b[128 + 32 * h + l];
                        u[128 * h + l] = (uint8_t)((q0 & 0xF) | (qh & 3) << 4);
                        u[128 * h + 32 + l] = (uint8_t)((q1 & 0xF) | ((qh >> 2) & 3) << 4);
                        u[128 * h + 64 + l] = (uint8_t)((q0 >> 4) | ((qh >> 4) & 3) << 4);
                        u[128 * h + 96 + l] = (uint8_t)((q1 >> 4) | ((qh >> 6) & 3) << 4);
                    }
                }
                for (int j = 0; j < 8; j++) { /* pg_q6_16_file_block's inverse */
                    const uint8_t *x = u + 32 * j;
                    uint8_t *g = o + PG_Q6_16_VALUES + 384 * j;
                    for (int i = 0; i < 16; i++)
                        g[64 * (i >> 2) + 4 * r + (i & 3)] = (uint8_t)((x[i] & 0xF) | (x[16 + i] & 0xF) << 4);
                    for (int a = 0; a < 2; a++)
                        for (int k = 0; k < 4; k++)
                            g[256 + 64 * a + 4 * r + k] = (uint8_t)(x[8 * a + k] >> 4 | (x[8 * a + 4 + k] >> 4) << 2 |
                                                                    (x[16 + 8 * a + k] >> 4) << 4 |
                                                                    (x[16 + 8 * a + 4 + k] >> 4) << 6);
                }
            }
        }
    }
    return 0;
}

/* Rows of W (N rows of Q4_0, Q4_1 or Q8_0, N a multiple of 16, K of 32) into out in the
 * 16-row layout of `type` (PG_Q4_0_R16 ..., ggml_common.h); row_bytes stays the file's.
 * Returns -1 where the type or the shape does not fit. */
int pg_repack_r16(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, uint8_t *out) {
    if (!pg_is_r16(type)) return -1;
    const int base = pg_r16_base(type);
    const int64_t bytes = pg_b32_bytes(base), groups = K / 32;
    if (N % 16 != 0 || K % 32 != 0 || row_bytes != bytes * groups) return -1;
    const int head = base == 3 ? 4 : 2, vecs = base == 8 ? 8 : 4;
#pragma omp parallel for schedule(static) if (N * K >= 1 << 20)
    for (int64_t t = 0; t < N / 16; t++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *o = out + t * 16 * row_bytes + g * 16 * bytes;
            for (int w = 0; w < 16; w++) {
                const uint8_t *b = W + (16 * t + w) * row_bytes + g * bytes;
                memcpy(o + 2 * w, b, 2);
                if (base == 3) memcpy(o + 32 + 2 * w, b + 2, 2);
                for (int c = 0; c < vecs; c++) memcpy(o + 16 * head + 64 * c + 4 * w, b + head + 4 * c, 4);
            }
        }
    }
    return 0;
}

/* sum_k a[k] * b[k] */
static inline float dot1(const float *a, const float *b, int64_t K) {
    int64_t k = 0;
    float tail = 0.0f;
#ifdef PG_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
    }
    for (; k + 8 <= K; k += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
    tail = pg_hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#endif
    for (; k < K; k++) tail += a[k] * b[k];
    return tail;
}

#ifdef PG_AVX2

/* out[i] = sum_k w[k] * x[i][k] for 2 rows of x (stride ldx), each summed exactly as dot1
 * sums it (the same four accumulators, tail and order): a row's result does not depend on
 * how many rows the product has, so a speculative verify run's rows give the numbers they
 * give decoded one at a time. */
static inline void dot2(const float *w, const float *x, int64_t ldx, int64_t K, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
           b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    const float *x0 = x, *x1 = x + ldx;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        const __m256 w2 = _mm256_loadu_ps(w + k + 16), w3 = _mm256_loadu_ps(w + k + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + k + 8), a1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + k + 16), a2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + k + 24), a3);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + k + 8), b1);
        b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + k + 16), b2);
        b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + k + 24), b3);
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
    }
    float r0 = pg_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float r1 = pg_hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    for (; k < K; k++) {
        r0 += w[k] * x0[k];
        r1 += w[k] * x1[k];
    }
    out[0] = r0;
    out[1] = r1;
}
#endif

/* ------------------------------------------------------------------ entries */

#ifndef PG_PARALLEL_MIN
#define PG_PARALLEL_MIN 262144
#endif

/* Y[m, n] = sum_k X[m, k] * W[n, k] for m < M, n < N. Each output row n dequantizes
 * its weight row once into a per-thread buffer and takes the dot product with every
 * row of X (the weight is read once whatever M is). The part does thread ith's output
 * rows; wrow: pg_gemm_scratch(K) floats, 64-byte aligned. The type must be supported. */
int64_t pg_gemm_scratch(int64_t K) { return (K + 15) / 16 * 16; }

void pg_gemm_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                  const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy, float *wrow,
                  const pg_team *team) {
    int64_t n0, n1;
    /* Below ~PG_PARALLEL_MIN multiply-adds one thread finishes before a team would have
     * started (and a busy machine makes every team wait for its slowest thread). */
    pg_share_if(N * K * M >= PG_PARALLEL_MIN, N, team, &n0, &n1);
    for (int64_t n = n0; n < n1; n++) {
#ifdef PG_AVX2
        if (M == 1) { /* one input row: dequantize in registers, no row buffer */
            const uint8_t *row = W + n * row_bytes;
            int64_t groups = K / 32;
            float r;
            switch (type) {
                case T_Q4_0: r = dot_q4_0(row, groups, X); break;
                case T_Q4_1: r = dot_q4_1(row, groups, X); break;
                case T_Q5_0: r = dot_q5_0(row, groups, X); break;
                case T_Q5_1: r = dot_q5_1(row, groups, X); break;
                case T_Q8_0: r = dot_q8_0(row, groups, X); break;
                case T_Q4_K: r = dot_q4_k(row, groups, X); break;
                case T_Q5_K: r = dot_q5_k(row, groups, X); break;
                case T_Q6_K: r = dot_q6_k(row, groups, X); break;
                default: goto buffered;
            }
            Y[n] = r;
            continue;
        }
    buffered:;
#endif
        const float *w = wrow;
        if (type == T_F32) {
            w = (const float *)(W + n * row_bytes);
        } else {
            dequant_row_n(type, W, row_bytes, n, K, wrow);
        }
        int64_t m = 0;
#ifdef PG_AVX2
        float r[2];
        for (; m + 2 <= M; m += 2) {
            dot2(w, X + m * ldx, ldx, K, r);
            Y[m * ldy + n] = r[0];
            Y[(m + 1) * ldy + n] = r[1];
        }
#endif
        for (; m < M; m++) Y[m * ldy + n] = dot1(w, X + m * ldx, K);
    }
}

/* pg_gemm_part in a region of its own. Returns 0, or -1 for a type without a kernel /
 * memory failure. */
int pg_gemm(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
            const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy) {
    if (!pg_type_supported(type) || (pg_rows16(type) && N % 16)) return -1;
    atomic_int failed = 0;
    PG_TEAM_RUN(N * K * M >= PG_PARALLEL_MIN, {
        float *wrow = (float *)aligned_alloc(64, (size_t)pg_gemm_scratch(K) * sizeof(float));
        if (wrow == NULL) {
            atomic_store(&failed, 1);
        } else {
            pg_gemm_part(type, W, row_bytes, N, K, X, ldx, M, Y, ldy, wrow, &team);
            free(wrow);
        }
    });
    return failed ? -1 : 0;
}

/* out[i, :] = row (ids ? ids[i] : n0 + i) of W as float32, for i < count. */
int pg_dequant_rows(int type, const uint8_t *W, int64_t row_bytes, int64_t K,
                    const int64_t *ids, int64_t n0, int64_t count, float *out) {
    if (!pg_type_supported(type)) return -1;
#pragma omp parallel for schedule(static) if (count * K >= 65536)
    for (int64_t i = 0; i < count; i++) {
        int64_t r = ids ? ids[i] : n0 + i;
        dequant_row_n(type, W, row_bytes, r, K, out + i * K);
    }
    return 0;
}
