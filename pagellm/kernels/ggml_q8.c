/* 8-bit activations for GGUF weights, as llama.cpp computes them: each input row is
 * quantized per 32 values to int8 with one float scale (round(x / d), d = max|x| / 127),
 * and a weight group's integer values are multiplied with them in integers (AVX-512
 * VNNI vpdpbusd, chosen at run time; else AVX2 maddubs, or AVX-VNNI where built with it),
 * the scales applied once per group. The weights' values are the file's exactly; the
 * activations are approximated (~0.4% per value). A row may be rounded in two levels
 * (the second rounds what the first left: x ~ d1 q1 + d2 q2, ~1/250 of one level's
 * error), multiplied as two rows and summed. The default for GGUF decode rows where the
 * CPU has these kernels (EngineArgs.gguf_activations: q8 one level, the head two; q8x2
 * two everywhere); float32 is the exact path (ggml_cpu.c).
 *
 *   pg_quantize_q8  X [M, K] float -> QX [M L, K] int8, DX [M L, K/32] scales,
 *                   SX [M L, K/16] sums of each 16 int8 values, in L levels per row
 *   pg_gemm_q8      Y[m, n] = sum_k X[m, k] * W[n, k] for the types in pg_q8_supported
 *   pg_head_q8      the logits head: two levels where they can change a row's top logit
 *                   (pg_head_bounds: its bounds per 16 rows and 32 values)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

/* How far ahead of the weights being read the kernels ask for the next ones (bytes; a
 * row's end runs into the next row, which follows it). The hardware prefetcher alone
 * leaves a decode step waiting on memory: on the 8B-shaped file (2 cores, AVX-512 VNNI),
 * decode speed relative to 4096 bytes: 512 0.80x, 1024 0.87x, 2048 0.94x, 8192 0.97x,
 * none 0.78x (chained from pairwise A/B runs in one process, alternating every step). */
#define PF_AHEAD 4096
#define PREFETCH(p, bytes)                                                                   \
    for (int pf_ = 0; pf_ < (bytes); pf_ += 64)                                              \
        _mm_prefetch((const char *)(p) + PF_AHEAD + pf_, _MM_HINT_T0)

/* Products below this many multiply-adds run on the calling thread alone. */
#define Q8_PARALLEL_MIN 262144

enum { Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q5_0 = 6, Q_Q5_1 = 7, Q_Q8_0 = 8, Q_Q4_K = 12, Q_Q5_K = 13, Q_Q6_K = 14 };

/* 0: the AVX2 kernels even where AVX-512 VNNI is present (tests compare the two). */
int pg_q8_wide = 1;

/* 2: AVX-512 VNNI kernels, 1: AVX2 (VNNI where built with AVX-VNNI), 0: none. */
int pg_q8_isa(void);

int pg_q8_supported(int type) {
#ifdef PG_AVX2
    switch (type) {
        case Q_Q4_0: case Q_Q4_1: case Q_Q5_0: case Q_Q5_1: case Q_Q8_0:
        case Q_Q4_K: case Q_Q5_K: case Q_Q6_K: case PG_Q4_K_R16: case PG_Q5_K_R16: case PG_Q6_K_R16:
        case PG_Q4_0_R16: case PG_Q4_1_R16: case PG_Q8_0_R16:
            return 1;
        default:
            return 0;
    }
#else
    (void)type;
    return 0;
#endif
}

#ifdef PG_AVX2
/* quantize_group in vectors: the same operations, so the same bytes (max is exact, and
 * the conversion rounds to nearest even as lrintf does). */
static inline int32_t hsum_epi32(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(a);
}

static void quantize_group_avx2(const float *x, int8_t *q, float *d_out, int32_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) { /* a NaN lane keeps `top`, as the scalar comparison does */
        v[i] = _mm256_loadu_ps(x + 8 * i);
        top = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), top);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inv = d >= FLT_MIN ? 1.0f / d : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    s[0] = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
    s[1] = hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
    /* packs work within 128-bit lanes: dwords come out as q0 q1 q2 q3 (values 0-3 of each
     * vector), then values 4-7; the permute puts each vector's 8 values together */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d_out = d;
}
#endif

/* One group of 32 values: q = round(x / d) (to nearest, ties to even), d = max|x| / 127,
 * and the sums of q's two halves; a group whose d is below FLT_MIN (1/d would overflow)
 * rounds to zeros. */
static void quantize_group(const float *x, int8_t *q, float *d_out, int32_t *s) {
#ifdef PG_AVX2
    quantize_group_avx2(x, q, d_out, s);
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) { /* not fmaxf: a libm call per value in this build */
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, inv = d >= FLT_MIN ? 1.0f / d : 0.0f;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 32; j++) {
        q[j] = (int8_t)lrintf(x[j] * inv);
        if (j < 16) s0 += q[j]; else s1 += q[j];
    }
    *d_out = d;
    s[0] = s0;
    s[1] = s1;
#endif
}

/* Thread ith's share of the M * K/32 groups of X's rows (row m is row rows[m] of X; rows
 * NULL: row m), each rounded in `levels` int8 levels: level l + 1 rounds what level l
 * left (x - d q), so that x ~ the sum of the levels' d q, each level ~1/250 of the one
 * before. Quantized row m * levels + l holds level l of row m. */
void pg_quantize_q8_part(const float *X, int64_t ldx, const int64_t *rows, int64_t M,
                         int64_t K, int64_t levels, int8_t *QX, float *DX, int32_t *SX,
                         const pg_team *team) {
    const int64_t G = K / 32;
    int64_t lo, hi;
    pg_share(M * G, team, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const int64_t m = i / G, g = i % G;
        const float *x = X + (rows != NULL ? rows[m] : m) * ldx + 32 * g;
        float rest[32];
        for (int64_t l = 0; l < levels; l++) {
            const int64_t at = (m * levels + l) * G + g; /* this level's group */
            quantize_group(l == 0 ? x : rest, QX + 32 * at, DX + at, SX + 2 * at);
            if (l + 1 < levels)
                for (int j = 0; j < 32; j++)
                    rest[j] = (l == 0 ? x[j] : rest[j]) - (float)QX[32 * at + j] * DX[at];
        }
    }
}

void pg_quantize_q8(const float *X, int64_t ldx, int64_t M, int64_t K, int64_t levels,
                    int8_t *QX, float *DX, int32_t *SX) {
    /* one thread for decode rows; a team for a prompt's (the int8 GEMM's inputs) */
    PG_TEAM_RUN(M * K >= 1 << 18, pg_quantize_q8_part(X, ldx, NULL, M, K, levels, QX, DX, SX, &team));
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

/* The 6-bit scales and minimums of a Q4_K / Q5_K super-block in a vector (bytes 0-7 the 8
 * scales, 8-15 the 8 minimums), from 16 bytes at q (the 12 of the scales first):
 * scales 0-3 and minimums 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales 4-7 and
 * minimums 4-7 the low and high nibbles of bytes 8-11, with bits 4-5 the top 2 bits of
 * bytes 0-3 and 4-7. */
static inline __attribute__((always_inline)) __m128i k4_scales_simd(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(a, 4),
                                       _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    return _mm_or_si128(_mm_or_si128(low, high), _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
}

/* The sums of x over each of 8 groups of 32, from its sums per 16 (a: groups 0-3's,
 * b: 4-7's). */
static inline __attribute__((always_inline)) __m256 pairs_to_sums32(__m256i a, __m256i b) {
    /* hadd: [g0 g1 g4 g5 | g2 g3 g6 g7] in 64-bit pairs, then the pairs in order */
    return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8));
}

