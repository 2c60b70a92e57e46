/* Many input rows x GGUF weights in 8-bit integers: a prompt's rows, quantized per 32
 * values as ggml_q8.c does (pg_quantize_q8: int8 q, scale d, sums per 16), against weight
 * rows unpacked 16 at a time into an int8 tile that every input row then reads.
 *
 * A weight value is w = s * u - m with u an unsigned 8-bit integer: s and m per 32 values
 * (Q4_1, Q5_1, Q4_K, Q5_K: "affine"), or m = off * s, the type's zero point (Q4_0 8, Q5_0
 * 16, Q8_0 128 with u = q + 128; Q6_K 32, with s per 16 values: "signed"). Then for input
 * group x ~ d q:
 *
 *     sum w x = s d sum(u q) - m d sum(q)            affine
 *             = s d (sum(u q) - off sum(q))          signed (exact integers, then one scale)
 *
 * Tile of 16 weight rows (one per 32-bit lane), per 32-value group j:
 *     u8 [8][16][4]: bytes 4c .. 4c+3 of group j of each row, for c = 0..7 (512 bytes)
 *     float s[16] (signed per 16 values: s[16] of the first half, s[16] of the second)
 *     float m[16] (affine only)
 * so that one VNNI instruction (vpdpbusd: 4 u8 x 4 s8 products summed into each int32
 * lane) multiplies four values of all 16 rows by the same four input values, broadcast:
 * 8 instructions per group and input row, no horizontal sums.
 *
 * The same numbers on every path: the integer sums are exact, and the float steps are the
 * same operations in the same order (fused multiply-adds) in the AVX-512 VNNI kernel and the
 * portable loops, so a row's result depends neither on the path nor on the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

enum { I_Q4_0 = 2, I_Q4_1 = 3, I_Q5_0 = 6, I_Q5_1 = 7, I_Q8_0 = 8, I_Q4_K = 12, I_Q5_K = 13, I_Q6_K = 14 };
enum { AFFINE = 0, SIGNED32 = 1, SIGNED16 = 2 }; /* how a type's groups are scaled */

int pg_q8_isa(void); /* ggml_q8.c: 2 where the CPU has AVX-512 VNNI */

/* 0: the portable loops even where AVX-512 VNNI is present (tests compare the two). */
int pg_i8_wide = 1;

static int type_kind(int type, int *off) {
    switch (type) {
        case I_Q4_0: case PG_Q4_0_R16: *off = 8; return SIGNED32;
        case I_Q5_0: *off = 16; return SIGNED32;
        case I_Q8_0: case PG_Q8_0_R16: *off = 128; return SIGNED32;
        case I_Q6_K: case PG_Q6_K_R16: *off = 32; return SIGNED16;
        case I_Q4_1: case I_Q5_1: case I_Q4_K: case I_Q5_K: case PG_Q4_K_R16: case PG_Q5_K_R16: case PG_Q4_1_R16:
            *off = 0;
            return AFFINE;
        default: return -1;
    }
}

int pg_i8gemm_supported(int type) {
    int off;
    return type_kind(type, &off) >= 0;
}

/* Whether pg_gemm_i8 runs its AVX-512 VNNI kernel on this CPU (else the portable loops,
 * far slower than the float tiles: callers keep those). */
int pg_i8gemm_fast(void) {
#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
    return pg_i8_wide && pg_q8_isa() == 2;
#else
    return 0;
#endif
}

