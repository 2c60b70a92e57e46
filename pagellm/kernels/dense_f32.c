/* float32 weights as torch packs them for oneDNN's linear (`pack_weight` in
 * model_executor/layers/linear.py), read in place for a few input rows:
 *
 *   Y[m, n] = sum_k X[m, k] * W[n, k]        pg_gemm_f32_blocked
 *
 * The packed buffer holds the weight in column blocks of NB outputs,
 *
 *   Wp[b][k][j] = W[b*NB + j, k]     b < ceil(N/NB), k < Kp (K rounded up), j < NB
 *
 * with zeros past N and K. oneDNN does not promise this layout, so the loader accepts a
 * packed weight only after `pg_f32_blocked_matches` found every W value at that place
 * (bit for bit): the products here then use exactly the checkpoint's values, and a layout
 * that differs (another ISA, another torch) is refused, not misread.
 *
 * Why: a decode step multiplies each weight by one to eight rows. Reading the packed
 * copy here lets the one-call decode stack (decode_step.c) run on float32 weights without
 * a second, plain copy of them. Each Y value is the sequential sum over k, so a row's
 * result does not depend on the other rows or on the thread count. Threads: OpenMP over
 * column blocks.
 */
#include <stdint.h>
#include <string.h>

#include "ggml_common.h"

#define NB_MAX 64

/* 1 when W [N, K] (row-major) sits in Wp at the layout above, else 0. */
int pg_f32_blocked_matches(const float *Wp, int64_t nb, int64_t kp, int64_t N, int64_t K,
                           const float *W) {
    if (nb <= 0 || kp < K) return 0;
    int ok = 1;
    const int64_t blocks = (N + nb - 1) / nb;
#pragma omp parallel for schedule(static) reduction(&& : ok) if (N * K >= 1 << 20)
    for (int64_t b = 0; b < blocks; b++) {
        const float *blk = Wp + b * kp * nb;
        for (int64_t j = 0; j < nb && b * nb + j < N; j++) {
            const float *row = W + (b * nb + j) * K;
            for (int64_t k = 0; k < K; k++)
                if (memcmp(&blk[k * nb + j], &row[k], sizeof(float)) != 0) {
                    ok = 0;
                    k = K;
                    j = nb;
                }
        }
    }
    return ok;
}

/* t[r][j] = sum_k x_r[k] * blk[k][j] for r < R rows of X, j < NB. */
typedef void (*block_fn)(const float *blk, int64_t nb, int64_t K, const float *x,
                         int64_t ldx, int64_t R, float *t);

static void block_c(const float *blk, int64_t nb, int64_t K, const float *x, int64_t ldx,
                    int64_t R, float *t) {
    for (int64_t r = 0; r < R; r++) {
        float acc[NB_MAX] = {0};
        const float *xr = x + r * ldx;
        for (int64_t k = 0; k < K; k++) {
            const float v = xr[k], *w = blk + k * nb;
            for (int64_t j = 0; j < nb; j++) acc[j] += v * w[j];
        }
        memcpy(t + r * NB_MAX, acc, (size_t)nb * sizeof(float));
    }
}

#ifdef PG_X86_DISPATCH
#ifndef PF_DIST
#define PF_DIST 16
#endif
#define PREFETCH(w)                                                                        \
    do {                                                                                   \
        if (PF_DIST > 0)                                                                   \
            for (int c = 0; c < 4; c++)                                                    \
                _mm_prefetch((const char *)((w) + PF_DIST * 64 + 16 * c), _MM_HINT_T0);    \
    } while (0)
/* AVX-512, NB = 64: R rows at a time (4 x R accumulators), one pass over the block. */
#define ROWS512(R)                                                                         \
    __attribute__((target("avx512f,fma"))) static void rows512_##R(                       \
        const float *blk, int64_t K, const float *x, int64_t ldx, float *t) {             \
        __m512 acc[R][4];                                                                  \
        for (int r = 0; r < R; r++)                                                        \
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();                   \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const float *w = blk + k * 64;                                                 \
            PREFETCH(w);                                                                   \
            __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);                  \
            __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);             \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                __m512 b = _mm512_set1_ps(x[r * ldx + k]);                                 \
                acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);                             \
                acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);                             \
                acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);                             \
                acc[r][3] = _mm512_fmadd_ps(b, w3, acc[r][3]);                             \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < R; r++)                                                        \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(t + r * NB_MAX + 16 * v, acc[r][v]); \
    }
ROWS512(1)
ROWS512(2)
ROWS512(3)
ROWS512(4)

static void block512(const float *blk, int64_t nb, int64_t K, const float *x, int64_t ldx,
                     int64_t R, float *t) {
    (void)nb;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) rows512_4(blk, K, x + r * ldx, ldx, t + r * NB_MAX);
    switch (R - r) {
        case 3: rows512_3(blk, K, x + r * ldx, ldx, t + r * NB_MAX); break;
        case 2: rows512_2(blk, K, x + r * ldx, ldx, t + r * NB_MAX); break;
        case 1: rows512_1(blk, K, x + r * ldx, ldx, t + r * NB_MAX); break;
        default: break;
    }
}

/* AVX2, NB = 64: one row at a time, 8 accumulators. */
__attribute__((target("avx2,fma"))) static void block256(const float *blk, int64_t nb,
                                                         int64_t K, const float *x,
                                                         int64_t ldx, int64_t R, float *t) {
    (void)nb;
    for (int64_t r = 0; r < R; r++) {
        __m256 acc[8];
        for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
        const float *xr = x + r * ldx;
        for (int64_t k = 0; k < K; k++) {
            const float *w = blk + k * 64;
            __m256 b = _mm256_set1_ps(xr[k]);
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++)
                acc[v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 8 * v), acc[v]);
        }
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(t + r * NB_MAX + 8 * v, acc[v]);
    }
}
#endif

/* The kernel for block width nb on this CPU. */
static block_fn pick(int64_t nb) {
#ifdef PG_X86_DISPATCH
    if (nb == 64 && pg_isa_level() == 2) return block512;
    if (nb == 64 && pg_isa_level() == 1) return block256;
#endif
    (void)nb;
    return block_c;
}

/* Y[m, n] = sum_k X[m, k] * W[n, k] for W packed as above. Returns 0, or -1 for a block
 * width this file does not take (it takes 1..64). */
int pg_gemm_f32_blocked(const float *Wp, int64_t nb, int64_t kp, int64_t N, int64_t K,
                        const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy) {
    if (nb <= 0 || nb > NB_MAX || kp < K) return -1;
    const block_fn fn = pick(nb);
    const int64_t blocks = (N + nb - 1) / nb;
#pragma omp parallel for schedule(static) if (N * K * M >= 262144)
    for (int64_t b = 0; b < blocks; b++) {
        float t[4 * NB_MAX];
        const int64_t n0 = b * nb, cols = N - n0 < nb ? N - n0 : nb;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t rows = M - m0 < 4 ? M - m0 : 4;
            fn(Wp + b * kp * nb, nb, K, X + m0 * ldx, ldx, rows, t);
            for (int64_t r = 0; r < rows; r++)
                memcpy(Y + (m0 + r) * ldy + n0, t + r * NB_MAX, (size_t)cols * sizeof(float));
        }
    }
    return 0;
}
