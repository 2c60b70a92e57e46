/* Helpers shared by the weight kernels (ggml_cpu.c, ggml_q8.c, ggml_gemm.c, dense_f32.c):
 * float16 scales, the AVX2 unpacking of 4-bit values and of 5th bits, and the run-time
 * choice of instruction set for the kernels built with target attributes. */
#ifndef PAGELLM_GGML_COMMON_H
#define PAGELLM_GGML_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PG_NO_SIMD)
#include <immintrin.h>
#define PG_AVX2 1
#endif

/* x86 kernels compiled for AVX-512 / AVX2 through target attributes, whatever the
 * library's global flags; which one runs is chosen at run time (pg_isa_level). */
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(PG_NO_SIMD)
#include <immintrin.h>
#define PG_X86_DISPATCH 1
#endif

/* 2: AVX-512F, 1: AVX2 + FMA, 0: neither (or the portable build); detected once
 * (ggml_gemm.c). */
int pg_isa_level(void);

/* Whether the CPU has AVX-512 F, BW, VL and DQ, what the other AVX-512 kernels (the int8
 * ones with VNNI besides, the decode attention) are compiled for; detected once. */
int pg_avx512_full(void);

/* Q4_K and Q5_K weights repacked at load, sixteen rows at a time (pg_repack_k_r16,
 * ggml_cpu.c), for the int8 kernels: not ggml types. Per group of 16 rows and super-block
 * of 256 values, pg_k16_sb_bytes bytes:
 *   [0, 32)      d of rows 0-15 (float16)     [32, 64)  dmin of rows 0-15
 *   [64, 192)    scale of sub-block j, row r at 64 + 16j + r (6 bits, unpacked)
 *   [192, 320)   minimum of sub-block j, row r at 192 + 16j + r
 *   [320, 2368)  values' low 4 bits: sub-block j's 256 bytes at 320 + 256j as four 64-byte
 *                vectors, vector c holding bytes 4c .. 4c+3 of each row (row r at 64c + 4r),
 *                where a row's byte i = value i | value 16 + i << 4
 *   [2368, 2880) Q5_K only: the values' fifth bits, sub-block j's at 2368 + 64j, the byte at
 *                4r + k holding in bit u that of the value in lane 4r + k of tile vector u
 *                (value 4u + k for u < 4, 16 + 4(u - 4) + k after)
 * so that a sub-block of the sixteen rows is the int8 GEMM's tile (ggml_i8gemm.c) after
 * an AND and a shift (and for Q5_K an OR of the shifted fifth bits), and its sixteen scales
 * (minimums) are one 16-byte load. A row's `row_bytes` is 148 (Q5_K: 180) per super-block,
 * the file's with the scales unpacked; row n lies in the group starting at row n - n % 16,
 * which holds 16 * row_bytes bytes. */
#define PG_Q4_K_R16 113
#define PG_Q5_K_R16 115
#define PG_K16_SCALES 64
#define PG_K16_MINS 192
#define PG_K16_VALUES 320
#define PG_K16_HIGH 2368

static inline int64_t pg_k16_sb_bytes(int five) { return five ? 2880 : 2368; }

/* Super-block sb of the group of rows that holds row n (lane n % 16 in it). */
static inline const uint8_t *pg_k16_block(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t sb,
                                          int five) {
    return W + (n >> 4) * 16 * row_bytes + sb * pg_k16_sb_bytes(five);
}

/* Q6_K weights repacked at load, sixteen rows at a time (pg_repack_k_r16, ggml_cpu.c),
 * for the int8 kernels: not a ggml type. A value is u - 32, u of 6 bits; a scale (int8)
 * per 16 values. Per group of 16 rows and super-block of 256 values, PG_Q6_16_SB bytes:
 *   [0, 32)      d of rows 0-15 (float16)
 *   [32, 288)    scale of values 16s .. 16s+15, row r at 32 + 16s + r (int8)
 *   [288, 3360)  32-value group j's 384 bytes at 288 + 384j:
 *                [0, 256): four vectors, vector c holding bytes 4c .. 4c+3 of each row (row
 *                r at 64c + 4r), a row's byte i = low 4 bits of value i | of value 16 + i << 4;
 *                [256, 384): two vectors of the values' top 2 bits, vector a's byte at
 *                4r + k holding those of values 8a + k, 8a + 4 + k, 16 + 8a + k and
 *                16 + 8a + 4 + k (bits 0-1, 2-3, 4-5, 6-7)
 * so that a group of the sixteen rows is the int8 GEMM's tile (ggml_i8gemm.c) after ANDs,
 * shifts and ORs, and its 2 x 16 scales are two 16-byte loads. `row_bytes` stays Q6_K's 210
 * per super-block; row n lies in the group starting at row n - n % 16. */
