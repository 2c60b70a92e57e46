/* GGUF block-quantized weights x float32 activations for many input rows (batched
 * decode steps, prefill chunks): Y[m, n] = sum_k X[m, k] * W[n, k].
 *
 *   pg_gemm_batched(type, W, row_bytes, N, K, X, ldx, M, Y, ldy)
 *
 * The weight is never dequantized as a whole: a block of NR weight rows is dequantized
 * into a per-thread buffer that stays in L1/L2 and is used at once against every input
 * row of the current chunk. X is packed once per chunk into panels of MR rows,
 *
 *   Xp[p][k][i] = X[m0 + p*MR + i, k]     (zero past the chunk's last row)
 *
 * and the micro-kernel holds an NR x MR tile of Y^T in registers, adding
 * w[r][k] * Xp[p][k][0:MR] for k = 0, 1, ..., K-1 in order. Each Y value is therefore the
 * plain sequential sum over k: it does not depend on M, on the other rows of the batch,
 * or on the thread count.
 *
 * Chunks: X is taken CHUNK_BYTES at a time (a whole prefill would not stay in cache), so a
 * weight row is dequantized once per chunk. Threads: OpenMP over weight-row blocks.
 * The AVX-512 and AVX2 kernels are chosen at run time (target attributes), so the library
 * needs no global -mavx512f; the portable build (PG_NO_SIMD) runs plain C loops.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

void pg_dequant_row(int type, const uint8_t *W, int64_t row_bytes, int64_t n, int64_t K, float *out);
int pg_type_supported(int type);

#define CHUNK_BYTES (1 << 20) /* packed X per chunk: about half an L2 */
#define NR_MAX 12
#define MR_MAX 32

/* t[r][i] = sum_k w[r][k] * xp[k][i] for r < NR, i < MR (t is NR x MR, row-major). */
typedef void (*tile_fn)(const float *const *w, int64_t K, const float *xp, float *t);

#ifdef PG_X86_DISPATCH
/* AVX-512: 12 weight rows x 32 input rows (two vectors) = 24 accumulators. NV = 1 takes
 * the panel's first 16 rows only (a short last panel). */
#define TILE512(NV)                                                                        \
    __attribute__((target("avx512f,fma"))) static void tile512_##NV(                      \
        const float *const *w, int64_t K, const float *xp, float *t) {                    \
        __m512 acc[12][NV];                                                                \
        for (int r = 0; r < 12; r++)                                                       \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                  \
            __m512 x[NV];                                                                  \
            for (int v = 0; v < NV; v++) x[v] = _mm512_loadu_ps(xp + k * 32 + 16 * v);     \
            _Pragma("GCC unroll 12") for (int r = 0; r < 12; r++) {                        \
                __m512 b = _mm512_set1_ps(w[r][k]);                                        \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(b, x[v], acc[r][v]); \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < 12; r++)                                                       \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(t + r * 32 + 16 * v, acc[r][v]); \
    }
TILE512(1)
TILE512(2)

/* AVX2: 6 weight rows x 16 input rows (two vectors) = 12 accumulators. */
#define TILE256(NV)                                                                        \
    __attribute__((target("avx2,fma"))) static void tile256_##NV(                         \
        const float *const *w, int64_t K, const float *xp, float *t) {                    \
        __m256 acc[6][NV];                                                                 \
        for (int r = 0; r < 6; r++)                                                        \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                  \
            __m256 x[NV];                                                                  \
            for (int v = 0; v < NV; v++) x[v] = _mm256_loadu_ps(xp + k * 16 + 8 * v);      \
            _Pragma("GCC unroll 6") for (int r = 0; r < 6; r++) {                          \
                __m256 b = _mm256_set1_ps(w[r][k]);                                        \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm256_fmadd_ps(b, x[v], acc[r][v]); \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < 6; r++)                                                        \
            for (int v = 0; v < NV; v++) _mm256_storeu_ps(t + r * 16 + 8 * v, acc[r][v]);  \
    }
TILE256(1)
TILE256(2)
#endif

/* Portable: 4 weight rows x 8 input rows. */
static void tile_c(const float *const *w, int64_t K, const float *xp, float *t) {
    float acc[4][8] = {{0}};
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 8; i++) acc[r][i] += w[r][k] * xp[k * 8 + i];
    memcpy(t, acc, sizeof(acc));
}

typedef struct {
    int nr, mr;          /* tile: weight rows x input rows */
    tile_fn full, half;  /* half: the first mr/2 input rows only (NULL: none) */
} kernel;

int pg_isa_level(void) {
    static volatile int level = -1; /* detected at the first call; a race writes the same */
    if (level < 0) {
        int l = 0;
#ifdef PG_X86_DISPATCH
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f")) l = 2;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) l = 1;
#endif
        level = l;
    }
    return level;
}

int pg_avx512_full(void) {
    static volatile int level = -1; /* a race writes the same value */
    if (level < 0) {
        int l = 0;
#ifdef PG_X86_DISPATCH
        __builtin_cpu_init();
        l = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
        level = l;
    }
    return level;
}