static inline int64_t tile_floats(int kind) { return kind == AFFINE || kind == SIGNED16 ? 32 : 16; }
static inline int64_t group_bytes(int kind) { return 512 + 4 * tile_floats(kind); }

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static inline void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Group g (32 values) of a weight row: its u values, scales s[0..1] (s[1] the second
 * half's, for SIGNED16) and min. */
static void unpack_group(int type, const uint8_t *row, int64_t g, uint8_t *u, float *s, float *m) {
    switch (type) {
        case I_Q4_0: case I_Q4_1: {
            const int64_t bytes = type == I_Q4_0 ? 18 : 20;
            const uint8_t *b = row + g * bytes, *qs = b + bytes - 16;
            for (int j = 0; j < 16; j++) {
                u[j] = qs[j] & 0xF;
                u[j + 16] = qs[j] >> 4;
            }
            s[0] = s[1] = pg_f16(b);
            *m = type == I_Q4_1 ? -pg_f16(b + 2) : 0.0f;
            return;
        }
        case I_Q5_0: case I_Q5_1: {
            const int64_t bytes = type == I_Q5_0 ? 22 : 24, hoff = type == I_Q5_0 ? 2 : 4;
            const uint8_t *b = row + g * bytes, *qs = b + bytes - 16;
            uint32_t qh;
            memcpy(&qh, b + hoff, 4);
            for (int j = 0; j < 16; j++) {
                u[j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10));
                u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10));
            }
            s[0] = s[1] = pg_f16(b);
            *m = type == I_Q5_1 ? -pg_f16(b + 2) : 0.0f;
            return;
        }
        case I_Q8_0: {
            const uint8_t *b = row + g * 34;
            for (int j = 0; j < 32; j++) u[j] = (uint8_t)(b[2 + j] ^ 0x80); /* q + 128 */
            s[0] = s[1] = pg_f16(b);
            *m = 0.0f;
            return;
        }
        case I_Q4_K: case I_Q5_K: {
            const int q5 = type == I_Q5_K;
            const uint8_t *b = row + (g >> 3) * (q5 ? 176 : 144);
            const int sb = (int)(g & 7);
            const uint8_t *q = b + (q5 ? 48 : 16) + 32 * (sb >> 1), *qh = b + 16;
            int sc, mn;
            k4_scale_min(sb, b + 4, &sc, &mn);
            for (int l = 0; l < 32; l++) {
                int v = (sb & 1) ? (q[l] >> 4) : (q[l] & 0xF);
                if (q5) v += ((qh[l] >> sb) & 1) << 4;
                u[l] = (uint8_t)v;
            }
            s[0] = s[1] = pg_f16(b) * sc;
            *m = pg_f16(b + 2) * mn;
            return;
        }
        case I_Q6_K: {
            const uint8_t *b = row + (g >> 3) * 210;
            const int sb = (int)(g & 7), h = sb >> 2, t = sb & 3;
            const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * t;
            const float d = pg_f16(b + 208);
            for (int l = 0; l < 32; l++) {
                const int lo = (t >= 2) ? (ql[l] >> 4) : (ql[l] & 0xF);
                u[l] = (uint8_t)(lo | (((qh[l] >> (2 * t)) & 3) << 4));
            }
            s[0] = d * sc[0];
            s[1] = d * sc[1];
            *m = 0.0f;
            return;
        }
    }
}

/* Group g of row n of a Q4_K_R16 (Q5_K_R16: five) matrix (ggml_common.h), as unpack_group
 * gives the file type's. */
static void unpack_group_k16(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t g, int five,
                             uint8_t *u, float *s, float *m) {
    const uint8_t *b = pg_k16_block(W, row_bytes, n, g >> 3, five);
    uint8_t q[16];
    pg_k16_values(b, (int)(n & 15), (int)(g & 7), q);
    const uint32_t fifth = five ? pg_k16_fifth_bits(b, (int)(n & 15), (int)(g & 7)) : 0;
    for (int i = 0; i < 16; i++) {
        u[i] = (uint8_t)((q[i] & 0xF) | ((fifth >> i) & 1) << 4);
        u[i + 16] = (uint8_t)((q[i] >> 4) | ((fifth >> (16 + i)) & 1) << 4);
    }
    pg_k16_scale_min(b, (int)(n & 15), (int)(g & 7), &s[0], m);
    s[1] = s[0];
}