#define PG_Q6_K_R16 114
#define PG_Q6_16_SB 3360
#define PG_Q6_16_SCALES 32
#define PG_Q6_16_VALUES 288

static inline const uint8_t *pg_q6_16_block(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t sb) {
    return W + (n >> 4) * 16 * row_bytes + sb * PG_Q6_16_SB;
}

/* Super-block sb of row n of a Q6_K_R16 matrix as the file stored it (210 bytes into out). */
static inline void pg_q6_16_file_block(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t sb,
                                       uint8_t *out) {
    const uint8_t *b = pg_q6_16_block(W, row_bytes, n, sb);
    const int r = (int)(n & 15);
    memset(out, 0, 192);
    for (int v = 0; v < 256; v++) {
        const int j = v >> 5, i = v & 31, c = (i & 15) >> 2, k = i & 3, a = c >> 1;
        const uint8_t *g = b + PG_Q6_16_VALUES + 384 * j;
        const int low = (g[64 * c + 4 * r + k] >> (i >= 16 ? 4 : 0)) & 0xF;
        const int top = (g[256 + 64 * a + 4 * r + k] >> (2 * (c & 1) + (i >= 16 ? 4 : 0))) & 3;
        const int h = v >> 7, t = (v >> 5) & 3, l = v & 31;
        out[64 * h + 32 * (t & 1) + l] |= (uint8_t)(low << (t >= 2 ? 4 : 0));
        out[128 + 32 * h + l] |= (uint8_t)(top << (2 * t));
    }
    for (int s = 0; s < 16; s++) out[192 + s] = b[PG_Q6_16_SCALES + 16 * s + r];
    memcpy(out + 208, b + 2 * r, 2);
}

/* Q4_0, Q4_1 and Q8_0 weights repacked at load, sixteen rows at a time (pg_repack_r16,
 * ggml_cpu.c), for the int8 decode kernels: not ggml types (100 + the file's type). Per
 * group of 16 rows and block of 32 values, 16 times the file's block bytes:
 *   [0, 32)    d of rows 0-15 (float16)
 *   [32, 64)   Q4_1 only: m of rows 0-15 (float16)
 *   then the values as 64-byte vectors, vector c holding bytes 4c .. 4c+3 of the file's
 *   values of each row, row w's at 4w: Q4_0 / Q4_1 four vectors (a byte: value i in its
 *   low nibble, value i + 16 in its high), Q8_0 eight (int8).
 * One vector is then four values of all sixteen rows: a vpdpbusd with four input values
 * broadcast multiplies them, no horizontal sums (ggml_i8gemm.c's tile, packed). Row n
 * lies in the group starting at row n - n % 16, which holds 16 * row_bytes bytes; a row's
 * `row_bytes` is the file's. */
#define PG_Q4_0_R16 102
#define PG_Q4_1_R16 103
#define PG_Q8_0_R16 108

static inline int pg_is_r16(int type) {
    return type == PG_Q4_0_R16 || type == PG_Q4_1_R16 || type == PG_Q8_0_R16;
}

/* Q4_K_R16 or Q5_K_R16 (one layout, the fifth bits apart). */
static inline int pg_is_k16(int type) { return type == PG_Q4_K_R16 || type == PG_Q5_K_R16; }

/* Any of pagellm's 16-row layouts: its matrices hold whole groups of 16 rows. */
static inline int pg_rows16(int type) { return pg_is_r16(type) || pg_is_k16(type) || type == PG_Q6_K_R16; }

/* The file's type of a repacked one (2, 3 or 8), and that type's bytes per block. */
static inline int pg_r16_base(int type) { return type - 100; }
static inline int64_t pg_b32_bytes(int base) { return base == 2 ? 18 : base == 3 ? 20 : 34; }

