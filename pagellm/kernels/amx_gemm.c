/* Many input rows x GGUF weights on AMX tiles in bfloat16, where the CPU has AMX-BF16
 * (Intel Xeon from Sapphire Rapids): the products of a prompt chunk or of a step of many
 * decodes, which the int8 GEMM (ggml_i8gemm.c) runs near one vpdpbusd per cycle.
 *
 * The int8 GEMM scales every 32-value group of every row on the vector units, because
 * GGUF's scales change every 32 values (AMX's int8 product, tried, gained nothing for
 * that). Here the weights are dequantized instead, 32 rows at a time, into bfloat16 tiles
 * (w = s u - m from the int8 GEMM's unpacked tiles, rounded to bfloat16), the input rows
 * are rounded to bfloat16 once per product, and the tiles accumulate over the whole row in
 * float32 (tdpbf16ps): no scaling in the loop. The numbers: each weight and input value
 * rounded to bfloat16 (8 bits of mantissa, relative error <= 2^-9), products summed in
 * float32; an int8 input row has up to 1/254 of its 32-value group's largest value as
 * error. A row's result does not depend on the other rows (the sum's order is fixed by K).
 *
 * Layouts. A: the input rows in bfloat16, M rounded up to 32 (zero rows), as tiles: 16
 * rows x 32 values in 1 KB, strip after strip of 16 rows, each strip's tiles in K order
 * (rows K values apart would fall in one L1 set: 16 lines where it holds 12).
 * A weight panel: 32 weight rows (two 16-row halves) x K, as bfloat16 B tiles of 32
 * values of K each: tile (kb, h) holds rows 16h..16h+15 of the panel, values 32kb..32kb+31,
 * as 16 lines of 64 bytes, line p = the pairs (2p, 2p+1) of each of the 16 rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"
#include "vec8.h"

int pg_i8_unpack_tile(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t r0,
                      int64_t G, uint8_t *tile, int *off);
int64_t pg_gemm_i8_tile_bytes(int type, int64_t K);
int pg_i8gemm_fast(void);

/* Panels dequantized together, up to ~1 MB of B tiles (with a strip of A, in L2): every
 * strip of A is then read from memory once per group of panels, not once per panel (an
 * AMX product at full speed needs ~16 bytes of A per ~100 ps). Measured at the 1B shapes,
 * one thread, 512-2048 rows: 1 MB ~480-570 G MAC/s, 256 KB ~400, 1.5 MB ~430-470 (the
 * group and the streamed A then no longer fit L2 together). */
static inline int64_t panels_per_group(int64_t K) {
    const int64_t p = (1 << 20) / (64 * K);
    return p < 1 ? 1 : p > 16 ? 16 : p;
}

/* 0: never take the AMX kernels (tests and A/B runs set it). */
int pg_amx_on = 1;

#if defined(PG_X86_DISPATCH) && defined(PG_AVX2) && defined(__linux__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PG_AMX_BUILD 1
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static int amx_state = -1;

/* AMX-TILE, AMX-BF16 and AVX512-BF16 in CPUID, the tile state enabled by the OS (XCR0
 * bits 17-18) and Linux's permission to use it (asked once for the process). */