static inline __attribute__((always_inline)) __m256 sums32_avx2(const int32_t *s16) {
    return pairs_to_sums32(_mm256_loadu_si256((const __m256i *)s16),
                           _mm256_loadu_si256((const __m256i *)(s16 + 8)));
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
            PREFETCH(b, 1);                                                              \
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
 * 2j+1 are the low and high nibbles of the same 32 bytes, loaded once. The 8 groups'
 * scales (times d and x's scales) and minimums are vectors per super-block; a group's
 * scale is spread over its lanes by a permute. */
static inline float dot_k45(const uint8_t *row, int64_t groups, const int8_t *qx,
                            const float *dx, const int32_t *sx, int high5) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    int64_t bytes = high5 ? 176 : 144, qs_off = high5 ? 48 : 16;
    for (int64_t sb = 0; sb < groups / 8; sb++) {
        const uint8_t *b = row + sb * bytes;
        PREFETCH(b, bytes);
        const __m128i smv = k4_scales_simd(b + 4);
        const __m256 d8 = _mm256_loadu_ps(dx + 8 * sb);
        const __m256 S = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)),
                                                     _mm256_set1_ps(pg_f16(b))), d8);
        const __m256 mn = _mm256_mul_ps(
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))),
                          _mm256_set1_ps(pg_f16(b + 2))), d8);
        mins = _mm256_fmadd_ps(mn, sums32_avx2(sx + 16 * sb), mins);
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
                                   _mm256_permutevar8x32_ps(S, _mm256_set1_epi32(2 * j)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w1, x1)),
                                   _mm256_permutevar8x32_ps(S, _mm256_set1_epi32(2 * j + 1)), acc1);
        }
    }
    return pg_hsum(_mm256_add_ps(acc0, acc1)) - pg_hsum(mins);
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
        PREFETCH(b, 210);
        /* the 16 scales times d, 8 per half super-block */
        const __m128i sc16 = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m256 dv = _mm256_set1_ps(pg_f16(b + 208));
        const __m256 half_sc[2] = {
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16)), dv),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))), dv)};
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
                /* lanes 0-3 the group's first scale, 4-7 its second, times x's scale */
                const __m256i pick = _mm256_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1,
                                                       2 * t + 1, 2 * t + 1, 2 * t + 1);
                __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(half_sc[h], pick),
                                             _mm256_set1_ps(dx[g]));
                if (t & 1)
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w, x)), scale, acc1);
                else
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot(w, x)), scale, acc0);
            }
        }
    }
    return pg_hsum(_mm256_add_ps(acc0, acc1));
}

/* Q8_0 in chunks of 8 blocks: the chunk's 8 scales read into one vector, times x's 8
 * scales, and spread over a block's lanes by a permute. With AVX-VNNI the weights are
 * shifted by 128 to unsigned values, the shift taken back through the sums of x; without
 * it maddubs would saturate on those (255 x 127 twice passes int16), so |w| multiplies x
 * carrying w's sign, as in dot_q8_0. The blocks after the last whole chunk take dot_q8_0.
 * (The same shape for Q4_0 / Q4_1 measured slower than their per-block kernels here: 7-8
 * against 9-10 GB/s on one core.) */
static float dot_q8_0x8(const uint8_t *row, int64_t groups, const int8_t *qx, const float *dx,
                        const int32_t *sx) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    int64_t g0 = 0;
    for (; g0 + 8 <= groups; g0 += 8) {
        const uint8_t *c = row + g0 * 34;
        PREFETCH(c, 8 * 34);
        int32_t h[8];
        for (int i = 0; i < 8; i++) memcpy(&h[i], c + i * 34, 4);
        const __m256i d16 = _mm256_and_si256(
            _mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), _mm256_set1_epi32(0xFFFF));
        const __m256 S = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(d16), _mm256_extracti128_si256(d16, 1))),
            _mm256_loadu_ps(dx + g0));
#ifdef __AVXVNNI__
        off = _mm256_fmadd_ps(_mm256_mul_ps(S, _mm256_set1_ps(-128.0f)), sums32_avx2(sx + 2 * g0), off);
#endif
        for (int p = 0; p < 8; p++) {
#ifdef __AVXVNNI__
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + p * 34 + 2)),
                                               _mm256_set1_epi8((char)0x80));
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + 32 * (g0 + p)));
#else
            const __m256i ws = _mm256_loadu_si256((const __m256i *)(c + p * 34 + 2));
            const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qx + 32 * (g0 + p))), ws);
            const __m256i w = _mm256_sign_epi8(ws, ws);
#endif
            const __m256 dot = _mm256_cvtepi32_ps(udot(w, x));
            const __m256 scale = _mm256_permutevar8x32_ps(S, _mm256_set1_epi32(p));
            if (p & 1) acc1 = _mm256_fmadd_ps(dot, scale, acc1);
            else acc0 = _mm256_fmadd_ps(dot, scale, acc0);
        }
    }
    float y = pg_hsum(_mm256_add_ps(acc0, acc1)) + pg_hsum(off);
    if (g0 < groups)
        y += dot_q8_0(row + g0 * 34, groups - g0, qx + 32 * g0, dx + g0, sx + 2 * g0);
    return y;
}

/* Row n of a Q4_K_R16 (Q5_K_R16: five) matrix (ggml_common.h) with one quantized input
 * row, in scalars: what the AVX2 path runs for it (the AVX-512 kernel is k16_rows). */
static float dot_k16(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, int five,
                     const int8_t *qx, const float *dx, const int32_t *sx) {
    const int r = (int)(n & 15);
    float acc = 0.0f, mins = 0.0f;
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = pg_k16_block(W, row_bytes, n, sb, five);
        for (int j = 0; j < 8; j++) {
            const int64_t g = 8 * sb + j;
            uint8_t q[16];
            pg_k16_values(b, r, j, q);
            const uint32_t fifth = five ? pg_k16_fifth_bits(b, r, j) : 0;
            const int8_t *x = qx + 32 * g;
            float d, m;
            pg_k16_scale_min(b, r, j, &d, &m);
            int32_t dot = 0;
            for (int i = 0; i < 16; i++)
                dot += ((q[i] & 0xF) | (int)((fifth >> i) & 1) << 4) * x[i] +
                       ((q[i] >> 4) | (int)((fifth >> (16 + i)) & 1) << 4) * x[i + 16];
            acc += d * dx[g] * (float)dot;
            mins += m * dx[g] * (float)(sx[2 * g] + sx[2 * g + 1]);
        }
    }
    return acc - mins;
}

/* Row n of a Q6_K_R16 matrix with one quantized input row: the file's super-blocks put
 * back together, then the Q6_K kernel (what the AVX2 path runs for it). */
static float dot_q6_16(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, const int8_t *qx,
                       const float *dx, const int32_t *sx) {
    uint8_t blocks[56 * 210]; /* up to K = 14336 at once */
    float y = 0.0f;
    for (int64_t sb0 = 0; sb0 < K / 256; sb0 += 56) {
        const int64_t count = K / 256 - sb0 < 56 ? K / 256 - sb0 : 56;
        for (int64_t sb = 0; sb < count; sb++) pg_q6_16_file_block(W, row_bytes, n, sb0 + sb, blocks + 210 * sb);
        y += dot_q6_k(blocks, 8 * count, qx + 256 * sb0, dx + 8 * sb0, sx + 16 * sb0);
    }
    return y;
}

static float dot_row_q8(int type, const uint8_t *row, int64_t groups, const int8_t *qx,
                        const float *dx, const int32_t *sx) {
    switch (type) {
        case Q_Q4_0: return dot_q4_0(row, groups, qx, dx, sx);
        case Q_Q4_1: return dot_q4_1(row, groups, qx, dx, sx);
        case Q_Q5_0: return dot_q5_0(row, groups, qx, dx, sx);
        case Q_Q5_1: return dot_q5_1(row, groups, qx, dx, sx);
        case Q_Q8_0: return dot_q8_0x8(row, groups, qx, dx, sx);
        case Q_Q4_K: return dot_k45(row, groups, qx, dx, sx, 0);
        case Q_Q5_K: return dot_k45(row, groups, qx, dx, sx, 1);
        case Q_Q6_K: return dot_q6_k(row, groups, qx, dx, sx);
        default: return NAN;
    }
}
#endif

#ifdef PG_AVX2
/* Row n of a 16-row layout against one quantized input row on the AVX2 kernels, a block
 * at a time (each block put back as the file stored it). */
static float dot_r16(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K,
                     const int8_t *qx, const float *dx, const int32_t *sx) {
    const int base = pg_r16_base(type);
    uint8_t block[34];
    float sum = 0.0f;
    for (int64_t g = 0; g < K / 32; g++) {
        pg_r16_file_block(W, row_bytes, n, g, base, block);
        sum += dot_row_q8(base, block, 1, qx + 32 * g, dx + g, sx + 2 * g);
    }
    return sum;
}

/* The levels of one input row summed: Y[row m, column n] for the R quantized rows from
 * m0 whose products are in out. */