/* Block g of the group of 16 rows that holds row n. */
static inline const uint8_t *pg_r16_block(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t g,
                                          int base) {
    return W + (n >> 4) * 16 * row_bytes + g * 16 * pg_b32_bytes(base);
}

/* Block g of row n as the file stored it (pg_b32_bytes(base) bytes into out). */
static inline void pg_r16_file_block(const uint8_t *W, int64_t row_bytes, int64_t n, int64_t g,
                                     int base, uint8_t *out) {
    const uint8_t *b = pg_r16_block(W, row_bytes, n, g, base);
    const int w = (int)(n & 15), head = base == 3 ? 4 : 2, vecs = base == 8 ? 8 : 4;
    memcpy(out, b + 2 * w, 2);
    if (base == 3) memcpy(out + 2, b + 32 + 2 * w, 2);
    const uint8_t *v = b + 16 * head;
    for (int c = 0; c < vecs; c++) memcpy(out + head + 4 * c, v + 64 * c + 4 * w, 4);
}

#ifdef PG_X86_DISPATCH
#define PG_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
typedef int32_t __attribute__((may_alias, aligned(1))) pg_i32u; /* 4 input bytes as one lane */

/* One input row against a block of 16 weight rows in ggml_i8gemm.c's tile order (w[c]:
 * values 4c .. 4c+3 of each row, u8): acc plus the 16 rows' products. x: the row's 32
 * int8 values, dg their scale, s0 and s1 the sums of their halves; s: the rows' scales.
 * Affine types add their minimums m times dg (s0 + s1); the others take their zero point
 * `off` off the integer sums. The int8 GEMM (rows_vnni) and the R16 decode kernel
 * (r16_rows, ggml_q8.c) both call it, so a row gets the same bits from either. */
PG_VNNI512 static inline __attribute__((always_inline)) __m512 pg_tile_row(
    const __m512i *w, __m512 s, __m512 m, const int affine, int off, const int8_t *x, float dg,
    int32_t s0, int32_t s1, __m512 acc) {
    const pg_i32u *x4 = (const pg_i32u *)x; /* broadcast from memory */
    __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x4[0]));
    __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(x4[1]));
    for (int c = 2; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, w[c], _mm512_set1_epi32(x4[c]));
        odd = _mm512_dpbusd_epi32(odd, w[c + 1], _mm512_set1_epi32(x4[c + 1]));
    }
    __m512i sum = _mm512_add_epi32(even, odd);
    if (affine) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(dg)), acc);
        return _mm512_fmadd_ps(m, _mm512_set1_ps(dg * (float)(s0 + s1)), acc);
    }
    sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(off * (s0 + s1)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(dg)), acc);
}

/* pg_tile_row for R input rows at once, R >= 4: four rows are the independent chains, one
 * chain of VNNI sums each (no even and odd halves to add), a signed type's chain starting
 * from -off times the row's sum of values (no subtraction). The same integer sums and the
 * same float steps as pg_tile_row: the same bits. x[r]: input row r's 32 values of the
 * group, dg[r] its scale, sq[r] the sum of its values (s0 + s1). */
PG_VNNI512 static inline __attribute__((always_inline)) void pg_tile_rows(
    const int R, const __m512i *w, __m512 s, __m512 m, const int affine, int off,
    const int8_t *const *x, const float *dg, const int32_t *sq, __m512 *acc) {
    for (int r0 = 0; r0 < R; r0 += 4) { /* four rows' chains at a time: the registers hold them */
        const int n = R - r0 < 4 ? R - r0 : 4;
        __m512i sum[4];
        for (int r = 0; r < n; r++)
            sum[r] = affine ? _mm512_setzero_si512() : _mm512_set1_epi32(-off * sq[r0 + r]);
        for (int c = 0; c < 8; c++)
            for (int r = 0; r < n; r++)
                sum[r] = _mm512_dpbusd_epi32(sum[r], w[c], _mm512_set1_epi32(((const pg_i32u *)x[r0 + r])[c]));
        for (int r = r0; r < r0 + n; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r - r0]), _mm512_mul_ps(s, _mm512_set1_ps(dg[r])), acc[r]);
            if (affine) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dg[r] * (float)sq[r]), acc[r]);
        }
    }
}