/* Rows [r0, r0 + 16) of W (those past N as zeros) into a tile of G groups. */
static void unpack_tile(int type, int kind, const uint8_t *W, int64_t row_bytes, int64_t N,
                        int64_t r0, int64_t G, uint8_t *tile) {
    const int64_t stride = group_bytes(kind);
    for (int64_t i = 0; i < 16; i++) {
        const int have = r0 + i < N;
        const uint8_t *row = W + (r0 + i) * row_bytes;
        for (int64_t g = 0; g < G; g++) {
            uint8_t u[32] = {0};
            float s[2] = {0.0f, 0.0f}, m = 0.0f;
            if (have && type == PG_Q6_K_R16) { /* the file's super-block, put back together */
                uint8_t block[210];
                pg_q6_16_file_block(W, row_bytes, r0 + i, g >> 3, block);
                unpack_group(I_Q6_K, block, g & 7, u, s, &m);
            } else if (have && pg_is_k16(type)) {
                unpack_group_k16(W, row_bytes, r0 + i, g, type == PG_Q5_K_R16, u, s, &m);
            } else if (have && pg_is_r16(type)) { /* the file's block, put back together */
                uint8_t block[34];
                pg_r16_file_block(W, row_bytes, r0 + i, g, pg_r16_base(type), block);
                unpack_group(pg_r16_base(type), block, 0, u, s, &m);
            } else if (have) {
                unpack_group(type, row, g, u, s, &m);
            }
            uint8_t *t = tile + g * stride;
            for (int c = 0; c < 8; c++) memcpy(t + c * 64 + i * 4, u + 4 * c, 4);
            float *f = (float *)(t + 512);
            f[i] = s[0];
            if (kind == SIGNED16) f[16 + i] = s[1];
            if (kind == AFFINE) f[16 + i] = m;
        }
    }
}

/* Input row x (q, d per 32, sums per 16) against a tile: out[i] for its 16 rows. The
 * reference for the vector kernel below: the same float operations in the same order
 * (integer sums are exact in any order). */
static void row_portable(int kind, int off, const uint8_t *tile, int64_t G, const int8_t *q,
                         const float *d, const int32_t *sums, float *out) {
    const int64_t stride = group_bytes(kind);
    float acc[16] = {0};
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *t = tile + g * stride;
        const float *f = (const float *)(t + 512);
        const int32_t s0 = sums[2 * g], s1 = sums[2 * g + 1];
        for (int i = 0; i < 16; i++) {
            int32_t lo = 0, hi = 0; /* values 0-15 and 16-31 of the group */
            for (int c = 0; c < 8; c++) {
                int32_t dot = 0;
                for (int b = 0; b < 4; b++) dot += (int32_t)t[c * 64 + i * 4 + b] * q[32 * g + 4 * c + b];
                if (c < 4) lo += dot; else hi += dot;
            }
            if (kind == AFFINE) {
                acc[i] = fmaf((float)(lo + hi), f[i] * d[g], acc[i]);
                acc[i] = fmaf(-f[16 + i], d[g] * (float)(s0 + s1), acc[i]);
            } else if (kind == SIGNED32) {
                acc[i] = fmaf((float)(lo + hi - off * (s0 + s1)), f[i] * d[g], acc[i]);
            } else {
                acc[i] = fmaf((float)(lo - off * s0), f[i] * d[g], acc[i]);
                acc[i] = fmaf((float)(hi - off * s1), f[16 + i] * d[g], acc[i]);
            }
        }
    }
    memcpy(out, acc, sizeof(acc));
}

#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
#define VNNI512 PG_VNNI512