static inline void store_sums(const float *out, int R, int64_t m0, int64_t levels, float *Y,
                              int64_t ldy, const int64_t *yrows, int64_t n) {
    for (int r = 0; r < R; r += (int)levels) {
        const int64_t m = (m0 + r) / levels;
        float sum = out[r];
        for (int l = 1; l < levels; l++) sum += out[r + l];
        Y[(yrows != NULL ? yrows[m] : m) * ldy + n] = sum;
    }
}
#endif

#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
/* AVX-512 with VNNI (vpdpbusd on 64 bytes), chosen at run time like ggml_gemm.c's tiles.
 * A weight row is unpacked into registers once and multiplied by up to ROWS512 input
 * rows. Every type keeps the shape of the AVX2 kernels above: a 64-byte vector of
 * unsigned weight values (offsets subtracted through the sums of x) against 64 int8
 * activations, 16 int32 lanes of 4 products; lanes of one group share its scale, which a
 * permute spreads from a vector of the super-block's (or 8 blocks') scales. */
#define VNNI512 PG_VNNI512
#define ROWS512 4
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* Input row r of a 16-row kernel's rows: the r-th of a list of quantized rows, or the r-th
 * from its first (no list: every call but pg_head_q8's, where the test folds away). */
#define ROW(ix, r) ((ix) != NULL ? (int64_t)(ix)[r] : (int64_t)(r))
/* A loop over a 16-row kernel's input rows unrolled whole (R is a constant there): its
 * sums stay in registers. Left to itself GCC kept the loop, and the sums in memory: a
 * load, a fused multiply-add and a store per row and group. */
#if defined(__clang__)
#define UNROLL_ROWS _Pragma("unroll")
#else
#define UNROLL_ROWS _Pragma("GCC unroll 8")
#endif

static int vnni512(void) {
    static volatile int level = -1; /* a race writes the same value */
    if (level < 0) {
        __builtin_cpu_init();
        level = pg_avx512_full() && __builtin_cpu_supports("avx512vnni");
    }
    return level && pg_q8_wide;
}

VNNI512 static ALWAYS_INLINE __m512i lane_div(int shift) { /* lane l -> l >> shift */
    return _mm512_srli_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), shift);
}

/* sums32_avx2 for `n` (<= 8) groups: the loads masked to them. */
VNNI512 static ALWAYS_INLINE __m256 sums32(const int32_t *s16, int n) {
    if (n == 8) return sums32_avx2(s16);
    const __mmask16 m = (__mmask16)((1u << (2 * n)) - 1);
    return pairs_to_sums32(_mm256_maskz_loadu_epi32((__mmask8)m, s16),
                           _mm256_maskz_loadu_epi32((__mmask8)(m >> 8), s16 + 8));
}

/* Q4_K (high5 = 0) and Q5_K: 8 groups of 32 per super-block; 32 bytes hold groups 2j and
 * 2j+1 as their low and high nibbles. One 64-byte load covers bytes of groups 4i and 4i+2
 * (low nibbles) and 4i+1 and 4i+3 (high): an AND and a shift give two vectors of values,
 * which meet x read in the order k45_inputs leaves it (each super-block's groups as
 * 0 2 1 3 4 6 5 7); xs: the sums of each group of x as floats. */
VNNI512 static ALWAYS_INLINE void k45_rows(const uint8_t *row, int64_t nsb, const int8_t *qx,
                                           const float *dx, const float *xs, int64_t K,
                                           const int high5, const int R, float *y, int64_t ldy) {
    const int64_t bytes = high5 ? 176 : 144, qs_off = high5 ? 48 : 16;
    const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    const __m512i two_halves = _mm512_slli_epi32(lane_div(3), 1); /* lanes 8-15: +2 groups */
    __m512 acc[ROWS512][2]; /* two chains per row: consecutive FMAs do not wait on each other */
    __m256 mins[ROWS512];
    for (int r = 0; r < R; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        mins[r] = _mm256_setzero_ps();
    }
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * bytes;
        PREFETCH(b, bytes);
        /* lanes 0-7: the 8 scales times d, 8-15: the 8 minimums times dmin */
        uint32_t dd;
        memcpy(&dd, b, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd)); /* d, dmin */
        const __m512 sm = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales_simd(b + 4))),
            _mm512_insertf32x8(_mm512_broadcastss_ps(dm),
                               _mm256_broadcastss_ps(_mm_movehdup_ps(dm)), 1));
        __m512 S[ROWS512];
        for (int r = 0; r < R; r++) { /* times x's 8 scales: lanes 0-7 S, 8-15 the minimums' */
            S[r] = _mm512_mul_ps(sm, _mm512_broadcast_f32x8(_mm256_loadu_ps(dx + r * (K / 32) + 8 * sb)));
            mins[r] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(S[r], 1),
                                      _mm256_loadu_ps(xs + r * (K / 32) + 8 * sb), mins[r]);
        }
        const __m512i qh = high5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                 : _mm512_setzero_si512();
        for (int i = 0; i < 2; i++) {
            const __m512i q = _mm512_loadu_si512(b + qs_off + 64 * i);
            __m512i w0 = _mm512_and_si512(q, low4);                       /* groups 4i, 4i+2 */
            __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4); /* 4i+1, 4i+3 */
            if (high5) { /* group g's fifth bits: bit g of each qh byte, to bit 4 */
                const __m512i at = _mm512_set_epi64(4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 2,
                                                    4 * i, 4 * i, 4 * i, 4 * i);
                w0 = _mm512_or_si512(w0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qh, at), one), 4));
                w1 = _mm512_or_si512(w1, _mm512_slli_epi16(_mm512_and_si512(
                    _mm512_srlv_epi64(qh, _mm512_add_epi64(at, _mm512_set1_epi64(1))), one), 4));
            }
            const __m512i i0 = _mm512_add_epi32(two_halves, _mm512_set1_epi32(4 * i));
            const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(1));
            for (int r = 0; r < R; r++) {
                const int8_t *x = qx + r * K + 256 * sb + 128 * i;
                const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(x));
                const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512(x + 64));
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(i0, S[r]), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(i1, S[r]), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) - pg_hsum(mins[r]);
}

/* The P quantized rows of x as k45_rows reads them: each super-block's 32-value groups
 * in the order 0 2 1 3 4 6 5 7, and each group's sum as a float; in a buffer of the
 * calling thread's, grown as needed and kept. 0 where memory ran out. */
VNNI512 static int k45_inputs(const int8_t *QX, const int32_t *SX, int64_t P, int64_t K,
                              const int8_t **px, const float **xs) {
    static __thread uint8_t *buf = NULL;
    static __thread int64_t cap = 0;
    const int64_t values = P * K, need = values + 4 * (values / 32);
    if (need > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
        cap = buf != NULL ? need : 0;
        if (buf == NULL) return 0;
    }
    int8_t *x = (int8_t *)buf;
    float *sums = (float *)(buf + values);
    const __m512i even = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i odd = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    for (int64_t i = 0; i < values; i += 128) { /* [g0 g1] [g2 g3] -> [g0 g2] [g1 g3] */
        const __m512i a = _mm512_loadu_si512(QX + i), b = _mm512_loadu_si512(QX + i + 64);
        _mm512_storeu_si512(x + i, _mm512_permutex2var_epi64(a, even, b));
        _mm512_storeu_si512(x + i + 64, _mm512_permutex2var_epi64(a, odd, b));
    }
    for (int64_t g = 0; g < values / 32; g++) sums[g] = (float)(SX[2 * g] + SX[2 * g + 1]);
    *px = x;
    *xs = sums;
    return 1;
}

/* Q4_K_R16 and Q5_K_R16 (five; ggml_common.h): sixteen weight rows against R input rows,
 * in the int8 GEMM's arithmetic. A sub-block's four vectors hold bytes 4c .. 4c+3 of the
 * sixteen rows, so an AND and a shift (Q5_K: and its fifth bits ORed in) give
 * ggml_i8gemm.c's tile (its unpack_tile_k16), and the sixteen
 * scales and minimums are one product each; every input row then takes pg_tile_row, as
 * the GEMM's rows_vnni: a row gets the GEMM's numbers whatever the count. The unpacking
 * (~20 instructions a sub-block) is shared by the input rows, each of which then costs 8
 * vpdpbusd and ~6 more. acc[r]: the 16 rows against input row r. */
