/* Opt-in 8-bit activations for GGUF weights (PAGELLM_GGUF_ACTIVATIONS=q8), as llama.cpp
 * computes: each input row is quantized per 32 values to int8 with one float scale
 * (round(x / d), d = max|x| / 127), and a weight group's integer values are multiplied
 * with them in integers (AVX2 maddubs), the scales applied once per group. The weights'
 * values are the file's exactly; the activations are approximated (~0.4% per value),
 * so results differ from the float32 path beyond summation order: never the default.
 *
 *   pg_quantize_q8  X [M, K] float -> QX [M, K] int8, DX [M, K/32] scales,
 *                   SX [M, K/16] sums of each 16 int8 values
 *   pg_gemm_q8      Y[m, n] = sum_k X[m, k] * W[n, k] for the types in pg_q8_supported
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ggml_common.h"

enum { Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q5_0 = 6, Q_Q5_1 = 7, Q_Q8_0 = 8, Q_Q4_K = 12, Q_Q5_K = 13, Q_Q6_K = 14 };

int pg_q8_supported(int type) {
#ifdef PG_AVX2
    switch (type) {
        case Q_Q4_0: case Q_Q4_1: case Q_Q5_0: case Q_Q5_1: case Q_Q8_0:
        case Q_Q4_K: case Q_Q5_K: case Q_Q6_K:
            return 1;
        default:
            return 0;
    }
#else
    (void)type;
    return 0;
#endif
}

void pg_quantize_q8(const float *X, int64_t ldx, int64_t M, int64_t K, int8_t *QX, float *DX,
                    int32_t *SX) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = X + m * ldx;
        for (int64_t g = 0; g < K / 32; g++) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * g + j]));
            float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = QX + m * K + 32 * g;
            int32_t s0 = 0, s1 = 0;
            for (int j = 0; j < 32; j++) {
                q[j] = (int8_t)lrintf(x[32 * g + j] * inv);
                if (j < 16) s0 += q[j]; else s1 += q[j];
            }
            DX[m * (K / 32) + g] = d;
            SX[m * (K / 16) + 2 * g] = s0;
            SX[m * (K / 16) + 2 * g + 1] = s1;
        }
    }
}

#ifdef PG_AVX2

/* sum of u8 w[i] * s8 x[i] per 16-value half: int32 lanes 0-3 (values 0-15), 4-7 (16-31);
 * one VNNI instruction where the CPU has AVX-VNNI */
static inline __m256i udot(__m256i w, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}


/* The 6-bit scales and mins of a Q4_K / Q5_K super-block's 8 sub-blocks. */
static inline void k4_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
        mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* Per-type dot products of one weight row with one quantized input row. Two vector
 * accumulators alternate between groups so consecutive FMAs do not wait on each other;
 * offsets and minimums (times the sums of x) gather in `extra`. */

#define BLOCK32_DOT(NAME, BYTES, BODY)                                                   \
    static float NAME(const uint8_t *row, int64_t groups, const int8_t *qx,              \
                      const float *dx, const int32_t *sx) {                              \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                      \
        float extra = 0.0f;                                                              \
        for (int64_t g = 0; g < groups; g++) {                                           \
            const uint8_t *b = row + (BYTES) * g;                                        \
            __m256i x = _mm256_loadu_si256((const __m256i *)(qx + 32 * g));              \
            float d_x = dx[g];                                                           \
            int32_t sum_x = sx[2 * g] + sx[2 * g + 1];                                   \
            __m256i w;                                                                   \
            float scale;                                                                 \
            BODY                                                                         \
            acc[g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w, x)),                 \
                                         _mm256_set1_ps(scale), acc[g & 1]);             \
        }                                                                                \
        (void)sx;                                                                        \
        return pg_hsum(_mm256_add_ps(acc[0], acc[1])) + extra;                             \
    }

/* signed weights (offset already subtracted): |w| times x carrying w's sign */
#define SIGNED_W(ws) do { x = _mm256_sign_epi8(x, ws); w = _mm256_sign_epi8(ws, ws); } while (0)

BLOCK32_DOT(dot_q4_0, 18, {
    (void)sum_x;
    __m256i ws = _mm256_sub_epi8(pg_nibbles_32(b + 2), _mm256_set1_epi8(8));
    SIGNED_W(ws);
    scale = pg_f16(b) * d_x;
})
BLOCK32_DOT(dot_q4_1, 20, {
    w = pg_nibbles_32(b + 4);
    scale = pg_f16(b) * d_x;
    extra += pg_f16(b + 2) * d_x * sum_x;
})
BLOCK32_DOT(dot_q5_0, 22, {
    (void)sum_x;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m256i ws = _mm256_sub_epi8(_mm256_or_si256(pg_nibbles_32(b + 6), pg_bits_to_0x10(qh)), _mm256_set1_epi8(16));
    SIGNED_W(ws);
    scale = pg_f16(b) * d_x;
})
BLOCK32_DOT(dot_q5_1, 24, {
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    w = _mm256_or_si256(pg_nibbles_32(b + 8), pg_bits_to_0x10(qh));
    scale = pg_f16(b) * d_x;
    extra += pg_f16(b + 2) * d_x * sum_x;
})
BLOCK32_DOT(dot_q8_0, 34, {
    (void)sum_x;
    __m256i ws = _mm256_loadu_si256((const __m256i *)(b + 2));
    SIGNED_W(ws);
    scale = pg_f16(b) * d_x;
})