/* unpack_group's values as one vector (the scales as there): the AVX-512 path's tiles. */
static inline VNNI512 __m256i group_vec(int type, const uint8_t *row, int64_t g, float *s, float *m) {
    switch (type) {
        case I_Q4_0: case I_Q4_1: {
            const int64_t bytes = type == I_Q4_0 ? 18 : 20;
            const uint8_t *b = row + g * bytes;
            s[0] = s[1] = pg_f16(b);
            *m = type == I_Q4_1 ? -pg_f16(b + 2) : 0.0f;
            return pg_nibbles_32(b + bytes - 16);
        }
        case I_Q5_0: case I_Q5_1: {
            const int64_t bytes = type == I_Q5_0 ? 22 : 24, hoff = type == I_Q5_0 ? 2 : 4;
            const uint8_t *b = row + g * bytes;
            uint32_t qh;
            memcpy(&qh, b + hoff, 4);
            s[0] = s[1] = pg_f16(b);
            *m = type == I_Q5_1 ? -pg_f16(b + 2) : 0.0f;
            return _mm256_or_si256(pg_nibbles_32(b + bytes - 16), pg_bits_to_0x10(qh));
        }
        case I_Q8_0: {
            const uint8_t *b = row + g * 34;
            s[0] = s[1] = pg_f16(b);
            *m = 0.0f;
            return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
        }
        case I_Q4_K: case I_Q5_K: {
            const int q5 = type == I_Q5_K;
            const uint8_t *b = row + (g >> 3) * (q5 ? 176 : 144);
            const int sb = (int)(g & 7);
            int sc, mn;
            k4_scale_min(sb, b + 4, &sc, &mn);
            s[0] = s[1] = pg_f16(b) * sc;
            *m = pg_f16(b + 2) * mn;
            const __m256i low = _mm256_set1_epi8(0x0F);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * (sb >> 1)));
            __m256i v = _mm256_and_si256(sb & 1 ? _mm256_srli_epi16(q, 4) : q, low);
            if (q5) { /* bit sb of each qh byte -> bit 4 (16-bit shifts: no bit crosses into bit 0) */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sb)), _mm256_set1_epi8(1));
                v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
            }
            return v;
        }
        default: { /* I_Q6_K */
            const uint8_t *b = row + (g >> 3) * 210;
            const int sb = (int)(g & 7), h = sb >> 2, t = sb & 3;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * t;
            const float d = pg_f16(b + 208);
            s[0] = d * sc[0];
            s[1] = d * sc[1];
            *m = 0.0f;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
            return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
    }
}

/* A tile group's values from row order (row i's 32 bytes at 32i) to the tile's (dword c
 * of every row in vector c): a 16 x 8 dword transpose, three rounds of two-register
 * permutes, each trading one bit of the register number for one of the lane number. */
static inline VNNI512 void transpose_values(uint8_t *t) {
    const __m512i a0 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    const __m512i a1 = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    const __m512i b0 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    const __m512i b1 = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    /* the last round also puts each register's lanes in row order */
    const __m512i c0 = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
    const __m512i c1 = _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31);
    __m512i z[8], y[8];
    for (int k = 0; k < 8; k++) z[k] = _mm512_loadu_si512(t + 64 * k);
    for (int k = 0; k < 8; k += 2) {
        y[k] = _mm512_permutex2var_epi32(z[k], a0, z[k + 1]);
        y[k + 1] = _mm512_permutex2var_epi32(z[k], a1, z[k + 1]);
    }
    for (int k = 0; k < 8; k++) {
        if (k & 2) continue;
        z[k] = _mm512_permutex2var_epi32(y[k], b0, y[k + 2]);
        z[k + 2] = _mm512_permutex2var_epi32(y[k], b1, y[k + 2]);
    }
    for (int k = 0; k < 4; k++) {
        _mm512_storeu_si512(t + 64 * k, _mm512_permutex2var_epi32(z[k], c0, z[k + 4]));
        _mm512_storeu_si512(t + 64 * (k + 4), _mm512_permutex2var_epi32(z[k], c1, z[k + 4]));
    }
}

/* Rows [r0, r0 + 16) of a Q4_K_R16 (Q5_K_R16: five) matrix into the tile: each
 * sub-block's four vectors already hold bytes 4c .. 4c+3 of the sixteen rows, so an AND
 * and a shift give the tile's eight (pg_k16_tile; Q5_K's fifth bits ORed in, pg_k16_fifth);
 * the scales and minimums of sixteen rows are one product each. unpack_group_k16's tile. */