#define K16_AHEAD 4096
VNNI512 static ALWAYS_INLINE void k16_rows(const uint8_t *w, int64_t nsb, const int five,
                                           const int8_t *qx, const float *dx, const int32_t *sx,
                                           int64_t K, const int R, const int32_t *ix, __m512 *acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = w + sb * pg_k16_sb_bytes(five);
        /* the bytes K16_AHEAD on: [0, PG_K16_VALUES) of them here, each sub-block's 256 below */
        for (int pf = 0; pf < PG_K16_VALUES; pf += 64) _mm_prefetch((const char *)b + K16_AHEAD + pf, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        for (int j = 0; j < 8; j++) {
            const uint8_t *v = b + PG_K16_VALUES + 256 * j;
            for (int pf = 0; pf < 256; pf += 64) _mm_prefetch((const char *)v + K16_AHEAD + pf, _MM_HINT_T0);
            __m512i t[8];
            pg_k16_tile(v, t);
            if (five) {
                _mm_prefetch((const char *)b + PG_K16_HIGH + 64 * j + K16_AHEAD, _MM_HINT_T0);
                pg_k16_fifth(b + PG_K16_HIGH + 64 * j, t);
            }
            const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                  _mm_loadu_si128((const __m128i *)(b + PG_K16_SCALES + 16 * j)))));
            /* minus the minimums, as rows_vnni reads them from the tile */
            const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + PG_K16_MINS + 16 * j))))));
            const int64_t g = 8 * sb + j;
            UNROLL_ROWS
            for (int r = 0; r < R; r++)
                acc[r] = pg_tile_row(t, s, m, 1, 0, qx + ROW(ix, r) * K + 32 * g, dx[ROW(ix, r) * (K / 32) + g],
                                     sx[ROW(ix, r) * (K / 16) + 2 * g], sx[ROW(ix, r) * (K / 16) + 2 * g + 1], acc[r]);
        }
    }
}

/* Q6_K_R16 (ggml_common.h): sixteen weight rows against R input rows, in the int8 GEMM's
 * arithmetic (pg_q6_16_tile, then pg_tile_row16 for each input row, as the GEMM's
 * rows_vnni): a row gets the GEMM's numbers whatever the count. acc[r]: the 16 rows
 * against input row r. */
VNNI512 static ALWAYS_INLINE void q6_16_rows(const uint8_t *w, int64_t nsb, const int8_t *qx,
                                             const float *dx, const int32_t *sx, int64_t K,
                                             const int R, const int32_t *ix, __m512 *acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = w + sb * PG_Q6_16_SB;
        for (int pf = 0; pf < PG_Q6_16_VALUES; pf += 64) _mm_prefetch((const char *)b + K16_AHEAD + pf, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        for (int j = 0; j < 8; j++) {
            const uint8_t *g = b + PG_Q6_16_VALUES + 384 * j;
            for (int pf = 0; pf < 384; pf += 64) _mm_prefetch((const char *)g + K16_AHEAD + pf, _MM_HINT_T0);
            __m512i t[8];
            pg_q6_16_tile(g, t);
            const __m512 s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(b + PG_Q6_16_SCALES + 32 * j)))));
            const __m512 s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(b + PG_Q6_16_SCALES + 32 * j + 16)))));
            const int64_t gi = 8 * sb + j;
            UNROLL_ROWS
            for (int r = 0; r < R; r++)
                acc[r] = pg_tile_row16(t, s0, s1, 32, qx + ROW(ix, r) * K + 32 * gi, dx[ROW(ix, r) * (K / 32) + gi],
                                       sx[ROW(ix, r) * (K / 16) + 2 * gi], sx[ROW(ix, r) * (K / 16) + 2 * gi + 1], acc[r]);
        }
    }
}

/* Q6_K: values u6 - 32, a scale per 16 values. A half super-block's 64 low-bit bytes are
 * one vector whose low nibbles are its values 0-63 and high nibbles 64-127; the 2-bit
 * high parts come from 32 bytes shifted by 0/2 and 4/6. */
VNNI512 static ALWAYS_INLINE void q6k_rows(const uint8_t *row, int64_t nsb, const int8_t *qx,
                                           const float *dx, const int32_t *sx, int64_t K,
                                           const int R, float *y, int64_t ldy) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    const __m512i lane4 = lane_div(2), lane2 = lane_div(1);
    __m512 acc[ROWS512][2], off[ROWS512]; /* two chains per row, as in k45_rows */
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = off[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 210;
        PREFETCH(b, 210);
        const __m512 sc = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
            _mm512_set1_ps(pg_f16(b + 208)));
        __m512 S[ROWS512];
        for (int r = 0; r < R; r++) {
            const __m512 d16 = _mm512_permutexvar_ps(
                lane2, _mm512_castps256_ps512(_mm256_loadu_ps(dx + r * (K / 32) + 8 * sb)));
            S[r] = _mm512_mul_ps(sc, d16);
            off[r] = _mm512_fmadd_ps(
                S[r], _mm512_cvtepi32_ps(_mm512_loadu_si512(sx + r * (K / 16) + 16 * sb)), off[r]);
        }
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(b + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)),
                                                  _mm256_srli_epi16(qh, 6), 1);
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                               _mm512_slli_epi16(_mm512_and_si512(ha, three), 4));
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                               _mm512_slli_epi16(_mm512_and_si512(hb, three), 4));
            const __m512i ia = _mm512_add_epi32(lane4, _mm512_set1_epi32(8 * h));
            const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(4));
            for (int r = 0; r < R; r++) {
                const int8_t *x = qx + r * K + 256 * sb + 128 * h;
                const __m512i pa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, _mm512_loadu_si512(x));
                const __m512i pb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, _mm512_loadu_si512(x + 64));
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pa), _mm512_permutexvar_ps(ia, S[r]), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pb), _mm512_permutexvar_ps(ib, S[r]), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) -
                     32.0f * _mm512_reduce_add_ps(off[r]);
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 with a float16 scale first (and Q4_1's and
 * Q5_1's minimum next), taken 8 blocks at a time, two blocks per vector: b32_chunk does
 * blocks g0 .. g0+n-1 (n <= 8), adding to acc (products) and off (offsets times the sums
 * of x). Called with n = 8 for the whole chunks, it compiles to straight-line code
 * without masks. Q5's fifth bits (32 per block, bit j for value j) become 0x10 in the
 * bytes of a byte mask: the two blocks' 64 bits select the bytes directly. */
VNNI512 static ALWAYS_INLINE void b32_chunk(const int type, const uint8_t *row, int64_t g0,
                                            const int n, const int8_t *qx, const float *dx,
                                            const int32_t *sx, int64_t K, const int R,
                                            __m512 *acc, __m256 *off) {
    const int64_t bytes = type == Q_Q4_0 ? 18 : type == Q_Q4_1 ? 20 : type == Q_Q5_0 ? 22
                        : type == Q_Q5_1 ? 24 : 34;
    const int minimum = type == Q_Q4_1 || type == Q_Q5_1, five = type == Q_Q5_0 || type == Q_Q5_1;
    const int qh_off = minimum ? 4 : 2, qs_off = five ? qh_off + 4 : qh_off;
    /* the weights' offset, through the sums of x: Q4_0 stores w + 8, Q5_0 w + 16, Q8_0 is
     * shifted by 128 */
    const float offset = type == Q_Q4_0 ? -8.0f : type == Q_Q5_0 ? -16.0f
                       : type == Q_Q8_0 ? -128.0f : 0.0f;
    const __m512i low4 = _mm512_set1_epi8(0x0F), lane8 = lane_div(3);
    const __m512i halves = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    PREFETCH(row + g0 * bytes, 8 * bytes);
    /* each block's first 4 bytes: its scale (float16), then Q4_1's minimum; read one by
     * one into lanes (a gather is microcoded and slow on AMD's cores) */
    int32_t h[8];
    for (int i = 0; i < 8; i++) {
        h[i] = 0;
        if (i < n) memcpy(&h[i], row + (g0 + i) * bytes, 4);
    }
    const __m256i head = _mm256_set_epi32(h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0]);
    const __m256 d8 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(head));
    const __m256 m8 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(head, 16)));
    __m512 S[ROWS512];
    for (int r = 0; r < R; r++) {
        const __m256 dxv = n == 8 ? _mm256_loadu_ps(dx + r * (K / 32) + g0)
                                  : _mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), dx + r * (K / 32) + g0);
        const __m256 sc = _mm256_mul_ps(d8, dxv);
        S[r] = _mm512_castps256_ps512(sc);
        const __m256 coef = minimum ? _mm256_mul_ps(m8, dxv) : _mm256_mul_ps(sc, _mm256_set1_ps(offset));
        off[r] = _mm256_fmadd_ps(coef, sums32(sx + r * (K / 16) + 2 * g0, n), off[r]);
    }
    for (int p = 0; p < n; p += 2) {
        const uint8_t *b0 = row + (g0 + p) * bytes, *b1 = p + 1 < n ? b0 + bytes : b0;
        __m512i w;
        if (type == Q_Q8_0) {
            w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                   _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
            w = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        } else {
            const __m256i q = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + qs_off))),
                _mm_loadu_si128((const __m128i *)(b1 + qs_off)), 1);
            const __m512i lo = _mm512_castsi256_si512(_mm256_and_si256(q, _mm512_castsi512_si256(low4)));
            const __m512i hi = _mm512_castsi256_si512(
                _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm512_castsi512_si256(low4)));
            w = _mm512_permutex2var_epi64(lo, halves, hi);
            if (five) {
                uint32_t qh0, qh1;
                memcpy(&qh0, b0 + qh_off, 4);
                memcpy(&qh1, b1 + qh_off, 4);
                const __mmask64 bits = (__mmask64)qh0 | ((__mmask64)qh1 << 32);
                w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
            }
        }
        const __m512i idx = _mm512_add_epi32(lane8, _mm512_set1_epi32(p));
        for (int r = 0; r < R; r++) {
            const int8_t *xp = qx + r * K + 32 * (g0 + p);
            const __m512i x = p + 1 < n ? _mm512_loadu_si512(xp)
                                        : _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFu, xp);
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, S[r]), acc[r]);
        }
    }
}