/* pg_tile_row for types scaled per 16 values (Q6_K): the sums of values 0-15 and 16-31
 * each less the zero point times their inputs' sum, each times its scales (s, s2). */
PG_VNNI512 static inline __attribute__((always_inline)) __m512 pg_tile_row16(
    const __m512i *w, __m512 s, __m512 s2, int off, const int8_t *x, float dg, int32_t s0,
    int32_t s1, __m512 acc) {
    const pg_i32u *x4 = (const pg_i32u *)x; /* broadcast from memory */
    __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x4[0]));
    __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(x4[4]));
    for (int c = 1; c < 4; c++) {
        lo = _mm512_dpbusd_epi32(lo, w[c], _mm512_set1_epi32(x4[c]));
        hi = _mm512_dpbusd_epi32(hi, w[c + 4], _mm512_set1_epi32(x4[c + 4]));
    }
    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(off * s0));
    hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(off * s1));
    const __m512 dv = _mm512_set1_ps(dg);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s, dv), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s2, dv), acc);
}

/* Sub-block j of a Q4_K_R16 super-block (v: its 256 bytes) as the int8 GEMM's tile: an AND
 * and a shift of each vector (low nibbles: values 4c.., high: 16 + 4c..). */
PG_VNNI512 static inline __attribute__((always_inline)) void pg_k16_tile(const uint8_t *v, __m512i *t) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m512i q = _mm512_loadu_si512(v + 64 * c);
        t[c] = _mm512_and_si512(q, low4);
        t[c + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    }
}

/* Q5_K_R16: the fifth bits of a sub-block (h: its 64 bytes) into the tile, bit u of each
 * byte to bit 4 of vector u's (16-bit shifts: no bit that crosses a byte reaches bit 4). */
PG_VNNI512 static inline __attribute__((always_inline)) void pg_k16_fifth(const uint8_t *h, __m512i *t) {
    const __m512i bits = _mm512_loadu_si512(h), bit4 = _mm512_set1_epi8(0x10);
    t[0] = _mm512_or_si512(t[0], _mm512_and_si512(_mm512_slli_epi16(bits, 4), bit4));
    t[1] = _mm512_or_si512(t[1], _mm512_and_si512(_mm512_slli_epi16(bits, 3), bit4));
    t[2] = _mm512_or_si512(t[2], _mm512_and_si512(_mm512_slli_epi16(bits, 2), bit4));
    t[3] = _mm512_or_si512(t[3], _mm512_and_si512(_mm512_slli_epi16(bits, 1), bit4));
    t[4] = _mm512_or_si512(t[4], _mm512_and_si512(bits, bit4));
    t[5] = _mm512_or_si512(t[5], _mm512_and_si512(_mm512_srli_epi16(bits, 1), bit4));
    t[6] = _mm512_or_si512(t[6], _mm512_and_si512(_mm512_srli_epi16(bits, 2), bit4));
    t[7] = _mm512_or_si512(t[7], _mm512_and_si512(_mm512_srli_epi16(bits, 3), bit4));
}

/* Group j of a Q6_K_R16 super-block (g: its 384 bytes) as the int8 GEMM's tile: the
 * values' low 4 bits from the four vectors, their top 2 from the two after them. */
PG_VNNI512 static inline __attribute__((always_inline)) void pg_q6_16_tile(const uint8_t *g, __m512i *t) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    for (int a = 0; a < 2; a++) {
        const __m512i h = _mm512_loadu_si512(g + 256 + 64 * a);
        const __m512i v0 = _mm512_loadu_si512(g + 128 * a), v1 = _mm512_loadu_si512(g + 128 * a + 64);
        t[2 * a] = _mm512_or_si512(_mm512_and_si512(v0, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), top2));
        t[2 * a + 1] = _mm512_or_si512(_mm512_and_si512(v1, low4), _mm512_and_si512(_mm512_slli_epi16(h, 2), top2));
        t[2 * a + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), _mm512_and_si512(h, top2));
        t[2 * a + 5] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low4),
                                       _mm512_and_si512(_mm512_srli_epi16(h, 2), top2));
    }
}
#endif