static VNNI512 void unpack_tile_k16(const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t G,
                                    int five, uint8_t *tile) {
    const int64_t stride = group_bytes(AFFINE);
    for (int64_t sb = 0; sb < G / 8; sb++) {
        const uint8_t *b = pg_k16_block(W, row_bytes, r0, sb, five);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        for (int j = 0; j < 8; j++) {
            uint8_t *t = tile + (8 * sb + j) * stride;
            __m512i v[8];
            pg_k16_tile(b + PG_K16_VALUES + 256 * j, v);
            if (five) pg_k16_fifth(b + PG_K16_HIGH + 64 * j, v);
            for (int c = 0; c < 8; c++) _mm512_storeu_si512(t + 64 * c, v[c]);
            float *f = (float *)(t + 512);
            const __m128i scv = _mm_loadu_si128((const __m128i *)(b + PG_K16_SCALES + 16 * j));
            const __m128i mnv = _mm_loadu_si128((const __m128i *)(b + PG_K16_MINS + 16 * j));
            _mm512_storeu_ps(f, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scv))));
            _mm512_storeu_ps(f + 16, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mnv))));
        }
    }
}

/* Rows [r0, r0 + 16) of a Q6_K_R16 matrix into the tile (pg_q6_16_tile), each group's two
 * halves' scales (d * scale) one product each. */
static VNNI512 void unpack_tile_q6_16(const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t G,
                                      uint8_t *tile) {
    const int64_t stride = group_bytes(SIGNED16);
    for (int64_t sb = 0; sb < G / 8; sb++) {
        const uint8_t *b = pg_q6_16_block(W, row_bytes, r0, sb);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        for (int j = 0; j < 8; j++) {
            uint8_t *t = tile + (8 * sb + j) * stride;
            __m512i v[8];
            pg_q6_16_tile(b + PG_Q6_16_VALUES + 384 * j, v);
            for (int c = 0; c < 8; c++) _mm512_storeu_si512(t + 64 * c, v[c]);
            float *f = (float *)(t + 512);
            for (int h = 0; h < 2; h++)
                _mm512_storeu_ps(f + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(b + PG_Q6_16_SCALES + 16 * (2 * j + h)))))));
        }
    }
}

/* unpack_tile with group_vec: the same tile. */
static VNNI512 void unpack_tile_vec(int type, int kind, const uint8_t *W, int64_t row_bytes,
                                    int64_t N, int64_t r0, int64_t G, uint8_t *tile) {
    const int64_t stride = group_bytes(kind);
    if (type == PG_Q6_K_R16 && N - r0 >= 16) {
        unpack_tile_q6_16(W, row_bytes, r0, G, tile);
        return;
    }
    if (pg_is_k16(type) && N - r0 >= 16) {
        unpack_tile_k16(W, row_bytes, r0, G, type == PG_Q5_K_R16, tile);
        return;
    }
    if (pg_is_r16(type) && N - r0 >= 16) { /* 16 rows already in the tile's order: unpack */
        const int base = pg_r16_base(type), head = base == 3 ? 64 : 32;
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = pg_r16_block(W, row_bytes, r0, g, base);
            uint8_t *t = tile + g * stride;
            if (base == 8) {
                for (int c = 0; c < 8; c++)
                    _mm512_storeu_si512(t + 64 * c, _mm512_xor_si512(_mm512_loadu_si512(b + head + 64 * c),
                                                                     _mm512_set1_epi8((char)0x80)));
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m512i q = _mm512_loadu_si512(b + head + 64 * c);
                    _mm512_storeu_si512(t + 64 * c, _mm512_and_si512(q, low4));
                    _mm512_storeu_si512(t + 64 * (c + 4), _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
                }
            }
            float *f = (float *)(t + 512);
            _mm512_storeu_ps(f, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b)));
            if (kind == AFFINE) /* minus the minimums, as unpack_group gives them */
                _mm512_storeu_ps(f + 16, _mm512_sub_ps(_mm512_setzero_ps(),
                                                       _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)))));
        }
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        uint8_t *t = tile + g * stride;
        float *f = (float *)(t + 512);
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = r0 + i;
            float s[2] = {0.0f, 0.0f}, m = 0.0f;
            __m256i v = _mm256_setzero_si256();
            if (n < N && type == PG_Q6_K_R16) {
                uint8_t block[210];
                pg_q6_16_file_block(W, row_bytes, n, g >> 3, block);
                v = group_vec(I_Q6_K, block, g & 7, s, &m);
            } else if (n < N && pg_is_k16(type)) { /* row n's sub-block */
                const int five = type == PG_Q5_K_R16;
                const uint8_t *b = pg_k16_block(W, row_bytes, n, g >> 3, five);
                uint8_t q[16];
                pg_k16_scale_min(b, (int)(n & 15), (int)(g & 7), &s[0], &m);
                s[1] = s[0];
                pg_k16_values(b, (int)(n & 15), (int)(g & 7), q);
                v = five ? _mm256_or_si256(pg_nibbles_32(q), pg_k16_fifth_0x10(b, (int)(n & 15), (int)(g & 7)))
                         : pg_nibbles_32(q);
            } else if (n < N && pg_is_r16(type)) {
                uint8_t block[34];
                pg_r16_file_block(W, row_bytes, n, g, pg_r16_base(type), block);
                v = group_vec(pg_r16_base(type), block, 0, s, &m);
            } else if (n < N) {
                v = group_vec(type, W + n * row_bytes, g, s, &m);
            }
            _mm256_storeu_si256((__m256i *)(t + 32 * i), v); /* row after row, for now */
            f[i] = s[0];
            if (kind == SIGNED16) f[16 + i] = s[1];
            if (kind == AFFINE) f[16 + i] = m;
        }
        transpose_values(t);
    }
}