VNNI512 static ALWAYS_INLINE void b32_rows(const int type, const uint8_t *row, int64_t groups,
                                           const int8_t *qx, const float *dx, const int32_t *sx,
                                           int64_t K, const int R, float *y, int64_t ldy) {
    __m512 acc[ROWS512];
    __m256 off[ROWS512];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        off[r] = _mm256_setzero_ps();
    }
    int64_t g0 = 0;
    for (; g0 + 8 <= groups; g0 += 8) b32_chunk(type, row, g0, 8, qx, dx, sx, K, R, acc, off);
    switch (groups - g0) { /* the last blocks: even counts (K a multiple of 64) unrolled */
        case 0: break;
        case 2: b32_chunk(type, row, g0, 2, qx, dx, sx, K, R, acc, off); break;
        case 4: b32_chunk(type, row, g0, 4, qx, dx, sx, K, R, acc, off); break;
        case 6: b32_chunk(type, row, g0, 6, qx, dx, sx, K, R, acc, off); break;
        default: b32_chunk(type, row, g0, (int)(groups - g0), qx, dx, sx, K, R, acc, off);
    }
    for (int r = 0; r < R; r++) /* one reduction: the offsets join the products' lanes */
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], _mm512_zextps256_ps512(off[r])));
}

/* Q4_0_R16, Q4_1_R16, Q8_0_R16 (ggml_common.h): sixteen weight rows at once. A block's
 * four (Q8_0: eight) 64-byte vectors unpack into the eight vectors of ggml_i8gemm.c's tile
 * (vector c: values 4c .. 4c+3 of all 16 rows), and each input row takes the tile's
 * arithmetic: eight vpdpbusd with four of its values broadcast, one conversion, one fused
 * multiply-add of the 16 rows' scales times its own (and Q4_1's minimums times the sum of
 * its values). The weights are unpacked once per block for all the input rows, and the
 * 16 rows' scales come with one load, where b32_rows spends a permute, a conversion and a
 * fused multiply-add per two blocks of every row and input row. The same operations in the
 * same order as ggml_i8gemm.c's rows_vnni: an input row gets the numbers the int8 GEMM
 * gives it. acc[r]: the 16 weight rows against input row r. */
#define R16_ROWS 8
VNNI512 static ALWAYS_INLINE void r16_rows(const int base, const uint8_t *w16, int64_t groups,
                                           const int8_t *qx, const float *dx, const int32_t *sx,
                                           int64_t K, const int R, const int32_t *ix, __m512 *acc) {
    const int64_t bytes = 16 * pg_b32_bytes(base); /* a block of the 16 rows */
    const int affine = base == 3, head = affine ? 64 : 32;
    const int off = base == 2 ? 8 : base == 8 ? 128 : 0;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = w16 + g * bytes;
        PREFETCH(b, bytes);
        __m512i w[8];
        if (base == 8) {
            for (int c = 0; c < 8; c++)
                w[c] = _mm512_xor_si512(_mm512_loadu_si512(b + head + 64 * c), _mm512_set1_epi8((char)0x80));
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i q = _mm512_loadu_si512(b + head + 64 * c);
                w[c] = _mm512_and_si512(q, low4);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        const __m512 m = affine ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)))
                                : _mm512_setzero_ps();
        if (R >= 4) {
            const int8_t *x[R16_ROWS];
            float dg[R16_ROWS];
            int32_t sq[R16_ROWS];
            for (int r = 0; r < R; r++) {
                const int64_t row = ROW(ix, r);
                x[r] = qx + row * K + 32 * g;
                dg[r] = dx[row * (K / 32) + g];
                sq[r] = sx[row * (K / 16) + 2 * g] + sx[row * (K / 16) + 2 * g + 1];
            }
            pg_tile_rows(R, w, s, m, affine, off, x, dg, sq, acc);
            continue;
        }
        UNROLL_ROWS
        for (int r = 0; r < R; r++)
            acc[r] = pg_tile_row(w, s, m, affine, off, qx + ROW(ix, r) * K + 32 * g, dx[ROW(ix, r) * (K / 32) + g],
                                 sx[ROW(ix, r) * (K / 16) + 2 * g], sx[ROW(ix, r) * (K / 16) + 2 * g + 1], acc[r]);
    }
}

/* A 16-row block of one of the 16-row layouts against R input rows (ix: a list of them). */
#define R16_CALL(type, w16, qx, dx, sx, K, r, ix, acc)                                     \
    (type == PG_Q4_K_R16   ? k16_rows(w16, K / 256, 0, qx, dx, sx, K, r, ix, acc)          \
     : type == PG_Q5_K_R16 ? k16_rows(w16, K / 256, 1, qx, dx, sx, K, r, ix, acc)          \
     : type == PG_Q6_K_R16 ? q6_16_rows(w16, K / 256, qx, dx, sx, K, r, ix, acc)           \
     : type == PG_Q4_0_R16 ? r16_rows(2, w16, K / 32, qx, dx, sx, K, r, ix, acc)           \
     : type == PG_Q4_1_R16 ? r16_rows(3, w16, K / 32, qx, dx, sx, K, r, ix, acc)           \
                           : r16_rows(8, w16, K / 32, qx, dx, sx, K, r, ix, acc))

/* R16_CALL for a pass of R rows (1..R16_ROWS), each count compiled apart: unrolled, no
 * masks. */
#define R16_PASS(R, type, w16, qx, dx, sx, K, ix, acc)                                     \
    switch (R) {                                                                           \
        case 1: R16_CALL(type, w16, qx, dx, sx, K, 1, ix, acc); break;                     \
        case 2: R16_CALL(type, w16, qx, dx, sx, K, 2, ix, acc); break;                     \
        case 3: R16_CALL(type, w16, qx, dx, sx, K, 3, ix, acc); break;                     \
        case 4: R16_CALL(type, w16, qx, dx, sx, K, 4, ix, acc); break;                     \
        case 5: R16_CALL(type, w16, qx, dx, sx, K, 5, ix, acc); break;                     \
        case 6: R16_CALL(type, w16, qx, dx, sx, K, 6, ix, acc); break;                     \
        case 7: R16_CALL(type, w16, qx, dx, sx, K, 7, ix, acc); break;                     \
        default: R16_CALL(type, w16, qx, dx, sx, K, 8, ix, acc); break;                    \
    }

