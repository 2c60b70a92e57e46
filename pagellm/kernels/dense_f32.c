/* float32 weights as torch packs them for oneDNN's linear (`pack_weight` in
 * model_executor/layers/linear.py), read in place:
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
 * Why: a decode step multiplies each weight by the step's rows: one to eight in a single
 * conversation, tens in a batch. Reading the packed copy here lets the one-call decode
 * stack (decode_step.c) run on float32 weights without a second, plain copy of them, and
 * batched decode steps beat oneDNN's own product up to ~128 rows: with few rows the
 * weight streams from memory once (software prefetch ahead); with more, each 64-output
 * block is walked in chunks of PG_F32_KC values of k that stay in L1 while every 6-row
 * group of the input passes over them, the groups pulling the next chunk into L2 meanwhile.
 * Each Y value is the sequential sum over k (a chunk boundary stores and reloads it
 * exactly), so a row's result does not depend on the other rows, the path taken or the
 * thread count. Threads: OpenMP over column blocks (and halves of the rows when the
 * blocks are few).
 */
#include <stdint.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

#define NB_MAX 64
#define TILE_MIN_ROWS 4 /* more rows than this take the L1-chunked tiles (AVX-512, NB 64) */

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
/* AVX-512, NB = 64: R <= 6 rows x 64 outputs in 4 x R registers, summed over k in
 * [k0, k1) into C (row r at c + r * ldc), starting from zero when k0 == 0 and from C's
 * values otherwise. Each C value is the sequential sum over k, and a value stored and
 * reloaded between calls is exact, so chunking k changes no result. The accumulators are
 * named variables, not an array: GCC keeps an array of vectors on the stack. PF: prefetch
 * the block PF_DIST rows of k ahead (it streams from memory when few rows pass over it). */
#define PF_DIST 16
#define ACC_DECL(r) __m512 a##r##0 = z, a##r##1 = z, a##r##2 = z, a##r##3 = z;
#define ACC_LOAD(r)                                                                        \
    if (R > r && k0) {                                                                     \
        a##r##0 = _mm512_loadu_ps(c + r * ldc), a##r##1 = _mm512_loadu_ps(c + r * ldc + 16); \
        a##r##2 = _mm512_loadu_ps(c + r * ldc + 32), a##r##3 = _mm512_loadu_ps(c + r * ldc + 48); \
    }
#define ACC_FMA(r)                                                                         \
    if (R > r) {                                                                           \
        const __m512 b = _mm512_set1_ps(x[r * ldx + k]);                                   \
        a##r##0 = _mm512_fmadd_ps(b, w0, a##r##0), a##r##1 = _mm512_fmadd_ps(b, w1, a##r##1); \
        a##r##2 = _mm512_fmadd_ps(b, w2, a##r##2), a##r##3 = _mm512_fmadd_ps(b, w3, a##r##3); \
    }
#define ACC_STORE(r)                                                                       \
    if (R > r) {                                                                           \
        _mm512_storeu_ps(c + r * ldc, a##r##0), _mm512_storeu_ps(c + r * ldc + 16, a##r##1); \
        _mm512_storeu_ps(c + r * ldc + 32, a##r##2), _mm512_storeu_ps(c + r * ldc + 48, a##r##3); \
    }
static inline __attribute__((always_inline, target("avx512f,fma"))) void tile512(
    const int R, const int PF, const float *blk, int64_t k0, int64_t k1, const float *x,
    int64_t ldx, float *c, int64_t ldc, const char *next, int next_lines) {
    const __m512 z = _mm512_setzero_ps();
    ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3) ACC_DECL(4) ACC_DECL(5)
    ACC_LOAD(0) ACC_LOAD(1) ACC_LOAD(2) ACC_LOAD(3) ACC_LOAD(4) ACC_LOAD(5)
    for (int64_t k = k0; k < k1; k++) {
        const float *w = blk + k * 64;
        if (PF)
            for (int q = 0; q < 4; q++)
                _mm_prefetch((const char *)(w + PF_DIST * 64 + 16 * q), _MM_HINT_T0);
        for (int q = 0; q < next_lines; q++)
            _mm_prefetch(next + ((k - k0) * next_lines + q) * 64, _MM_HINT_T1);
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5)
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5)
}
#define TILE512(R)                                                                         \
    __attribute__((target("avx512f,fma"))) static void tile512_##R(                       \
        const float *blk, int64_t k0, int64_t k1, const float *x, int64_t ldx, float *c,   \
        int64_t ldc, const char *next, int next_lines) {                                   \
        tile512(R, 0, blk, k0, k1, x, ldx, c, ldc, next, next_lines);                      \
    }                                                                                      \
    __attribute__((target("avx512f,fma"))) static void rows512_##R(                       \
        const float *blk, int64_t K, const float *x, int64_t ldx, float *t) {             \
        tile512(R, 1, blk, 0, K, x, ldx, t, NB_MAX, NULL, 0);                              \
    }