/* The scalar each input row's group gives every tile's float step, computed once a call
 * instead of once a tile: AFFINE d * (float)(sum q) (the minimums' factor), SIGNED32
 * -off * sum q (the zero point's integer, where its chain of sums starts). SIGNED16 keeps
 * its two sums (pg_tile_row16). */
typedef union {
    float f;
    int32_t i;
} group_term;

static void group_terms(int kind, int off, const float *DX, const int32_t *SX, int64_t M, int64_t G,
                        group_term *terms) {
    for (int64_t i = 0; i < M * G; i++) {
        const int32_t sum = SX[2 * i] + SX[2 * i + 1];
        if (kind == AFFINE) terms[i].f = DX[i] * (float)sum;
        else terms[i].i = -off * sum;
    }
}

/* R input rows (1..4) against a tile: acc[r] holds the 16 rows' sums for input row r. One
 * chain of VNNI sums per row (the R rows are the independent chains), and the float step
 * of pg_tile_row with its per-group scalars from `terms` (the same operations, the same
 * bits). */
static inline __attribute__((always_inline)) VNNI512 void rows_vnni(
    const int R, const int kind, int off, const uint8_t *tile, int64_t G, const int8_t *const *q,
    const float *const *d, const int32_t *const *sums, const group_term *const *terms, __m512 *acc) {
    const int64_t stride = group_bytes(kind);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *t = tile + g * stride;
        const float *f = (const float *)(t + 512);
        _mm_prefetch((const char *)(t + 4 * stride), _MM_HINT_T0);
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(t + 64 * c));
        const __m512 s = _mm512_loadu_ps(f);
        if (kind == SIGNED16) {
            for (int r = 0; r < R; r++)
                acc[r] = pg_tile_row16(w, s, _mm512_loadu_ps(f + 16), off, q[r] + 32 * g, d[r][g],
                                       sums[r][2 * g], sums[r][2 * g + 1], acc[r]);
            continue;
        }
        __m512i sum[4];
        for (int r = 0; r < R; r++)
            sum[r] = kind == AFFINE ? _mm512_setzero_si512() : _mm512_set1_epi32(terms[r][g].i);
        for (int c = 0; c < 8; c++)
            for (int r = 0; r < R; r++) {
                const pg_i32u *x4 = (const pg_i32u *)(q[r] + 32 * g);
                sum[r] = _mm512_dpbusd_epi32(sum[r], w[c], _mm512_set1_epi32(x4[c]));
            }
        if (kind == AFFINE) {
            const __m512 neg_mins = _mm512_loadu_ps(f + 16); /* the tile holds minus the minimums */
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(s, _mm512_set1_ps(d[r][g])), acc[r]);
                acc[r] = _mm512_fnmadd_ps(neg_mins, _mm512_set1_ps(terms[r][g].f), acc[r]);
            }
        } else {
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(s, _mm512_set1_ps(d[r][g])), acc[r]);
        }
    }
}