/* Weight rows [n0, n1) (multiples of 16) of one of the 16-row layouts (pg_rows16) against
 * the P quantized rows, R16_ROWS input rows a pass. */
VNNI512 static void range_tiles(int type, const uint8_t *W, int64_t row_bytes, int64_t n0, int64_t n1,
                                int64_t K, const int8_t *QX, const float *DX, const int32_t *SX,
                                int64_t P, int64_t levels, float *Y, int64_t ldy, const int64_t *yrows) {
    for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t *w16 = W + n * row_bytes;
        for (int64_t m0 = 0; m0 < P; m0 += R16_ROWS) {
            const int R = P - m0 < R16_ROWS ? (int)(P - m0) : R16_ROWS;
            const int8_t *qx = QX + m0 * K;
            const float *dx = DX + m0 * (K / 32);
            const int32_t *sx = SX + m0 * (K / 16);
            __m512 acc[R16_ROWS];
            R16_PASS(R, type, w16, qx, dx, sx, K, NULL, acc)
            /* store_sums' sums, 16 columns a vector: the levels added in its order */
            for (int r = 0; r < R; r += (int)levels) {
                const int64_t m = (m0 + r) / levels;
                __m512 sum = acc[r];
                for (int l = 1; l < levels; l++) sum = _mm512_add_ps(sum, acc[r + l]);
                _mm512_storeu_ps(Y + (yrows != NULL ? yrows[m] : m) * ldy + n, sum);
            }
        }
    }
}

/* One 16-row block of a head (w16) against P quantized rows, the i-th row ix[i] of QX (no
 * list: row i): result row yr[i] (no list: i) of Y, its block's 16 columns, gets the sums,
 * or with `add` has them added, as range_tiles adds a row's second level to its first;
 * with tmax, tmax[that row * ldt] is then the largest of the 16. */
VNNI512 static ALWAYS_INLINE void head_tile(int type, const uint8_t *w16, int64_t K,
                                            const int8_t *QX, const float *DX, const int32_t *SX,
                                            const int32_t *ix, int64_t P, int add, int64_t ldt,
                                            float *Y, int64_t ldy, const int32_t *yr, float *tmax) {
    for (int64_t m0 = 0; m0 < P; m0 += R16_ROWS) {
        const int R = P - m0 < R16_ROWS ? (int)(P - m0) : R16_ROWS;
        const int32_t *rows = ix != NULL ? ix + m0 : NULL;
        const int8_t *qx = ix != NULL ? QX : QX + m0 * K;
        const float *dx = ix != NULL ? DX : DX + m0 * (K / 32);
        const int32_t *sx = ix != NULL ? SX : SX + m0 * (K / 16);
        __m512 acc[R16_ROWS];
        R16_PASS(R, type, w16, qx, dx, sx, K, rows, acc)
        for (int r = 0; r < R; r++) {
            const int64_t m = yr != NULL ? yr[m0 + r] : m0 + r;
            float *y = Y + m * ldy;
            const __m512 v = add ? _mm512_add_ps(_mm512_loadu_ps(y), acc[r]) : acc[r];
            _mm512_storeu_ps(y, v);
            if (tmax != NULL) tmax[m * ldt] = _mm512_reduce_max_ps(v);
        }
    }
}

/* pg_head_q8's first pass: blocks [t0, t1) against the M rows' first levels (QX, DX, SX:
 * those rows alone, in order), and each block's largest logit per row (tmax, [M][T]). */
VNNI512 static void head_first(int type, const uint8_t *W, int64_t row_bytes, int64_t t0,
                               int64_t t1, int64_t T, int64_t K, const int8_t *QX,
                               const float *DX, const int32_t *SX, int64_t M, float *Y,
                               int64_t ldy, float *tmax) {
    for (int64_t t = t0; t < t1; t++)
        head_tile(type, W + 16 * t * row_bytes, K, QX, DX, SX, NULL, M, 0, T, Y + 16 * t, ldy,
                  NULL, tmax + t);
}

/* How far pg_head_q8 widens its bounds for float rounding: the bound times HEAD_BOUND_GROW
 * (a block's sum of K/32 groups rounds at ~K/32 * 2^-24 of the bound's terms, 8e-6 at
 * K = 4096), plus HEAD_SLACK of the two logits compared (the last add's rounding). */
#define HEAD_BOUND_GROW 1.001f
#define HEAD_SLACK 1e-6f

/* pg_head_q8 between its passes, for the team's share of the rows: row m's top
 * first-level logit, the bound of the (first) block that holds it, and which blocks may
 * hold its top logit once both levels are in: bit t % 32 of cand[m][t / 32] where block t's largest
 * first-level logit plus its bound (bounds [G][T] times the row's second level's 1-norm
 * per group, r1 [M][G]) reaches the top less that block's bound. */
VNNI512 static void head_candidates(int64_t M, int64_t T, int64_t G, const float *bounds,
                                    const float *r1, const float *tmax, uint32_t *cand,
                                    int64_t ldc, const pg_team *team) {
    const __m512 grow = _mm512_set1_ps(HEAD_BOUND_GROW), slack = _mm512_set1_ps(HEAD_SLACK);
    int64_t lo, hi;
    pg_share(M, team, &lo, &hi);
    for (int64_t m = lo; m < hi; m++) {
        const float *mt = tmax + m * T, *r = r1 + m * G;
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < T; t += 16) {
            const __mmask16 k = T - t < 16 ? (__mmask16)((1u << (T - t)) - 1) : 0xFFFF;
            most = _mm512_mask_max_ps(most, k, most, _mm512_maskz_loadu_ps(k, mt + t));
        }
        const float top = _mm512_reduce_max_ps(most);
        int64_t at = 0; /* the first block of the largest, as argmax */
        while (at < T - 1 && !(mt[at] >= top)) at++;
        float bt = 0.0f;
        for (int64_t g = 0; g < G; g++) bt = fmaf(bounds[g * T + at], r[g], bt);
        const __m512 tp = _mm512_set1_ps(top), atp = _mm512_abs_ps(tp);
        const __m512 need = _mm512_set1_ps(top - bt * HEAD_BOUND_GROW);
        for (int64_t t0 = 0; t0 < T; t0 += 32) { /* two vectors of 16 blocks: two sums */
            const __mmask16 k0 = T - t0 < 16 ? (__mmask16)((1u << (T - t0)) - 1) : 0xFFFF;
            const __mmask16 k1 = T - t0 <= 16 ? 0 : T - t0 < 32 ? (__mmask16)((1u << (T - t0 - 16)) - 1) : 0xFFFF;
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(r[g]);
                b0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(k0, bounds + g * T + t0), b0);
                b1 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(k1, bounds + g * T + t0 + 16), b1);
            }
            const __m512 x0 = _mm512_maskz_loadu_ps(k0, mt + t0), x1 = _mm512_maskz_loadu_ps(k1, mt + t0 + 16);
            const __m512 reach0 = _mm512_add_ps(_mm512_fmadd_ps(b0, grow, x0),
                                                _mm512_mul_ps(slack, _mm512_add_ps(_mm512_abs_ps(x0), atp)));
            const __m512 reach1 = _mm512_add_ps(_mm512_fmadd_ps(b1, grow, x1),
                                                _mm512_mul_ps(slack, _mm512_add_ps(_mm512_abs_ps(x1), atp)));
            const __mmask16 c0 = _mm512_mask_cmp_ps_mask(k0, reach0, need, _CMP_GE_OQ);
            const __mmask16 c1 = _mm512_mask_cmp_ps_mask(k1, reach1, need, _CMP_GE_OQ);
            cand[m * ldc + t0 / 32] = (uint32_t)c0 | (uint32_t)c1 << 16;
        }
    }
}

/* pg_head_q8's second pass over blocks [t0, t1): the second level of the rows that
 * head_candidates marked for a block, added. Returns the (row, block) pairs that took it. */