/* The float16 at p as a float (F16C where built with it, else by its bits). */
static inline float pg_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef PG_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Row r's (0-15) sub-block j (0-7) of Q4_K_R16 super-block b: its 16 bytes of values
 * (byte i = value i | value 16 + i << 4), gathered from the four vectors; and its scale
 * and minimum as Q4_K's dequantization takes them (d * scale, dmin * min). */
static inline void pg_k16_values(const uint8_t *b, int r, int j, uint8_t *out) {
    for (int c = 0; c < 4; c++) memcpy(out + 4 * c, b + PG_K16_VALUES + 256 * j + 64 * c + 4 * r, 4);
}

/* Q5_K_R16: the fifth bits of row r's sub-block j, bit i for value i. */
static inline uint32_t pg_k16_fifth_bits(const uint8_t *b, int r, int j) {
    const uint8_t *h = b + PG_K16_HIGH + 64 * j + 4 * r;
    uint32_t bits = 0;
    for (int i = 0; i < 32; i++) {
        const int u = i < 16 ? i >> 2 : 4 + ((i - 16) >> 2);
        bits |= (uint32_t)((h[i & 3] >> u) & 1) << i;
    }
    return bits;
}

static inline void pg_k16_scale_min(const uint8_t *b, int r, int j, float *scale, float *min) {
    *scale = pg_f16(b + 2 * r) * b[PG_K16_SCALES + 16 * j + r];
    *min = pg_f16(b + 32 + 2 * r) * b[PG_K16_MINS + 16 * j + r];
}

#ifdef PG_AVX2
/* 16 bytes of packed nibbles -> 32 bytes: low nibbles first (values 0..15), then high. */
static inline __m256i pg_nibbles_32(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* Bit i of `bits` -> byte i of the result: 0x10 where set, else 0. */
static inline __m256i pg_bits_to_0x10(uint32_t bits) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                              0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Row r's (0-15) group j (0-7) of Q6_K_R16 super-block b: its 32 values (0-63), gathered
 * from the group's vectors in the order the file's would give them. */
static inline __m256i pg_q6_16_values(const uint8_t *b, int r, int j) {
    const uint8_t *g = b + PG_Q6_16_VALUES + 384 * j;
    int32_t v[4], t[2];
    for (int c = 0; c < 4; c++) memcpy(&v[c], g + 64 * c + 4 * r, 4);
    for (int a = 0; a < 2; a++) memcpy(&t[a], g + 256 + 64 * a + 4 * r, 4);
    const __m128i low = _mm_setr_epi32(v[0], v[1], v[2], v[3]), mask = _mm_set1_epi8(0x0F);
    /* value i's top bits: byte i & 3 of t[i >> 3], at bit 2 ((i >> 2) & 1), 4 more for 16 + i */
    const __m128i x = _mm_shuffle_epi8(_mm_setr_epi32(t[0], t[1], 0, 0),
                                       _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
    const __m128i first = _mm_blendv_epi8(x, _mm_srli_epi16(x, 2),
                                          _mm_setr_epi8(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1));
    const __m256i top = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(first, 4), first), _mm256_set1_epi8(3));
    const __m256i values = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(low, 4), mask), _mm_and_si128(low, mask));
    return _mm256_or_si256(values, _mm256_slli_epi16(top, 4));
}

/* Q5_K_R16: byte i 0x10 where value i of row r's sub-block j has its fifth bit
 * (pg_k16_fifth_bits in vectors: byte i & 3 of the row's four, bit u of it, as the layout
 * puts them). */
static inline __m256i pg_k16_fifth_0x10(const uint8_t *b, int r, int j) {
    int32_t h;
    memcpy(&h, b + PG_K16_HIGH + 64 * j + 4 * r, 4);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(h), _mm256_set1_epi32(0x03020100));
    /* value i's bit: u = i / 4 for i < 16, 4 + (i - 16) / 4 after */
    const __m256i select = _mm256_set_epi64x(0x8080808040404040, 0x2020202010101010,
                                             0x0808080804040404, 0x0202020201010101);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

static inline float pg_hsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

#endif