static int amx_detect(void) {
    unsigned a, b, c, d;
    if (!pg_i8gemm_fast() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    if (!((a >> 5) & 1)) return 0;
    __cpuid(1, a, b, c, d);
    if (!((c >> 27) & 1)) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Whether the AMX kernels run here (and pg_amx_on lets them). */
int pg_amx_ready(void) {
    if (amx_state < 0) {
        const int got = amx_detect();
#pragma omp atomic write
        amx_state = got;
    }
    return pg_amx_on && amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3: a 32 x 32 block of results; 4, 5: two 16-row input tiles; 6, 7: a panel's
 * two weight tiles. Loaded by each thread before its products (the configuration is a
 * thread's own state), released after. */
static AMX void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Two float vectors (16 values each) as 32 bfloat16, rounded to nearest even. */
static inline AMX __m512i bf16_pair(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Rows of one 16-row int8 tile (ggml_i8gemm.c's layout: per 32-value group, u8
 * [8][16][4], then s[16] (and the second half's s or m[16])) as bfloat16 B tiles, one per
 * group, at out + g * out_stride. */
static AMX void tile_to_bf16(const uint8_t *tile, int kind, int off, int64_t G, uint8_t *out,
                             int64_t out_stride) {
    const int64_t stride = 512 + 4 * (kind == 1 ? 16 : 32);
    /* lane l of quarter j is row 4j + l / 4 */
    __m512i row_of[4];
    for (int j = 0; j < 4; j++) {
        int32_t idx[16];
        for (int l = 0; l < 16; l++) idx[l] = 4 * j + l / 4;
        row_of[j] = _mm512_loadu_si512(idx);
    }
    int32_t even_idx[16], odd_idx[16];
    for (int l = 0; l < 16; l++) {
        even_idx[l] = 2 * l;
        odd_idx[l] = 2 * l + 1;
    }
    const __m512i even = _mm512_loadu_si512(even_idx), odd = _mm512_loadu_si512(odd_idx);
    const __m512 zero_point = _mm512_set1_ps((float)off);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *t = tile + g * stride;
        const float *f = (const float *)(t + 512);
        uint8_t *o = out + g * out_stride;
        __m512 s[2][4], m[4];
        for (int half = 0; half < (kind == 2 ? 2 : 1); half++) {
            const __m512 sv = _mm512_loadu_ps(f + 16 * half);
            for (int j = 0; j < 4; j++) s[half][j] = _mm512_permutexvar_ps(row_of[j], sv);
        }
        if (kind == 0) {
            const __m512 mv = _mm512_loadu_ps(f + 16);
            for (int j = 0; j < 4; j++) m[j] = _mm512_permutexvar_ps(row_of[j], mv);
        }
        for (int c = 0; c < 8; c++) {
            const int half = kind == 2 && c >= 4;
            __m512 w[4];
            for (int j = 0; j < 4; j++) {
                const __m128i u = _mm_loadu_si128((const __m128i *)(t + 64 * c + 16 * j));
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u));
                w[j] = kind == 0 ? _mm512_fmsub_ps(v, s[0][j], m[j])
                                 : _mm512_mul_ps(_mm512_sub_ps(v, zero_point), s[half][j]);
            }
            /* 16 dwords each: (row, pair) for rows 0-7, then 8-15; split into the lines of
             * pairs 2c (values 4c, 4c+1) and 2c+1 (4c+2, 4c+3) */
            const __m512i lo = bf16_pair(w[0], w[1]), hi = bf16_pair(w[2], w[3]);
            _mm512_storeu_si512(o + 128 * c, _mm512_permutex2var_epi32(lo, even, hi));
            _mm512_storeu_si512(o + 128 * c + 64, _mm512_permutex2var_epi32(lo, odd, hi));
        }
    }
}

/* Panel p's weights (rows 32p .. 32p + 31; a missing half as zeros) as B tiles: tile
 * (kb, h) at panel + (2 kb + h) * 1024. tile: scratch for one int8 tile. */
static AMX void panel_to_bf16(int type, const uint8_t *W, int64_t row_bytes, int64_t N,
                              int64_t K, int64_t p, uint8_t *tile, uint8_t *panel) {
    const int64_t G = K / 32;
    for (int h = 0; h < 2; h++) {
        const int64_t r0 = 32 * p + 16 * h;
        if (r0 >= N) {
            for (int64_t g = 0; g < G; g++) memset(panel + (2 * g + h) * 1024, 0, 1024);
            continue;
        }
        int off;
        const int kind = pg_i8_unpack_tile(type, W, row_bytes, N, r0, G, tile, &off);
        tile_to_bf16(tile, kind, off, G, panel + h * 1024, 2048);
    }
}

/* Y[m, n0 .. n0 + n) for rows m in [m0, m0 + 32) below M: a panel's B tiles against the
 * 32-row strip of A from m0, summed over all of K in the tiles. */
static AMX void strip_tiles(const uint8_t *panel, const uint16_t *A, int64_t K, int64_t m0) {
    const int64_t G = K / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *a = A + m0 * K; /* its two 16-row strips of tiles */
    for (int64_t g = 0; g < G; g++) {
        for (int l = 0; l < 16; l++) { /* A comes from further away than the panel: ~1.1x */
            _mm_prefetch((const char *)(a + 512 * (g + 2)) + 64 * l, _MM_HINT_T0);
            _mm_prefetch((const char *)(a + 16 * K + 512 * (g + 2)) + 64 * l, _MM_HINT_T0);
        }
        _tile_loadd(4, a + 512 * g, 64);
        _tile_loadd(5, a + 16 * K + 512 * g, 64);
        _tile_loadd(6, panel + 2048 * g, 64);
        _tile_loadd(7, panel + 2048 * g + 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* The four result tiles as a 32 x 32 block of floats. */
static AMX void store_block(float *block) {
    _tile_stored(0, block, 128);
    _tile_stored(1, block + 16, 128);
    _tile_stored(2, block + 512, 128);
    _tile_stored(3, block + 528, 128);
}

static AMX void strip_product(const uint8_t *panel, const uint16_t *A, int64_t M, int64_t K,
                              int64_t m0, float *Y, int64_t ldy, int64_t n0, int64_t n) {
    strip_tiles(panel, A, K, m0);
    if (M - m0 >= 32 && n == 32) {
        float *y = Y + m0 * ldy + n0;
        _tile_stored(0, y, ldy * 4);
        _tile_stored(1, y + 16, ldy * 4);
        _tile_stored(2, y + 16 * ldy, ldy * 4);
        _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
        return;
    }
    float block[32 * 32];
    store_block(block);
    const int64_t rows = M - m0 < 32 ? M - m0 : 32;
    for (int64_t r = 0; r < rows; r++) memcpy(Y + (m0 + r) * ldy + n0, block + 32 * r, (size_t)n * 4);
}


/* Thread ith's share of the 32-row weight panels: Y[:, cols] = A @ W[cols].T.
 * scratch: pg_gemm_amx_scratch(type, K) bytes of the thread's own. */
AMX void pg_gemm_amx_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                          const uint16_t *A, int64_t M, float *Y, int64_t ldy, uint8_t *scratch,
                          const pg_team *team) {
    const int64_t panels = (N + 31) / 32;
    int64_t p0, p1;
    pg_share(panels, team, &p0, &p1);
    if (p0 >= p1) return;
    const int64_t group = panels_per_group(K), padded = (M + 31) / 32 * 32;
    uint8_t *tile = scratch + group * 64 * K;
    configure_tiles();
    for (int64_t q0 = p0; q0 < p1; q0 += group) {
        const int64_t q1 = q0 + group < p1 ? q0 + group : p1;
        for (int64_t p = q0; p < q1; p++)
            panel_to_bf16(type, W, row_bytes, N, K, p, tile, scratch + (p - q0) * 64 * K);
        for (int64_t m0 = 0; m0 < padded; m0 += 32)
            for (int64_t p = q0; p < q1; p++)
                strip_product(scratch + (p - q0) * 64 * K, A, M, K, m0, Y, ldy, 32 * p,
                              N - 32 * p < 32 ? N - 32 * p : 32);
    }
    _tile_release();
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline AMX v16f v16_select(v16i mask, v16f a, v16f b) {
    return (v16f)((mask & (v16i)a) | (~mask & (v16i)b));
}

static inline AMX v16f v16_exp(v16f x) {
    PG_EXP_LANES(v16f, v16i, v16_select, x);
    return x;
}

/* o[i] = act(g[i]) * u[i] for i < 32 (n of them), sixteen lanes at a time: the lanes of
 * pg_act_mul_row (the same steps, vec8.h), twice as wide. */
static AMX void act_mul_block(const float *g, const float *u, float *o, int64_t n, int gelu) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16f gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        const v16f ov = (gelu ? PG_GELU_TANH(gv, v16_exp) : PG_SILU(gv, v16_exp)) * uv;
        memcpy(o + i, &ov, sizeof ov);
    }
    if (i < n) { /* the last panel's columns past I: padded lanes, not stored */
        v16f gv = {0}, uv = {0};
        memcpy(&gv, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(&uv, u + i, (size_t)(n - i) * sizeof(float));
        const v16f ov = (gelu ? PG_GELU_TANH(gv, v16_exp) : PG_SILU(gv, v16_exp)) * uv;
        memcpy(o + i, &ov, (size_t)(n - i) * sizeof(float));
    }
}

/* Panels a thread dequantizes together in the gated product: a gate and an up panel each. */
static inline int64_t gated_group(int64_t K) {
    const int64_t p = panels_per_group(K) / 2;
    return p < 1 ? 1 : p;
}

/* Thread ith's share of the 32-column panels of the gated product: Y[:, cols] =
 * act(A @ Wg[cols].T) * (A @ Wu[cols].T), each 32 x 32 block of the gate and the up
 * product taken from the tiles and combined by act_mul_block (the unfused pass's
 * arithmetic, sixteen lanes at a time). scratch: pg_gemm_amx_gated_scratch bytes of the thread's own. */
AMX void pg_gemm_amx_gated_part(int tg, const uint8_t *Wg, int64_t rbg, int tu, const uint8_t *Wu,
                                int64_t rbu, int64_t I, int64_t K, const uint16_t *A, int64_t M,
                                int act, float *Y, int64_t ldy, uint8_t *scratch,
                                const pg_team *team) {
    const int64_t panels = (I + 31) / 32;
    int64_t p0, p1;
    pg_share(panels, team, &p0, &p1);
    if (p0 >= p1) return;
    const int64_t group = gated_group(K), padded = (M + 31) / 32 * 32;
    uint8_t *tile = scratch + 2 * group * 64 * K;
    float gate[32 * 32], up[32 * 32];
    configure_tiles();
    for (int64_t q0 = p0; q0 < p1; q0 += group) {
        const int64_t q1 = q0 + group < p1 ? q0 + group : p1;
        for (int64_t p = q0; p < q1; p++) {
            panel_to_bf16(tg, Wg, rbg, I, K, p, tile, scratch + 2 * (p - q0) * 64 * K);
            panel_to_bf16(tu, Wu, rbu, I, K, p, tile, scratch + (2 * (p - q0) + 1) * 64 * K);
        }
        for (int64_t m0 = 0; m0 < padded; m0 += 32)
            for (int64_t p = q0; p < q1; p++) {
                strip_tiles(scratch + 2 * (p - q0) * 64 * K, A, K, m0);
                store_block(gate);
                strip_tiles(scratch + (2 * (p - q0) + 1) * 64 * K, A, K, m0);
                store_block(up);
                const int64_t rows = M - m0 < 32 ? M - m0 : 32, n = I - 32 * p < 32 ? I - 32 * p : 32;
                for (int64_t r = 0; r < rows; r++)
                    act_mul_block(gate + 32 * r, up + 32 * r, Y + (m0 + r) * ldy + 32 * p, n, act);
            }
    }
    _tile_release();
}

/* Thread ith's share of X's rows (float32, row stride ldx) as bfloat16 in A's tiles; rows
 * from M up to the next multiple of 32 as zeros. */
AMX void pg_bf16_rows_part(const float *X, int64_t ldx, int64_t M, int64_t K, uint16_t *A,
                           const pg_team *team) {
    const int64_t padded = (M + 31) / 32 * 32;
    int64_t lo, hi;
    pg_share(padded, team, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        uint16_t *a = A + (r / 16) * 16 * K + (r % 16) * 32; /* its line of each tile */
        if (r >= M) {
            for (int64_t k = 0; k < K; k += 32) memset(a + 16 * k, 0, 64);
            continue;
        }
        const float *x = X + r * ldx;
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512(a + 16 * k, bf16_pair(_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)));
    }
}
#else
int pg_amx_ready(void) { return 0; }
void pg_gemm_amx_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const uint16_t *A, int64_t M, float *Y, int64_t ldy, uint8_t *scratch,
                      const pg_team *team) {
    (void)type, (void)W, (void)row_bytes, (void)N, (void)K, (void)A, (void)M, (void)Y, (void)ldy,
        (void)scratch, (void)team;
}
void pg_bf16_rows_part(const float *X, int64_t ldx, int64_t M, int64_t K, uint16_t *A,
                       const pg_team *team) {
    (void)X, (void)ldx, (void)M, (void)K, (void)A, (void)team;
}
static inline int64_t gated_group(int64_t K) {
    (void)K;
    return 1;
}
void pg_gemm_amx_gated_part(int tg, const uint8_t *Wg, int64_t rbg, int tu, const uint8_t *Wu,
                            int64_t rbu, int64_t I, int64_t K, const uint16_t *A, int64_t M,
                            int act, float *Y, int64_t ldy, uint8_t *scratch,
                            const pg_team *team) {
    (void)tg, (void)Wg, (void)rbg, (void)tu, (void)Wu, (void)rbu, (void)I, (void)K, (void)A,
        (void)M, (void)act, (void)Y, (void)ldy, (void)scratch, (void)team;
}
#endif

/* Whether pg_gemm_amx takes weights of `type` with K values a row. */
int pg_amx_supported(int type, int64_t K) {
    return pg_amx_ready() && K % 32 == 0 && pg_gemm_i8_tile_bytes(type, K) > 0;
}

/* Bytes of a thread's scratch for pg_gemm_amx_part: a group of panels' B tiles and an
 * int8 tile. */
int64_t pg_gemm_amx_scratch(int type, int64_t K) {
    return panels_per_group(K) * 64 * K + (pg_gemm_i8_tile_bytes(type, K) + 63) / 64 * 64;
}

/* Bytes of the bfloat16 copy of M input rows of K values (M rounded up to 32). */
int64_t pg_amx_rows_bytes(int64_t M, int64_t K) {
    return (M + 31) / 32 * 32 * K * 2;
}

/* One AMX product's weights and result: W alone (pg_gemm_amx_part), or with Wu the gate
 * and up weights of a gated MLP (pg_gemm_amx_gated_part, activation `act`). */
typedef struct {
    int type, type_u, act;
    const uint8_t *W, *Wu;
    int64_t row_bytes, row_bytes_u, N;
    float *Y;
    int64_t ldy;
} amx_job;

/* X's M rows rounded to bfloat16 once, then the job's panels shared by the team, each
 * thread with `scratch_bytes` of its own. Returns 0; -1 where memory ran out. */
static int amx_run(const amx_job *j, int64_t K, const float *X, int64_t ldx, int64_t M,
                   int64_t scratch_bytes) {
    uint16_t *A = aligned_alloc(64, (size_t)pg_amx_rows_bytes(M, K));
    if (A == NULL) return -1;
    int failed = 0;
    pg_barrier barrier = {0};
    barrier.spin_ns = pg_team_spin_ns;
#pragma omp parallel reduction(| : failed)
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        pg_bf16_rows_part(X, ldx, M, K, A, &team);
        pg_team_sync(&team);
        uint8_t *scratch = aligned_alloc(64, (size_t)scratch_bytes);
        if (scratch == NULL)
            failed = 1;
        else if (j->Wu == NULL)
            pg_gemm_amx_part(j->type, j->W, j->row_bytes, j->N, K, A, M, j->Y, j->ldy, scratch, &team);
        else
            pg_gemm_amx_gated_part(j->type, j->W, j->row_bytes, j->type_u, j->Wu, j->row_bytes_u, j->N,
                                   K, A, M, j->act, j->Y, j->ldy, scratch, &team);
        free(scratch);
    }
    free(A);
    return failed ? -1 : 0;
}

/* Y[m, n] = sum_k X[m, k] W[n, k], the inputs and the weights rounded to bfloat16 and
 * summed in float32 on AMX tiles. Returns 0; -1 where AMX or the type is not supported
 * here, K is not a multiple of 32, or memory ran out. */
int pg_gemm_amx(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy) {
    if (!pg_amx_supported(type, K) || (pg_rows16(type) && N % 16) || M <= 0) return -1;
    const amx_job job = {.type = type, .W = W, .row_bytes = row_bytes, .N = N, .Y = Y, .ldy = ldy};
    return amx_run(&job, K, X, ldx, M, pg_gemm_amx_scratch(type, K));
}

/* Bytes of a thread's scratch for pg_gemm_amx_gated_part. */
int64_t pg_gemm_amx_gated_scratch(int tg, int tu, int64_t K) {
    const int64_t tile_g = pg_gemm_i8_tile_bytes(tg, K), tile_u = pg_gemm_i8_tile_bytes(tu, K);
    return 2 * gated_group(K) * 64 * K + ((tile_g > tile_u ? tile_g : tile_u) + 63) / 64 * 64;
}

/* Y[m, i] = act(sum_k X[m, k] Wg[i, k]) * sum_k X[m, k] Wu[i, k] for i < I (a gated MLP's
 * gate and up products and its activation in one pass: no [M, 2I] result to write and
 * read back); the products as pg_gemm_amx computes them, act 0 SiLU, 1 GELU's tanh form
 * (pg_act_and_mul_part's numbers). Returns 0; -1 where pg_gemm_amx would refuse either
 * weight or memory ran out. */
int pg_gemm_amx_gated(int tg, const uint8_t *Wg, int64_t rbg, int tu, const uint8_t *Wu,
                      int64_t rbu, int64_t I, int64_t K, const float *X, int64_t ldx, int64_t M,
                      int act, float *Y, int64_t ldy) {
    if (!pg_amx_supported(tg, K) || !pg_amx_supported(tu, K) || M <= 0 ||
        ((pg_rows16(tg) || pg_rows16(tu)) && I % 16) || Wu == NULL)
        return -1;
    const amx_job job = {.type = tg, .type_u = tu, .act = act, .W = Wg, .Wu = Wu,
                         .row_bytes = rbg, .row_bytes_u = rbu, .N = I, .Y = Y, .ldy = ldy};
    return amx_run(&job, K, X, ldx, M, pg_gemm_amx_gated_scratch(tg, tu, K));
}

/* The bfloat16 weights pg_gemm_amx multiplies, row-major into out [N][K] (for tests). */
int pg_amx_weights_bf16(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                        uint16_t *out) {
#ifdef PG_AMX_BUILD
    if (!pg_amx_supported(type, K)) return -1;
    uint8_t *scratch = aligned_alloc(64, (size_t)pg_gemm_amx_scratch(type, K));
    if (scratch == NULL) return -1;
    const int64_t G = K / 32;
    for (int64_t p = 0; p < (N + 31) / 32; p++) {
        panel_to_bf16(type, W, row_bytes, N, K, p, scratch + panels_per_group(K) * 64 * K, scratch);
        for (int64_t g = 0; g < G; g++)
            for (int h = 0; h < 2; h++)
                for (int line = 0; line < 16; line++)
                    for (int i = 0; i < 16; i++) {
                        const int64_t n = 32 * p + 16 * h + i;
                        if (n >= N) continue;
                        const uint16_t *pair = (const uint16_t *)(scratch + (2 * g + h) * 1024 + 64 * line + 4 * i);
                        out[n * K + 32 * g + 2 * line] = pair[0];
                        out[n * K + 32 * g + 2 * line + 1] = pair[1];
                    }
    }
    free(scratch);
    return 0;
#else
    (void)type, (void)W, (void)row_bytes, (void)N, (void)K, (void)out;
    return -1;
#endif
}