VNNI512 static int64_t head_second(int type, const uint8_t *W, int64_t row_bytes, int64_t t0,
                                   int64_t t1, int64_t K, const int8_t *QX, const float *DX,
                                   const int32_t *SX, int64_t M, const uint32_t *cand,
                                   int64_t ldc, int32_t *ix, int32_t *yr, float *Y, int64_t ldy) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int64_t taken = 0;
    for (int64_t t = t0; t < t1; t++) {
        int64_t n = 0;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const __mmask16 valid = M - m0 < 16 ? (__mmask16)((1u << (M - m0)) - 1) : 0xFFFF;
            const __m512i rows = _mm512_add_epi32(lane, _mm512_set1_epi32((int)m0));
            const __m512i words = _mm512_mask_i32gather_epi32(
                _mm512_setzero_si512(), valid,
                _mm512_add_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32((int)ldc)), _mm512_set1_epi32((int)(t / 32))),
                (const int *)cand, 4);
            const __mmask16 k = _mm512_mask_test_epi32_mask(valid, words, _mm512_set1_epi32((int)(1u << (t % 32))));
            _mm512_mask_compressstoreu_epi32(yr + n, k, rows);
            n += __builtin_popcount(k);
        }
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) ix[i] = 2 * yr[i] + 1;
        if (ix == NULL) __builtin_unreachable(); /* ROW's test folds away */
        head_tile(type, W + 16 * t * row_bytes, K, QX, DX, SX, ix, n, 1, 0, Y + 16 * t, ldy, yr, NULL);
        taken += n;
    }
    return taken;
}

#define BY_ROWS(CALL_R)   \
    switch (R) {          \
        case 1: CALL_R(1); break; \
        case 2: CALL_R(2); break; \
        case 3: CALL_R(3); break; \
        default: CALL_R(4); break; \
    }

/* pg_gemm_q8_part's weight rows [n0, n1) on the AVX-512 kernels, the type chosen once for
 * all of them; 0 where the type has none here (the AVX2 ones run). */
#define OVER_ROWS(CALL_R)                                                                  \
    for (int64_t n = n0; n < n1; n++) {                                                    \
        const uint8_t *row = W + n * row_bytes;                                            \
        for (int64_t m0 = 0; m0 < P; m0 += ROWS512) {                                      \
            const int R = P - m0 < ROWS512 ? (int)(P - m0) : ROWS512;                      \
            const int8_t *qx = QX + m0 * K;                                                \
            const float *dx = DX + m0 * (K / 32);                                          \
            const int32_t *sx = SX + m0 * (K / 16);                                        \
            float out[ROWS512];                                                            \
            BY_ROWS(CALL_R)                                                                \
            store_sums(out, R, m0, levels, Y, ldy, yrows, n);                              \
        }                                                                                  \
    }

VNNI512 static int range512(int type, const uint8_t *W, int64_t row_bytes, int64_t n0,
                            int64_t n1, int64_t K, const int8_t *QX, const float *DX,
                            const int32_t *SX, int64_t P, int64_t levels, float *Y, int64_t ldy,
                            const int64_t *yrows) {
    switch (type) {
        case PG_Q4_0_R16: case PG_Q4_1_R16: case PG_Q8_0_R16: /* n0, n1: multiples of 16 */
        case PG_Q4_K_R16: case PG_Q5_K_R16: case PG_Q6_K_R16:
            range_tiles(type, W, row_bytes, n0, n1, K, QX, DX, SX, P, levels, Y, ldy, yrows);
            return 1;
        case Q_Q4_K: case Q_Q5_K: {
            const int8_t *px;
            const float *xs;
            if (!k45_inputs(QX, SX, P, K, &px, &xs)) return 0;
            const int high5 = type == Q_Q5_K;
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *row = W + n * row_bytes;
                for (int64_t m0 = 0; m0 < P; m0 += ROWS512) {
                    const int R = P - m0 < ROWS512 ? (int)(P - m0) : ROWS512;
                    const int8_t *qx = px + m0 * K;
                    const float *dx = DX + m0 * (K / 32), *sx = xs + m0 * (K / 32);
                    float out[ROWS512];
#define K45(r) (high5 ? k45_rows(row, K / 256, qx, dx, sx, K, 1, r, out, 1) \
                      : k45_rows(row, K / 256, qx, dx, sx, K, 0, r, out, 1))
                    BY_ROWS(K45)
#undef K45
                    store_sums(out, R, m0, levels, Y, ldy, yrows, n);
                }
            }
            return 1;
        }
        case Q_Q6_K:
#define K6(r) q6k_rows(row, K / 256, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(K6)
            return 1;
        case Q_Q4_0:
#define B40(r) b32_rows(Q_Q4_0, row, K / 32, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(B40)
            return 1;
        case Q_Q4_1:
#define B41(r) b32_rows(Q_Q4_1, row, K / 32, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(B41)
            return 1;
        case Q_Q5_0:
#define B50(r) b32_rows(Q_Q5_0, row, K / 32, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(B50)
            return 1;
        case Q_Q5_1:
#define B51(r) b32_rows(Q_Q5_1, row, K / 32, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(B51)
            return 1;
        case Q_Q8_0:
#define B80(r) b32_rows(Q_Q8_0, row, K / 32, qx, dx, sx, K, r, out, 1)
            OVER_ROWS(B80)
            return 1;
        default:
            return 0;
    }
}
#endif

/* Thread ith's share of Y[m, n] (rows ldy apart) = W row n . input row m, given as
 * `levels` (1, 2 or 4) consecutive quantized rows (pg_quantize_q8_part) whose products
 * are summed; with `yrows`, row m of the result goes to row yrows[m] of Y. */
void pg_gemm_q8_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                     const int8_t *QX, const float *DX, const int32_t *SX, int64_t M,
                     int64_t levels, float *Y, int64_t ldy, const int64_t *yrows,
                     const pg_team *team) {
#ifdef PG_AVX2
    int64_t n0, n1; /* the 16-row layouts: whole groups of 16 rows */
    const int64_t unit = pg_rows16(type) ? 16 : 1;
    pg_share_if(N * K * M * levels >= Q8_PARALLEL_MIN, N / unit, team, &n0, &n1);
    n0 *= unit;
    n1 *= unit;
#ifdef PG_X86_DISPATCH
    const int wide = vnni512();
#else
    const int wide = 0;
#endif
    const int64_t P = M * levels; /* quantized rows */
#ifdef PG_X86_DISPATCH
    if (wide && range512(type, W, row_bytes, n0, n1, K, QX, DX, SX, P, levels, Y, ldy, yrows))
        return;
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = W + n * row_bytes;
        for (int64_t m0 = 0; m0 < P; m0 += 4) {
            const int R = P - m0 < 4 ? (int)(P - m0) : 4;
            float out[4];
            for (int r = 0; r < R; r++)
                out[r] = type == PG_Q6_K_R16
                             ? dot_q6_16(W, row_bytes, n, K, QX + (m0 + r) * K, DX + (m0 + r) * (K / 32),
                                         SX + (m0 + r) * (K / 16))
                         : pg_is_k16(type)
                             ? dot_k16(W, row_bytes, n, K, type == PG_Q5_K_R16, QX + (m0 + r) * K, DX + (m0 + r) * (K / 32),
                                      SX + (m0 + r) * (K / 16))
                         : pg_is_r16(type)
                             ? dot_r16(type, W, row_bytes, n, K, QX + (m0 + r) * K, DX + (m0 + r) * (K / 32),
                                       SX + (m0 + r) * (K / 16))
                             : dot_row_q8(type, row, K / 32, QX + (m0 + r) * K,
                                          DX + (m0 + r) * (K / 32), SX + (m0 + r) * (K / 16));
            store_sums(out, R, m0, levels, Y, ldy, yrows, n);
        }
    }
#else
    (void)type; (void)W; (void)row_bytes; (void)N; (void)K; (void)QX; (void)DX; (void)SX;
    (void)M; (void)levels; (void)Y; (void)ldy; (void)yrows; (void)team;
#endif
}

/* Rows of one weight group per chunk a team claims (team.h pg_claim): ~64 KB of weights
 * (a few microseconds of work), at least 16 rows, a multiple of 16 (the R16 layouts' groups); and
 * how many chunks the group has. */
static int64_t q8_chunk_rows(int64_t row_bytes) {
    return (65536 / row_bytes > 16 ? 65536 / row_bytes : 16) & ~(int64_t)15;
}

int64_t pg_q8_chunks(int64_t N, int64_t row_bytes) {
    const int64_t per = q8_chunk_rows(row_bytes);
    return (N + per - 1) / per;
}

/* Chunk c of pg_q8_chunks(N, row_bytes) of the product pg_gemm_q8_part computes, on the
 * calling thread alone. */