/* Every input row against one tile, 4 at a time, into Y's columns [r0, r0 + n); the next
 * tile's weight bytes (next, next_bytes: none where NULL) are fetched into L2 a few lines
 * per 4 rows, so that its unpacking does not wait on memory (a decode step's weights
 * stream from memory once a step: with 64 rows, a fixed cost per tile beside ~16 passes). */
static VNNI512 void tile_vnni(int kind, int off, const uint8_t *tile, int64_t G, const int8_t *QX,
                              const float *DX, const int32_t *SX, const group_term *terms, int64_t M,
                              int64_t K, float *Y, int64_t ldy, int64_t r0, int64_t n,
                              const uint8_t *next, int64_t next_bytes) {
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    const int64_t lines = next != NULL ? (next_bytes + 63) / 64 : 0, passes = (M + 3) / 4;
    const int64_t per = (lines + passes - 1) / passes;
    int64_t line = 0;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        for (int64_t u = 0; u < per && line < lines; u++, line++)
            _mm_prefetch((const char *)(next + 64 * line), _MM_HINT_T1);
        const int R = (int)(M - m0 < 4 ? M - m0 : 4);
        const int8_t *q[4];
        const float *d[4];
        const int32_t *sums[4];
        const group_term *tm[4];
        for (int r = 0; r < R; r++) {
            q[r] = QX + (m0 + r) * K;
            d[r] = DX + (m0 + r) * G;
            sums[r] = SX + (m0 + r) * 2 * G;
            tm[r] = terms + (m0 + r) * G;
        }
        __m512 acc[4];
#define ROWS(n_, k_) rows_vnni(n_, k_, off, tile, G, q, d, sums, tm, acc)
#define KINDS(n_)                                                                           \
    if (kind == AFFINE) ROWS(n_, AFFINE);                                                   \
    else if (kind == SIGNED32) ROWS(n_, SIGNED32);                                          \
    else ROWS(n_, SIGNED16)
        switch (R) {
            case 4: KINDS(4); break;
            case 3: KINDS(3); break;
            case 2: KINDS(2); break;
            default: KINDS(1);
        }
#undef KINDS
#undef ROWS
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(Y + (m0 + r) * ldy + r0, keep, acc[r]);
    }
}
#endif

/* Tiles [t0, t1) of W (tile t: weight rows [16 t, 16 t + 16)) against the M input rows;
 * tile: group_bytes * K/32 bytes of scratch. For callers that hand tiles out themselves
 * (claims as the team goes); pg_gemm_i8_part takes a static share. `after`: the tile this
 * thread takes next (its bytes are fetched while the last tile computes), -1 if none.
 * `same`: this thread's previous call had these inputs and a weight of this type, so its
 * per-group scalars stand (a claimed product's later chunks). */
void pg_gemm_i8_tiles(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
                      int64_t ldy, uint8_t *tile, int64_t t0, int64_t t1, int64_t after, int same) {
    int off;
    const int kind = type_kind(type, &off);
    const int64_t G = K / 32;
#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
    if (pg_i8gemm_fast() && t0 < t1) {
        /* each thread its own copy of the per-group scalars (M * G: small beside its tiles) */
        static _Thread_local group_term *terms = NULL;
        static _Thread_local int64_t terms_cap = 0;
        if (terms_cap < M * G) {
            group_term *grown = realloc(terms, (size_t)(M * G) * sizeof(group_term));
            if (grown == NULL) goto portable; /* the portable loops need no scratch */
            terms = grown;
            terms_cap = M * G;
            same = 0;
        }
        if (kind != SIGNED16 && !same) group_terms(kind, off, DX, SX, M, G, terms);
        for (int64_t t = t0; t < t1; t++) {
            const int64_t r0 = 16 * t, n = N - r0 < 16 ? N - r0 : 16;
            unpack_tile_vec(type, kind, W, row_bytes, N, r0, G, tile);
            const int64_t nt = t + 1 < t1 ? t + 1 : after; /* the tile after this one */
            const int64_t next_rows = nt >= 0 && 16 * nt < N ? (N - 16 * nt < 16 ? N - 16 * nt : 16) : 0;
            tile_vnni(kind, off, tile, G, QX, DX, SX, terms, M, K, Y, ldy, r0, n,
                      next_rows > 0 ? W + 16 * nt * row_bytes : NULL, next_rows * row_bytes);
        }
        return;
    }
portable:
#endif
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r0 = 16 * t, n = N - r0 < 16 ? N - r0 : 16;
        unpack_tile(type, kind, W, row_bytes, N, r0, G, tile);
        for (int64_t m = 0; m < M; m++) {
            float out[16];
            row_portable(kind, off, tile, G, QX + m * K, DX + m * G, SX + m * 2 * G, out);
            memcpy(Y + m * ldy + r0, out, (size_t)n * sizeof(float));
        }
    }
}