TILE512(1)
TILE512(2)
TILE512(3)
TILE512(4)
TILE512(5)
TILE512(6)

/* C [M, 64] (row stride ldc) = X [M, K] times one full block, k in chunks of PG_F32_KC
 * so that a chunk of the block (KC x 64 floats) stays in L1 while every row group of the
 * input passes over it. */
#define PG_F32_KC 128
static void tiles512(const float *blk, int64_t K, const float *x, int64_t ldx, int64_t M,
                     float *c, int64_t ldc) {
    typedef void (*tile_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *,
                            int64_t, const char *, int);
    static const tile_fn tail[6] = {NULL, tile512_1, tile512_2, tile512_3, tile512_4, tile512_5};
    const int64_t groups = (M + 5) / 6;
    /* While the row groups pass over one chunk, they pull the next chunk (the next block's
     * first one after the last) into L2, a few lines per k: the first group alone would
     * otherwise wait on memory for every line of it. */
    const int next_lines = groups >= 4 ? 1 : groups >= 2 ? 2 : 4;
    for (int64_t k0 = 0; k0 < K; k0 += PG_F32_KC) {
        const int64_t k1 = K - k0 < PG_F32_KC ? K : k0 + PG_F32_KC;
        const char *next = (const char *)(blk + k1 * 64);
        const int64_t span = (k1 - k0) * next_lines * 64, chunk = PG_F32_KC * 64 * 4;
        for (int64_t g = 0, m = 0; m < M; g++, m += 6) {
            const int lines = g * span < chunk ? next_lines : 0;
            const tile_fn fn = M - m >= 6 ? tile512_6 : tail[M - m];
            fn(blk, k0, k1, x + m * ldx, ldx, c + m * ldc, ldc, next + g * span, lines);
        }
    }
}

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

/* 1 when products of many rows on blocks of width nb take the L1-chunked tiles on this
 * CPU (else each row group re-reads whole blocks, and oneDNN is the faster choice). */
int pg_f32_blocked_tiles(int64_t nb) {
#ifdef PG_X86_DISPATCH
    return pick(nb) == block512;
#else
    (void)nb;
    return 0;
#endif
}

/* Y[m, n] = sum_k X[m, k] * W[n, k] for W packed as above: thread ith's share. The block
 * width must be one pg_gemm_f32_blocked takes. */
void pg_gemm_f32_blocked_part(const float *Wp, int64_t nb, int64_t kp, int64_t N, int64_t K,
                              const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy,
                              const pg_team *team) {
    const block_fn fn = pick(nb);
    const int parallel = N * K * M >= 262144;
    const int64_t blocks = (N + nb - 1) / nb;
    int64_t first = 0, lo, hi; /* the blocks from `first` on go through fn, 4 rows at a time */
#ifdef PG_X86_DISPATCH
    if (fn == block512 && M > TILE_MIN_ROWS) {
        /* Many rows: full blocks go straight into Y through the L1-chunked tiles; with few
         * blocks the rows are split in two so that both threads get work. A last, partial
         * block is left to the loop below. */
        const int64_t full = N / 64, halves = full < 16 ? 2 : 1;
        const int64_t mh = (M + halves - 1) / halves;
        pg_share_if(parallel, full * halves, team, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            const int64_t b = i / halves, m0 = (i % halves) * mh;
            const int64_t rows = M - m0 < mh ? M - m0 : mh;
            if (rows > 0)
                tiles512(Wp + b * kp * 64, K, X + m0 * ldx, ldx, rows, Y + m0 * ldy + b * 64, ldy);
        }
        first = full;
    }
#endif
    pg_share_if(parallel && blocks - first > 1, blocks - first, team, &lo, &hi);
    for (int64_t b = first + lo; b < first + hi; b++) {
        float t[4 * NB_MAX];
        const int64_t n0 = b * nb, cols = N - n0 < nb ? N - n0 : nb;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t rows = M - m0 < 4 ? M - m0 : 4;
            fn(Wp + b * kp * nb, nb, K, X + m0 * ldx, ldx, rows, t);
            for (int64_t r = 0; r < rows; r++)
                memcpy(Y + (m0 + r) * ldy + n0, t + r * NB_MAX, (size_t)cols * sizeof(float));
        }
    }
}

/* 1 when the parts take blocks of width nb holding kp >= K values each. */
int pg_f32_blocked_supported(int64_t nb, int64_t kp, int64_t K) {
    return nb > 0 && nb <= NB_MAX && kp >= K;
}

/* The part in a region of its own. Returns 0, or -1 for a block width this file does not
 * take (it takes 1..64). */
int pg_gemm_f32_blocked(const float *Wp, int64_t nb, int64_t kp, int64_t N, int64_t K,
                        const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy) {
    if (!pg_f32_blocked_supported(nb, kp, K)) return -1;
    PG_TEAM_RUN(N * K * M >= 262144,
                pg_gemm_f32_blocked_part(Wp, nb, kp, N, K, X, ldx, M, Y, ldy, &team));
    return 0;
}