/* Q4_K (high5 = 0) and Q5_K (high5 = 1): super-blocks of 8 groups of 32; groups 2j and
 * 2j+1 are the low and high nibbles of the same 32 bytes, loaded once. */
static inline float dot_k45(const uint8_t *row, int64_t groups, const int8_t *qx,
                            const float *dx, const int32_t *sx, int high5) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    float extra = 0.0f;
    int64_t bytes = high5 ? 176 : 144, qs_off = high5 ? 48 : 16;
    for (int64_t sb = 0; sb < groups / 8; sb++) {
        const uint8_t *b = row + sb * bytes;
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        float d = pg_f16(b), dmin = pg_f16(b + 2);
        __m256i qh = high5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        const int64_t g0 = sb * 8;
        for (int j = 0; j < 4; j++) {
            int64_t g = g0 + 2 * j;
            __m256i q = _mm256_loadu_si256((const __m256i *)(b + qs_off + 32 * j));
            __m256i w0 = _mm256_and_si256(q, low4);
            __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (high5) {
                w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4));
                w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
            }
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + 32 * g));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + 32 * g + 32));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w0, x0)),
                                   _mm256_set1_ps(d * sc[2 * j] * dx[g]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w1, x1)),
                                   _mm256_set1_ps(d * sc[2 * j + 1] * dx[g + 1]), acc1);
            extra -= dmin * (mn[2 * j] * dx[g] * (sx[2 * g] + sx[2 * g + 1]) +
                             mn[2 * j + 1] * dx[g + 1] * (sx[2 * g + 2] + sx[2 * g + 3]));
        }
    }
    return pg_hsum(_mm256_add_ps(acc0, acc1)) + extra;
}

/* Q6_K: two scales per group (16 values each), values u6 - 32. Each half super-block
 * (4 groups) loads its 64 low-bit bytes and 32 high-bit bytes once. */
static float dot_q6_k(const uint8_t *row, int64_t groups, const int8_t *qx, const float *dx,
                      const int32_t *sx) {
    (void)sx;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < groups / 8; sb++) {
        const uint8_t *b = row + sb * 210;
        float d = pg_f16(b + 208);
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i lo[4] = {
                _mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
            __m256i hi[4] = {
                _mm256_and_si256(qh, three), _mm256_and_si256(_mm256_srli_epi16(qh, 2), three),
                _mm256_and_si256(_mm256_srli_epi16(qh, 4), three),
                _mm256_and_si256(_mm256_srli_epi16(qh, 6), three)};
            for (int t = 0; t < 4; t++) {
                int64_t g = sb * 8 + 4 * h + t;
                __m256i ws = _mm256_sub_epi8(_mm256_or_si256(lo[t], _mm256_slli_epi16(hi[t], 4)), off);
                __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qx + 32 * g)), ws);
                __m256i w = _mm256_sign_epi8(ws, ws);
                const int8_t *sc = scales + 8 * h + 2 * t;
                float dg = d * dx[g];
                __m256 scale = _mm256_set_m128(_mm_set1_ps(dg * sc[1]), _mm_set1_ps(dg * sc[0]));
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w, x)), scale, acc1);
                else
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w, x)), scale, acc0);
            }
        }
    }
    return pg_hsum(_mm256_add_ps(acc0, acc1));
}

static float dot_row_q8(int type, const uint8_t *row, int64_t groups, const int8_t *qx,
                        const float *dx, const int32_t *sx) {
    switch (type) {
        case Q_Q4_0: return dot_q4_0(row, groups, qx, dx, sx);
        case Q_Q4_1: return dot_q4_1(row, groups, qx, dx, sx);
        case Q_Q5_0: return dot_q5_0(row, groups, qx, dx, sx);
        case Q_Q5_1: return dot_q5_1(row, groups, qx, dx, sx);
        case Q_Q8_0: return dot_q8_0(row, groups, qx, dx, sx);
        case Q_Q4_K: return dot_k45(row, groups, qx, dx, sx, 0);
        case Q_Q5_K: return dot_k45(row, groups, qx, dx, sx, 1);
        case Q_Q6_K: return dot_q6_k(row, groups, qx, dx, sx);
        default: return NAN;
    }
}
#endif

/* Y[m, n] (rows ldy apart) for the quantized input rows from pg_quantize_q8. */
int pg_gemm_q8(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
               const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
               int64_t ldy) {
    if (!pg_q8_supported(type) || K % 32) return -1;
#ifdef PG_AVX2
#pragma omp parallel for schedule(static) if (N * K * M >= 262144)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = W + n * row_bytes;
        for (int64_t m = 0; m < M; m++)
            Y[m * ldy + n] = dot_row_q8(type, row, K / 32, QX + m * K, DX + m * (K / 32),
                                        SX + m * (K / 16));
    }
    return 0;
#else
    (void)W; (void)row_bytes; (void)N; (void)QX; (void)DX; (void)SX; (void)M; (void)Y; (void)ldy;
    return -1;
#endif
}