/* The CPU's kernel. */
static kernel pick_kernel(void) {
#ifdef PG_X86_DISPATCH
    switch (pg_isa_level()) {
        case 2: return (kernel){12, 32, tile512_2, tile512_1};
        case 1: return (kernel){6, 16, tile256_2, tile256_1};
        default: break;
    }
#endif
    return (kernel){4, 8, tile_c, NULL};
}

/* Xp panels [p0, p1) for rows [m0, m0 + rows) of X (see the header), zero-padded to whole
 * panels. */
static void pack_x(const float *X, int64_t ldx, int64_t m0, int64_t rows, int64_t K, int mr,
                   int64_t p0, int64_t p1, float *xp) {
    for (int64_t p = p0; p < p1; p++) {
        float *dst = xp + p * K * mr;
        int64_t n = rows - p * mr < mr ? rows - p * mr : mr;
        if (n < mr) memset(dst, 0, (size_t)(K * mr) * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            const float *src = X + (m0 + p * mr + i) * ldx;
            for (int64_t k = 0; k < K; k++) dst[k * mr + i] = src[k];
        }
    }
}

/* Rows of X packed per chunk for K and M (a whole number of panels). */
static int64_t chunk_rows(const kernel *kn, int64_t K, int64_t M) {
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float)) / kn->mr * kn->mr;
    if (chunk < kn->mr) chunk = kn->mr;
    if (chunk > M) chunk = (M + kn->mr - 1) / kn->mr * kn->mr;
    return chunk;
}

/* Floats of the team's shared packed-X buffer, and of each thread's weight rows. */
int64_t pg_gemm_batched_xp(int64_t K, int64_t M) {
    const kernel kn = pick_kernel();
    return chunk_rows(&kn, K, M) * K;
}

int64_t pg_gemm_batched_wbuf(int64_t K) { return (int64_t)NR_MAX * K; }

/* Thread ith's share: the team packs each chunk of X into xp, meets, multiplies its
 * weight-row blocks against it, and meets again before the next chunk is packed. */
void pg_gemm_batched_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                          const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy,
                          float *xp, float *wbuf, const pg_team *team) {
    const kernel kn = pick_kernel();
    const int nr = kn.nr, mr = kn.mr;
    const int64_t chunk = chunk_rows(&kn, K, M), blocks = (N + nr - 1) / nr;
    const int parallel = N * K * M >= 262144;
    float t[NR_MAX * MR_MAX];
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        int64_t lo, hi;
        pg_share_if(parallel, (rows + mr - 1) / mr, team, &lo, &hi);
        pack_x(X, ldx, m0, rows, K, mr, lo, hi, xp);
        pg_team_sync(team);
        pg_share_if(parallel, blocks, team, &lo, &hi);
        for (int64_t b = lo; b < hi; b++) {
            const int64_t n0 = b * nr;
            const int valid = N - n0 < nr ? (int)(N - n0) : nr;
            const float *w[NR_MAX];
            for (int r = 0; r < nr; r++) {
                float *row = wbuf + (int64_t)r * K;
                if (r >= valid) {
                    memset(row, 0, (size_t)K * sizeof(float));
                    w[r] = row;
                } else if (type == 0) {
                    w[r] = (const float *)(W + (n0 + r) * row_bytes);
                } else {
                    pg_dequant_row(type, W, row_bytes, n0 + r, K, row);
                    w[r] = row;
                }
            }
            for (int64_t i0 = 0; i0 < rows; i0 += mr) {
                const int64_t left = rows - i0;
                const int half = kn.half != NULL && left <= mr / 2;
                (half ? kn.half : kn.full)(w, K, xp + i0 * K, t);
                const int64_t take = left < mr ? left : mr;
                for (int64_t i = 0; i < take; i++) {
                    float *y = Y + (m0 + i0 + i) * ldy + n0;
                    for (int r = 0; r < valid; r++) y[r] = t[r * mr + i];
                }
            }
        }
        pg_team_sync(team); /* xp is repacked for the next chunk (or the next product) */
    }
}

int pg_gemm_batched(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                    const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy) {
    if (!pg_type_supported(type)) return -1;
    float *xp = (float *)aligned_alloc(64, (size_t)pg_gemm_batched_xp(K, M) * sizeof(float));
    if (xp == NULL) return -1;
    atomic_int failed = 0;
    pg_barrier barrier = {0};
    barrier.spin_ns = pg_team_spin_ns;
    const int parallel = N * K * M >= 262144;
    _Pragma("omp parallel if (parallel)") {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        /* every thread takes part in the syncs, even one without a buffer */
        float *wbuf = (float *)aligned_alloc(64, (size_t)pg_gemm_batched_wbuf(K) * sizeof(float));
        if (wbuf == NULL) atomic_store(&failed, 1);
        pg_team_sync(&team);
        if (!failed)
            pg_gemm_batched_part(type, W, row_bytes, N, K, X, ldx, M, Y, ldy, xp, wbuf, &team);
        free(wbuf);
    }
    free(xp);
    return failed ? -1 : 0;
}