/* Thread ith's share of the 16-row tiles; tile: group_bytes * K/32 bytes of scratch. */
void pg_gemm_i8_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                     const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
                     int64_t ldy, uint8_t *tile, const pg_team *team) {
    int64_t t0, t1;
    pg_share((N + 15) / 16, team, &t0, &t1);
    pg_gemm_i8_tiles(type, W, row_bytes, N, K, QX, DX, SX, M, Y, ldy, tile, t0, t1, -1, 0);
}

/* Rows [r0, r0 + 16) of W into a tile of G groups (the layout above), with the vector
 * unpacker where it runs: for the AMX kernels (amx_gemm.c), which start from the same
 * tiles. Returns the type's kind (AFFINE 0, SIGNED32 1, SIGNED16 2) and its zero point in
 * *off, or -1 for a type with no unpacker. */
int pg_i8_unpack_tile(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t r0,
                      int64_t G, uint8_t *tile, int *off) {
    const int kind = type_kind(type, off);
    if (kind < 0) return -1;
#if defined(PG_X86_DISPATCH) && defined(PG_AVX2)
    if (pg_i8gemm_fast()) {
        unpack_tile_vec(type, kind, W, row_bytes, N, r0, G, tile);
        return kind;
    }
#endif
    unpack_tile(type, kind, W, row_bytes, N, r0, G, tile);
    return kind;
}

int64_t pg_gemm_i8_tile_bytes(int type, int64_t K) {
    int off;
    const int kind = type_kind(type, &off);
    return kind < 0 ? 0 : group_bytes(kind) * (K / 32);
}

/* Y[m, n] = sum_k X[m, k] W[n, k] for M input rows quantized by pg_quantize_q8 (one level).
 * Returns 0; -1 when K is not a multiple of 32, the type has no unpacker or memory ran out. */
int pg_gemm_i8(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
               const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
               int64_t ldy) {
    if (K % 32 != 0 || !pg_i8gemm_supported(type) || (pg_rows16(type) && N % 16)) return -1;
    const int64_t bytes = pg_gemm_i8_tile_bytes(type, K);
    int failed = 0;
    /* tiles claimed as the team goes (pg_claim: two threads from the two ends), not a
     * static share: a thread that a shared VM slows takes fewer */
    pg_barrier counter = {0};
    const int64_t tiles = (N + 15) / 16;
#pragma omp parallel if (M * N * K >= 1 << 22) reduction(| : failed)
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &counter};
        uint8_t *tile = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        if (tile == NULL) {
            failed = 1;
        } else {
            int64_t taken = 0;
            if (!pg_q8_claim) /* a static split (tests, A/B measurements) */
                pg_gemm_i8_part(type, W, row_bytes, N, K, QX, DX, SX, M, Y, ldy, tile, &team);
            else
                for (int64_t t, same = 0; (t = pg_claim(&team, tiles, &taken)) >= 0; same = 1)
                    pg_gemm_i8_tiles(type, W, row_bytes, N, K, QX, DX, SX, M, Y, ldy, tile, t, t + 1,
                                     pg_claim_next(&team, tiles, t), (int)same);
            free(tile);
        }
    }
    return failed ? -1 : 0;
}