void pg_gemm_q8_chunk(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const int8_t *QX, const float *DX, const int32_t *SX, int64_t M,
                      int64_t levels, float *Y, int64_t ldy, const int64_t *yrows, int64_t c) {
    const pg_team alone = {0, 1, NULL};
    const int64_t per = q8_chunk_rows(row_bytes), n0 = c * per;
    pg_gemm_q8_part(type, W + n0 * row_bytes, row_bytes, N - n0 < per ? N - n0 : per, K, QX,
                    DX, SX, M, levels, Y + n0, ldy, yrows, &alone);
}

/* Y[m, n] (rows ldy apart) for the quantized input rows from pg_quantize_q8, in chunks of
 * rows the team claims as it goes (pg_q8_claim 0: static shares). */
int pg_gemm_q8(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
               const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, int64_t levels,
               float *Y, int64_t ldy) {
    if (!pg_q8_supported(type) || K % 32 || (levels != 1 && levels != 2 && levels != 4) ||
        (pg_rows16(type) && N % 16))
        return -1;
    const int parallel = N * K * M * levels >= Q8_PARALLEL_MIN;
    if (!pg_q8_claim) {
        PG_TEAM_RUN(parallel, pg_gemm_q8_part(type, W, row_bytes, N, K, QX, DX, SX, M, levels, Y,
                                              ldy, NULL, &team));
        return 0;
    }
    const int64_t chunks = pg_q8_chunks(N, row_bytes);
    pg_barrier barrier = {0}; /* for its claim count only: this team never meets */
#pragma omp parallel if (parallel)
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        int64_t taken = 0;
        for (int64_t c; (c = pg_claim(&team, chunks, &taken)) >= 0;)
            pg_gemm_q8_chunk(type, W, row_bytes, N, K, QX, DX, SX, M, levels, Y, ldy, NULL, c);
    }
    return 0;
}

/* The logits head in two int8 levels where they can change its top logit
 * (HEAD_INT8_LEVELS, gguf.py). x_m is given in two levels (pg_quantize_q8, L = 2: rows 2m
 * and 2m + 1 of QX). Every logit takes the first level; a 16-row block of W takes the
 * second for row m only where its bound (`bounds`, pg_head_bounds) leaves room for the
 * block to hold row m's top two-level logit. Those logits are pg_gemm_q8's two-level bits,
 * the others its one-level bits, each within its bound of the two-level one: so every
 * row's top logit, and where it is, are the two-level product's. `pairs` gets how many
 * (row, block) pairs took the second level. -1 where this kernel is not there (no AVX-512
 * VNNI, a type not in a 16-row layout), -2 when memory ran out. */
int pg_head_q8(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
               const int8_t *QX, const float *DX, const int32_t *SX, int64_t M,
               const float *bounds, float *Y, int64_t ldy, int64_t *pairs) {
#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
    if (!vnni512() || !pg_rows16(type) || N % 16 || K % 32 || M < 1 || M > INT32_MAX / 2)
        return -1;
    const int64_t T = N / 16, G = K / 32;
    /* one scratch, kept by the calling thread between calls (a fresh allocation of this size
     * is an mmap and its page faults, at every decode step): the second levels' 1-norms per
     * group [M][G], the blocks' largest first-level logits [M][T], the candidate marks
     * [M][T / 32] (bits), the first levels' scales, sums and values */
    static _Thread_local void *scratch = NULL;
    static _Thread_local size_t scratch_bytes = 0;
    const size_t bytes = sizeof(float) * (size_t)(M * G * 2 + M * T) +
                         sizeof(int32_t) * (size_t)(M * (K / 16) + M * ((T + 31) / 32)) + (size_t)(M * K);
    if (bytes > scratch_bytes) {
        void *grown = realloc(scratch, bytes);
        if (grown == NULL) return -2;
        scratch = grown;
        scratch_bytes = bytes;
    }
    float *r1 = scratch, *d1 = r1 + M * G, *tmax = d1 + M * G;
    int32_t *s1 = (int32_t *)(tmax + M * T);
    uint32_t *cand = (uint32_t *)(s1 + M * (K / 16));
    int8_t *q1 = (int8_t *)(cand + M * ((T + 31) / 32));
    for (int64_t m = 0; m < M; m++) {
        /* the first levels on their own, in order (the kernels' plain rows) */
        memcpy(q1 + m * K, QX + 2 * m * K, (size_t)K);
        memcpy(d1 + m * G, DX + 2 * m * G, sizeof(float) * (size_t)G);
        memcpy(s1 + m * (K / 16), SX + 2 * m * (K / 16), sizeof(int32_t) * (size_t)(K / 16));
        const int8_t *q = QX + (2 * m + 1) * K;
        for (int64_t g = 0; g < G; g++) {
            int32_t a = 0;
            for (int i = 0; i < 32; i++) a += abs(q[32 * g + i]);
            r1[m * G + g] = DX[(2 * m + 1) * G + g] * (float)a;
        }
    }
    const int64_t per = q8_chunk_rows(row_bytes) / 16, chunks = (T + per - 1) / per;
    pg_barrier barrier = {0};
    barrier.spin_ns = pg_team_spin_ns;
    int64_t total = 0;
    int failed = 0;
#pragma omp parallel if (N * K * M >= Q8_PARALLEL_MIN) reduction(+ : total) reduction(| : failed)
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        int64_t taken = 0;
        for (int64_t c; (c = pg_claim(&team, chunks, &taken)) >= 0;)
            head_first(type, W, row_bytes, c * per, (c + 1) * per < T ? (c + 1) * per : T, T, K,
                       q1, d1, s1, M, Y, ldy, tmax);
        pg_team_sync(&team);
        head_candidates(M, T, G, bounds, r1, tmax, cand, (T + 31) / 32, &team);
        pg_claim_reset(&team);
        pg_team_sync(&team);
        int32_t *list = malloc(sizeof(int32_t) * 2 * (size_t)(M + 16));
        taken = 0;
        for (int64_t c; (c = pg_claim(&team, chunks, &taken)) >= 0;) {
            if (list == NULL) {
                failed = 1;
                continue;
            }
            const int64_t t0 = c * per, t1 = t0 + per < T ? t0 + per : T;
            total += head_second(type, W, row_bytes, t0, t1, K, QX, DX, SX, M, cand, (T + 31) / 32, list,
                                 list + M + 16, Y, ldy);
        }
        free(list);
    }
    if (pairs != NULL) *pairs = total;
    return failed ? -2 : 0;
#else
    (void)type; (void)W; (void)row_bytes; (void)N; (void)K; (void)QX; (void)DX; (void)SX;
    (void)M; (void)bounds; (void)Y; (void)ldy; (void)pairs;
    return -1;
#endif
}

void pg_dequant_row(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, float *out);

/* pg_head_q8's bounds: bounds[g, t] is the largest |weight| in rows 16t .. 16t + 15,
 * values 32g .. 32g + 31 (the rows as pg_dequant_row gives them). */
int pg_head_bounds(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                   float *bounds) {
    if (N % 16 || K % 32) return -1;
    int failed = 0;
#pragma omp parallel if (N * K >= 1 << 20) reduction(| : failed)
    {
        float *row = malloc(sizeof(float) * (size_t)K);
        failed |= row == NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N / 16; t++) {
            for (int64_t g = 0; g < K / 32; g++) bounds[g * (N / 16) + t] = 0.0f;
            for (int64_t n = 16 * t; row != NULL && n < 16 * t + 16; n++) {
                pg_dequant_row(type, W, row_bytes, n, K, row);
                for (int64_t g = 0; g < K / 32; g++) { /* |w| as its bits: the same order */
                    uint32_t most = 0, bits[32];
                    memcpy(bits, row + 32 * g, sizeof bits);
                    for (int i = 0; i < 32; i++) {
                        const uint32_t a = bits[i] & 0x7FFFFFFFu;
                        most = a > most ? a : most;
                    }
                    float w;
                    memcpy(&w, &most, sizeof w);
                    float *b = bounds + g * (N / 16) + t;
                    *b = fmaxf(*b, w);
                }
            }
        }
        free(row);
    }
    return failed ? -2 : 0;
}

int pg_q8_isa(void) {
#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
    if (vnni512()) return 2;
#endif
#ifdef PG_AVX2
    return 1;
#else
    return 0;
#endif
}
