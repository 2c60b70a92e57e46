/* One-token decode attention over the paged KV cache, and the cache write. Queries,
 * scores and outputs are float32; the cache holds float32, float16 or bfloat16 values
 * (`kv_type`, PG_KV_*: --kv-cache-dtype), widened to float32 as they are read and
 * rounded to nearest even as they are written (torch's conversions, bit for bit).
 *
 * Cache storage (as attention/torch_backend.py allocates it):
 *   K [KVH, NB, D, bs]   a block's keys transposed: key dim d of slot s at [d * bs + s]
 *   V [KVH, NB, bs, D]   one row of D values per slot
 * A q8_0 cache (PG_KV_Q8, D a multiple of 32) holds llama.cpp's q8_0 blocks: every 32
 * dims of one slot's key or value as 32 int8 values and a float16 scale (the largest
 * magnitude / 127), the scales kept in the same rows after the values, so a cache block
 * is still one contiguous piece (bytes):
 *   K [KVH, NB, D + D/16, bs]  bytes 0 .. 16 D - 1: the int8 keys, four dims of a slot
 *                              together (VNNI's operand): dim d of slot s at byte
 *                              [(d / 4 * bs + s) * 4 + d % 4]; then the scales, float16
 *                              of block d / 32 of slot s at byte
 *                              [D * bs + (d / 32) * 2 * bs + 2 * s]
 *   V [KVH, NB, bs, D + D/16]  a slot's D int8 values, then its D / 32 float16 scales
 * A q8_0 score multiplies int8 keys by an int8 query, as llama.cpp's flash attention does
 * (it quantizes the query to the K cache's type), in two levels: the query times the
 * softmax scale is quantized to q8_0 as the cache's rows are, and its residual again
 * (q8_query); each 32 dims' int8 products are summed exactly as int32, and the score is
 * the chain over the blocks (and in each, the levels) of fused multiply-adds of that sum
 * times (slot scale x query scale). An output weighs a slot's values (its int8 values times the
 * row's scale: exact in float32) by its probability. Every kernel takes these same steps (the integer sums are exact
 * however they are formed), so a row's numbers stay the same whichever kernel reads it
 * (decode, prompt rows, AVX2 or AVX-512).
 *
 * Request b reads the slots [lo[b], hi[b]) of its padded row, slot i living in block
 * table[b * table_stride + i / bs] at offset i % bs. Query head h reads KV head
 * h / (H / KVH) (grouped-query attention).
 *
 * Two paths, the same arithmetic up to summation order:
 *  - AVX2 (bs == 16, D a multiple of 32): one task per (request, KV head, run of up to 4
 *    of its query heads). Every K block is loaded once for the run's heads, scores are
 *    computed for whole blocks (slots outside [lo, hi) are never read back), the softmax
 *    uses a vectorised exp, and V rows are loaded once per 32 dims for all the heads.
 *    Where the CPU has AVX-512 the same tasks run twice as wide, with the same numbers.
 *  - portable: one task per (request, query head), plain loops.
 * Each score is a sequential sum over d and each output a sequential sum over slots, so
 * a request's result does not depend on the other requests in the step.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_common.h"
#include "team.h"

enum { PG_KV_F32 = 0, PG_KV_F16 = 1, PG_KV_BF16 = 2, PG_KV_Q8 = 3 }; /* the cache's element type */

/* Query vectors one several-row task holds at most (its score accumulators): the rows of
 * a prompt chunk or a verify run, times their heads of one KV head. */
enum { PREFILL_VECTORS = 12 };

/* Bytes of one value of a float cache; 1 for q8_0's int8 values (its scales aside). */
static inline int64_t kv_elem_bytes(int kt) { return kt == PG_KV_F32 ? 4 : kt == PG_KV_Q8 ? 1 : 2; }

/* Bytes of one slot's V row (D values, and a q8_0 row's scales); a block of bs slots
 * takes bs of them in K as in V. */
static inline int64_t kv_row_bytes(int kt, int64_t D) {
    return kt == PG_KV_Q8 ? D + D / 16 : D * kv_elem_bytes(kt);
}

/* A q8_0 cache's K block kblk (numbered kvh * NB + block; bs 16) and V row vrow
 * ((kvh * NB + block) * 16 + slot), as bytes. */
static inline const int8_t *q8_kblock(const void *k, int64_t kblk, int64_t D) {
    return (const int8_t *)k + kblk * 16 * kv_row_bytes(PG_KV_Q8, D);
}
static inline const int8_t *q8_vrow(const void *v, int64_t vrow, int64_t D) {
    return (const int8_t *)v + vrow * kv_row_bytes(PG_KV_Q8, D);
}

/* The scale of dims [d, d + 32) (d a multiple of 32) of V row vrow: a q8_0 row's, 1 for
 * a float cache. */
static inline float v_scale(const void *v, int64_t vrow, int64_t D, int64_t d, const int kt) {
    if (kt != PG_KV_Q8) return 1.0f;
    return pg_f16((const uint8_t *)q8_vrow(v, vrow, D) + D + d / 32 * 2);
}


/* Element i of a cache of type kt as a float. */
static inline float kv_get(const void *base, int64_t i, const int kt) {
    if (kt == PG_KV_F32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    if (kt == PG_KV_F16) return pg_f16((const uint8_t *)&h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* x rounded to the nearest float16 (ties to even), as bits; NaN stays NaN. */
static inline uint16_t f32_to_f16(float x) {
#ifdef PG_AVX2
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t b;
    memcpy(&b, &x, 4);
    const uint32_t sign = (b >> 16) & 0x8000, absb = b & 0x7fffffff;
    if (absb > 0x7f800000) return (uint16_t)(sign | 0x7e00); /* NaN */
    if (absb >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
    if (absb < 0x38800000) { /* below 2^-14: a subnormal float16 (or 0) */
        if (absb < 0x33000000) return (uint16_t)sign; /* under half the smallest: 0 */
        const uint32_t e = absb >> 23, man = (absb & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e; /* v = man * 2^(e - 126), units of 2^-24 */
        uint32_t v = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (v & 1))) v++;
        return (uint16_t)(sign | v);
    }
    uint32_t v = ((absb >> 13) - (112u << 10)), rest = absb & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (v & 1))) v++;
    return (uint16_t)(sign | v);
#endif
}

/* x rounded to the nearest bfloat16 (ties to even), as bits; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7fffffff) > 0x7f800000) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

static inline void kv_put(void *base, int64_t i, float x, const int kt) {
    if (kt == PG_KV_F32) ((float *)base)[i] = x;
    else ((uint16_t *)base)[i] = kt == PG_KV_F16 ? f32_to_f16(x) : f32_to_bf16(x);
}

/* The first of B * per tasks (task k belongs to request k / per) before which at least
 * `target` slots are read, each task counting its slots plus 16 for its query and output. */
static int64_t task_at_slot(int64_t target, int64_t B, int64_t per, const int64_t *lo,
                            const int64_t *hi) {
    int64_t seen = 0, k = 0;
    for (; k < B * per && seen < target; k++) seen += hi[k / per] - lo[k / per] + 16;
    return k;
}

/* [*t0, *t1): this thread's share of the B * per tasks, cut where the slots read so far
 * cross i / nth of all of them, so that long and short requests (or the rows of one
 * prompt, each a key longer than the last) even out across the team. Which thread runs a
 * task changes no number. */
static void share_by_slots(int parallel, int64_t B, int64_t per, const int64_t *lo,
                           const int64_t *hi, const pg_team *team, int64_t *t0, int64_t *t1) {
    if (!pg_team_splits(parallel, team)) { /* all of it on thread 0 */
        pg_share_if(parallel, B * per, team, t0, t1);
        return;
    }
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) total += (hi[b] - lo[b] + 16) * per;
    *t0 = task_at_slot(total * team->ith / team->nth, B, per, lo, hi);
    *t1 = task_at_slot(total * (team->ith + 1) / team->nth, B, per, lo, hi);
}

/* 0: the AVX2 attention even where AVX-512 is present (tests compare the two). */
int pg_attn_wide = 1;

/* Whether this CPU runs tasks512 (compiled for AVX-512 F, BW, VL, DQ and VNNI: a q8_0
 * cache's scores take vpdpbusd). */
static int attn512(void) {
#ifdef PG_X86_DISPATCH
    static int vnni = -1;
    if (vnni < 0) vnni = pg_avx512_full() && __builtin_cpu_supports("avx512vnni");
    return vnni && pg_attn_wide;
#else
    return 0;
#endif
}

/* Whether the decode attention runs its AVX-512 tasks here. */
int pg_attn_isa512(void) { return attn512(); }

#ifdef PG_AVX2
/* e^x for x <= 0 (scores minus their maximum): Cephes' expf polynomial after reducing x to
 * r + n ln 2, |r| <= ln2 / 2; about 1 ulp. Below -87 (under FLT_MIN) the result is 0.
 * EXP_NEG_STEPS is that polynomial on P-wide vectors of B bits (P: the intrinsics' prefix,
 * _mm256 or _mm512; round: their round-to-nearest of x): written once, so exp_neg and
 * exp_neg16 take the same operations lane by lane and give the same values. x is already
 * clamped to -87; the caller zeroes the lanes that were under it. */
#define EXP_NEG_STEPS(P, B, round, x, out)                                                     \
    do {                                                                                       \
        const __m##B n_ = round(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));             \
        __m##B r_ = P##_fnmadd_ps(n_, P##_set1_ps(0.693359375f), x);                           \
        r_ = P##_fnmadd_ps(n_, P##_set1_ps(-2.12194440e-4f), r_);                              \
        __m##B p_ = P##_set1_ps(1.9875691500e-4f);                                             \
        p_ = P##_fmadd_ps(p_, r_, P##_set1_ps(1.3981999507e-3f));                              \
        p_ = P##_fmadd_ps(p_, r_, P##_set1_ps(8.3334519073e-3f));                              \
        p_ = P##_fmadd_ps(p_, r_, P##_set1_ps(4.1665795894e-2f));                              \
        p_ = P##_fmadd_ps(p_, r_, P##_set1_ps(1.6666665459e-1f));                              \
        p_ = P##_fmadd_ps(p_, r_, P##_set1_ps(5.0000001201e-1f));                              \
        p_ = P##_fmadd_ps(p_, P##_mul_ps(r_, r_), P##_add_ps(r_, P##_set1_ps(1.0f)));          \
        const __m##B##i e_ = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n_), P##_set1_epi32(127)), 23); \
        out = P##_mul_ps(p_, P##_castsi##B##_ps(e_));                                          \
    } while (0)
#define ROUND8(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 e;
    EXP_NEG_STEPS(_mm256, 256, ROUND8, x, e);
    return _mm256_andnot_ps(under, e);
}

/* cap * tanh(x / cap) lane by lane (Gemma 2's score cap): tanh(a) = (1 - e^-2a) / (1 + e^-2a)
 * for a = |x| / cap, the sign put back. */
static inline __m256 soft_cap8(__m256 x, float cap) {
    const __m256 sign = _mm256_set1_ps(-0.0f), c = _mm256_set1_ps(cap);
    const __m256 a = _mm256_andnot_ps(sign, _mm256_div_ps(x, c));
    const __m256 t = exp_neg(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    const __m256 th = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), t), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
    return _mm256_mul_ps(_mm256_or_ps(th, _mm256_and_ps(x, sign)), c);
}

/* Elements [i, i + 8) of a cache of type kt as floats. */
static inline __m256 kv_load8(const void *base, int64_t i, const int kt) {
    if (kt == PG_KV_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kt == PG_KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* K of slots [s0, s0 + 8) at dim d of a float cache's block kblk (numbered kvh * NB +
 * block; bs 16) as floats (a q8_0 cache's keys: q8_scores8). */
static inline __m256 k_load8(const void *k, int64_t kblk, int64_t D, int64_t d, int s0, const int kt) {
    return kv_load8(k, (kblk * D + d) * 16 + s0, kt);
}

/* Dims [d, d + 8) of V row vrow ((kvh * NB + block) * 16 + slot) as floats (a q8_0
 * cache's int8 values times their block's scale: exact products, 7 bits by 11). */
static inline __m256 v_load8(const void *v, int64_t vrow, int64_t D, int64_t d, const int kt) {
    if (kt != PG_KV_Q8) return kv_load8(v, vrow * D + d, kt);
    const int8_t *r = q8_vrow(v, vrow, D);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + d)))),
                         _mm256_set1_ps(v_scale(v, vrow, D, d, kt)));
}

/* The softmax of slots [off, off + n) of each of G score rows (`stride` floats apart), in
 * place (cap > 0: the scores capped first). */
static inline __attribute__((always_inline)) void softmax_rows(const int G, float *sc, int64_t stride,
                                                               int64_t off, int64_t n, float cap) {
    for (int g = 0; g < G; g++) {
        float *p = sc + g * stride + off;
        if (cap > 0.0f) {
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, soft_cap8(_mm256_loadu_ps(p + i), cap));
            for (; i < n; i++) p[i] = cap * tanhf(p[i] / cap);
        }
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + i));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float best = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; i < n; i++) best = p[i] > best ? p[i] : best;
        __m256 vb = _mm256_set1_ps(best), vsum = _mm256_setzero_ps();
        i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + i), vb));
            _mm256_storeu_ps(p + i, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float total = pg_hsum(vsum);
        for (; i < n; i++) {
            p[i] = expf(p[i] - best);
            total += p[i];
        }
        const float inv = 1.0f / total;
        for (i = 0; i < n; i++) p[i] *= inv;
    }
}

/* The task after this one on the same thread (n == 0: none): its blocks are fetched into
 * L2 while this task computes, spread over this task's K blocks, so the loads that follow
 * find them there rather than waiting on memory one block at a time. */
typedef struct {
    const int64_t *row; /* the next request's block row */
    int64_t kvh, j0, n; /* its KV head, first block and block count */
} next_task;

/* The lines of the next task's K and V blocks that go with blocks [rel, rel + step) of
 * this task's `cur` (the same share of the next task's), as up to 8 block offsets in
 * `offs`; returns how many. */
static inline __attribute__((always_inline)) int next_blocks(const next_task *nx, int64_t rel,
                                                             int64_t step, int64_t cur,
                                                             int64_t NB, int64_t bytes,
                                                             int64_t *offs) {
    if (nx->n == 0) return 0;
    const int64_t from = rel * nx->n / cur;
    int64_t to = (rel + step) * nx->n / cur;
    if (to > nx->n) to = nx->n;
    if (to > from + 8) to = from + 8;
    int m = 0;
    for (int64_t jj = from; jj < to; jj++) offs[m++] = (nx->kvh * NB + nx->row[nx->j0 + jj]) * bytes;
    return m;
}

/* A walk over the lines of the `m` next blocks' K and V (each `lines` cache lines), a
 * prefetch or two per iteration of the d loop rather than a burst that stalls on fill
 * buffers. */
typedef struct {
    const int64_t *offs;
    int m, blk;
    int64_t lines, line;
} next_lines;

static inline __attribute__((always_inline)) void prefetch_next_line(const char *kc, const char *vc,
                                                                     next_lines *w) {
    if (w->blk >= w->m) return;
    const int64_t off = w->offs[w->blk] + w->line * 64;
    _mm_prefetch(kc + off, _MM_HINT_T1);
    _mm_prefetch(vc + off, _MM_HINT_T1);
    if (++w->line == w->lines) {
        w->line = 0;
        w->blk++;
    }
}

/* The prefetch of a float cache's K block kn's dim d (a line every 64 bytes). */
static inline __attribute__((always_inline)) void prefetch_k_dim(const char *kn, int64_t d, int64_t es) {
    if ((d * 16 * es) % 64 == 0) _mm_prefetch(kn + d * 16 * es, _MM_HINT_T0);
}

static inline uint16_t q8_block(const float *x, int8_t *q);

/* A query vector (times the softmax scale) in two q8_0 levels, x ~ d1 q1 + d2 q2, q2 the
 * residual x - d1 q1 rounded as q8_0 again (q8_block, as the cache's rows are quantized):
 * per level its int8 values, each 32 dims' scale (the float16's value), and 128 times each
 * 32 dims' sum of values (what a K byte read as unsigned, k + 128, adds to the VNNI
 * kernel's sums). One level is llama.cpp's (its flash attention quantizes the query to the
 * K cache's type); the second leaves the query's rounding ~1/250 of one level's, the
 * float query's scores to ~1e-5, so the greedy tokens the float query gave stay (one level
 * changed the default model's answer to "What is the capital of France?"). D <= 256. */
typedef struct {
    int8_t q[2][256];
    float d[2][8];
    int32_t off[2][8];
} q8_query;

static inline void q8_query_of(const float *x, int64_t D, q8_query *qv) {
    for (int64_t c = 0; c < D / 32; c++) {
        float r[32];
        for (int l = 0; l < 2; l++) {
            const float *in = l == 0 ? x + 32 * c : r;
            const uint16_t h = q8_block(in, qv->q[l] + 32 * c);
            qv->d[l][c] = pg_f16((const uint8_t *)&h);
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) sum += qv->q[l][32 * c + i];
            qv->off[l][c] = 128 * sum;
            if (l == 0)
                for (int i = 0; i < 32; i++) r[i] = x[32 * c + i] - qv->d[0][c] * (float)qv->q[0][32 * c + i];
        }
    }
}

/* Four dims of level l of a q8_query from dim 4 u, as one 32-bit lane. */
static inline int32_t q8_four(const q8_query *qv, int l, int64_t u) {
    int32_t v;
    memcpy(&v, qv->q[l] + 4 * u, 4);
    return v;
}

/* The scores of slots [8 h, 8 h + 8) of q8_0 K block b (bs 16) for NQ query vectors: per
 * 32 dims and query level the exact int32 sums of k q (|k| times q given k's sign: a pair
 * of products stays inside int16, 2 x 127 x 127), then a[i] = fma(sum, slot scale x
 * query scale, a[i]) over the blocks in order, level 1 then level 2, from zero. */
static inline __attribute__((always_inline)) void q8_scores8(const int NQ, const int8_t *b, int64_t D,
                                                             int h, const q8_query *qv, __m256 *a) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < NQ; i++) a[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D / 32; c++) {
        const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * D + 32 * c + 16 * h)));
        for (int l = 0; l < 2; l++) {
            __m256i s[6];
            for (int i = 0; i < NQ; i++) s[i] = _mm256_setzero_si256();
            for (int64_t u = 8 * c; u < 8 * c + 8; u++) {
                const __m256i k = _mm256_loadu_si256((const __m256i *)(b + 64 * u + 32 * h));
                const __m256i ak = _mm256_abs_epi8(k);
                for (int i = 0; i < NQ; i++) {
                    const __m256i qk = _mm256_sign_epi8(_mm256_set1_epi32(q8_four(&qv[i], l, u)), k);
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ak, qk), ones));
                }
            }
            for (int i = 0; i < NQ; i++)
                a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dk, _mm256_set1_ps(qv[i].d[l][c])), a[i]);
        }
    }
}

/* q8_scores8 for both halves of K block b, stored as NQ score rows (`stride` floats
 * apart) from column col. */
static inline __attribute__((always_inline)) void q8_store_scores8(const int NQ, const int8_t *b, int64_t D,
                                                                   const q8_query *qv, float *sc,
                                                                   int64_t stride, int64_t col) {
    for (int h = 0; h < 2; h++) {
        __m256 a[6];
        q8_scores8(NQ, b, D, h, qv, a);
        for (int i = 0; i < NQ; i++) _mm256_storeu_ps(sc + i * stride + col + 8 * h, a[i]);
    }
}

/* The lines of the next K block and of the next task's blocks (next_blocks), fetched
 * before a q8_0 block's scores (a block is 16 D + D bytes: a few dozen lines). */
static inline __attribute__((always_inline)) void q8_prefetch(const char *kc, const char *vc,
                                                              const char *kn, int64_t kbytes,
                                                              next_lines *walk) {
    for (int64_t l = 0; l < kbytes; l += 64) _mm_prefetch(kn + l, _MM_HINT_T0);
    for (int64_t u = 0; u < walk->m * walk->lines; u++) prefetch_next_line(kc, vc, walk);
}

/* Heads [h0, h0 + G) of request b, all reading KV head kvh; bs == 16, D % 32 == 0.
 * sc: G rows of `stride` floats, slot i of the padded row at [i - 16 * (lo / 16)].
 * cap > 0: scores are capped (soft_cap8) before the softmax. */
static inline __attribute__((always_inline)) void decode_heads(
    const int G, const int kt, const float *q, int64_t ldq, int64_t b, int64_t h0, int64_t kvh,
    int64_t D, const void *k_store, const void *v_store, int64_t NB, const int64_t *row,
    int64_t lo, int64_t hi, float scale, float cap, float *sc, int64_t stride, float *out,
    int64_t H, const next_task *nx) {
    const char *kc = (const char *)k_store, *vc = (const char *)v_store;
    const int64_t es = kv_elem_bytes(kt), rb = kv_row_bytes(kt, D), kbytes = 16 * rb;
    const int64_t j0 = lo / 16, j1 = (hi + 15) / 16;
    float qs[4][256];
    for (int g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) qs[g][d] = q[b * ldq + (h0 + g) * D + d] * scale;
    /* scores: every slot of blocks j0 .. j1-1, K loaded once for the G heads */
    q8_query qv[4];
    if (kt == PG_KV_Q8)
        for (int g = 0; g < G; g++) q8_query_of(qs[g], D, &qv[g]);
    for (int64_t j = j0; j < j1; j++) {
        const int64_t kb = kvh * NB + row[j]; /* the block, numbered as k_load8's */
        const char *kn = kc + (kvh * NB + row[j + 1 < j1 ? j + 1 : j]) * kbytes;
        int64_t offs[8];
        next_lines walk = {offs, next_blocks(nx, j - j0, 1, j1 - j0, NB, kbytes, offs), 0,
                           kbytes / 64, 0};
        if (kt == PG_KV_Q8) {
            q8_prefetch(kc, vc, kn, kbytes, &walk);
            q8_store_scores8(G, q8_kblock(k_store, kb, D), D, qv, sc, stride, (j - j0) * 16);
            continue;
        }
        __m256 a[4][2];
        for (int g = 0; g < G; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
        const int64_t per = (walk.m * walk.lines + D - 1) / D;
        for (int64_t d = 0; d < D; d++) {
            for (int64_t u = 0; u < per; u++) prefetch_next_line(kc, vc, &walk);
            prefetch_k_dim(kn, d, es);
            __m256 k0 = k_load8(k_store, kb, D, d, 0, kt), k1 = k_load8(k_store, kb, D, d, 8, kt);
            for (int g = 0; g < G; g++) {
                __m256 qd = _mm256_set1_ps(qs[g][d]);
                a[g][0] = _mm256_fmadd_ps(qd, k0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(qd, k1, a[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(sc + g * stride + (j - j0) * 16, a[g][0]);
            _mm256_storeu_ps(sc + g * stride + (j - j0) * 16 + 8, a[g][1]);
        }
    }
    const int64_t n = hi - lo, off = lo - j0 * 16;
    softmax_rows(G, sc, stride, off, n, cap);
    /* out[g] = sum_i p[g][i] V[i], 32 dims at a time: each V row loaded once for G heads */
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m256 a[4][4];
        for (int g = 0; g < G; g++) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
        for (int64_t i = lo; i < hi; i++) {
            const int64_t vr = (kvh * NB + row[i / 16]) * 16 + i % 16; /* the V row */
            if (d0 == 0 && i / 16 + 1 < j1) { /* the next block's row, while this one computes */
                const char *vn = vc + ((kvh * NB + row[i / 16 + 1]) * 16 + i % 16) * rb;
                for (int64_t c = 0; c < rb; c += 64) _mm_prefetch(vn + c, _MM_HINT_T0);
            }
            __m256 v0 = v_load8(v_store, vr, D, d0, kt), v1 = v_load8(v_store, vr, D, d0 + 8, kt);
            __m256 v2 = v_load8(v_store, vr, D, d0 + 16, kt), v3 = v_load8(v_store, vr, D, d0 + 24, kt);
            for (int g = 0; g < G; g++) {
                __m256 pi = _mm256_set1_ps(sc[g * stride + off + (i - lo)]);
                a[g][0] = _mm256_fmadd_ps(pi, v0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(pi, v1, a[g][1]);
                a[g][2] = _mm256_fmadd_ps(pi, v2, a[g][2]);
                a[g][3] = _mm256_fmadd_ps(pi, v3, a[g][3]);
            }
        }
        for (int g = 0; g < G; g++) {
            float *o = out + (b * H + h0 + g) * D + d0;
            _mm256_storeu_ps(o, a[g][0]);
            _mm256_storeu_ps(o + 8, a[g][1]);
            _mm256_storeu_ps(o + 16, a[g][2]);
            _mm256_storeu_ps(o + 24, a[g][3]);
        }
    }
}

/* What a several-row task's kernels (rows_heads, rows_heads512) start from: the slots
 * [*first, *last) that any of its NQ query vectors sees, and each vector (row i / nh, head
 * h0 + i % nh) times the scale in qs[i]. */
static inline __attribute__((always_inline)) void rows_setup(
    const int NQ, const float *q, int64_t ldq, int64_t t0, int64_t nh, int64_t h0, int64_t D,
    float scale, const int64_t *lo, const int64_t *hi, float (*qs)[256], int64_t *first,
    int64_t *last) {
    *first = lo[0], *last = hi[0];
    for (int i = 1; i < NQ; i++) {
        *first = lo[i] < *first ? lo[i] : *first;
        *last = hi[i] > *last ? hi[i] : *last;
    }
    for (int i = 0; i < NQ; i++)
        for (int64_t d = 0; d < D; d++) qs[i][d] = q[(t0 + i / nh) * ldq + (h0 + i % nh) * D + d] * scale;
}

/* A vector's probabilities over the task's slots [base, end): +0 outside its own
 * [off, off + n), so the output's chain over every slot of the task adds nothing there. */
static inline __attribute__((always_inline)) void zero_outside(float *p, int64_t base, int64_t off,
                                                               int64_t n, int64_t end) {
    for (int64_t x = base; x < off; x++) p[x] = 0.0f;
    for (int64_t x = off + n; x < end; x++) p[x] = 0.0f;
}

/* rows_heads' outputs, dims [d0, d0 + 32), of its NC query vectors from c0: each its chain
 * over the task's slots [first, last) of probability times V row, each V row loaded once
 * for the NC vectors. */
static inline __attribute__((always_inline)) void rows_pv8(
    const int NC, const int c0, const int kt, int64_t t0, int64_t nh, int64_t h0, int64_t kvh,
    int64_t D, int64_t d0, const void *v_store, int64_t NB, const int64_t *row, int64_t first,
    int64_t last, const float *sc, int64_t stride, int64_t base, float *out, int64_t H) {
    __m256 acc[3][4];
    for (int c = 0; c < NC; c++) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = _mm256_setzero_ps();
    for (int64_t i = first; i < last; i++) {
        const int64_t vr = (kvh * NB + row[i / 16]) * 16 + i % 16; /* the V row */
        const __m256 v0 = v_load8(v_store, vr, D, d0, kt), v1 = v_load8(v_store, vr, D, d0 + 8, kt);
        const __m256 v2 = v_load8(v_store, vr, D, d0 + 16, kt), v3 = v_load8(v_store, vr, D, d0 + 24, kt);
        for (int c = 0; c < NC; c++) {
            const __m256 pi = _mm256_set1_ps(sc[(c0 + c) * stride + base + (i - first)]);
            acc[c][0] = _mm256_fmadd_ps(pi, v0, acc[c][0]);
            acc[c][1] = _mm256_fmadd_ps(pi, v1, acc[c][1]);
            acc[c][2] = _mm256_fmadd_ps(pi, v2, acc[c][2]);
            acc[c][3] = _mm256_fmadd_ps(pi, v3, acc[c][3]);
        }
    }
    for (int c = 0; c < NC; c++) {
        const int64_t t = t0 + (c0 + c) / nh, h = h0 + (c0 + c) % nh;
        float *o = out + (t * H + h) * D + d0;
        _mm256_storeu_ps(o, acc[c][0]);
        _mm256_storeu_ps(o + 8, acc[c][1]);
        _mm256_storeu_ps(o + 16, acc[c][2]);
        _mm256_storeu_ps(o + 24, acc[c][3]);
    }
}

/* rows_heads512 on AVX2 (up to 6 query vectors: two accumulators each for a block's 16
 * slots; the output 32 dims at a time for 3 vectors a pass over the slots): each score
 * decode_heads' chain over d, each softmax softmax_rows, each output its chain over slots,
 * so a row gets the bits decode_heads gives it alone. */
static inline __attribute__((always_inline)) void rows_heads(
    const int NQ, const int kt, const float *q, int64_t ldq, int64_t t0, int64_t nh, int64_t h0,
    int64_t kvh, int64_t D, const void *k_store, const void *v_store, int64_t NB,
    const int64_t *row, const int64_t *lo, const int64_t *hi, float scale, float cap, float *sc,
    int64_t stride, float *out, int64_t H) {
    const char *kc = (const char *)k_store;
    const int64_t es = kv_elem_bytes(kt), rb = kv_row_bytes(kt, D), kbytes = 16 * rb;
    int64_t first, last;
    float qs[6][256];
    rows_setup(NQ, q, ldq, t0, nh, h0, D, scale, lo, hi, qs, &first, &last);
    q8_query qv[6];
    if (kt == PG_KV_Q8)
        for (int i = 0; i < NQ; i++) q8_query_of(qs[i], D, &qv[i]);
    const int64_t j0 = first / 16, j1 = (last + 15) / 16;
    for (int64_t j = j0; j < j1; j++) {
        const int64_t kb = kvh * NB + row[j]; /* the block, numbered as k_load8's */
        const char *kn = kc + (kvh * NB + row[j + 1 < j1 ? j + 1 : j]) * kbytes;
        if (kt == PG_KV_Q8) {
            for (int64_t l = 0; l < kbytes; l += 64) _mm_prefetch(kn + l, _MM_HINT_T0);
            q8_store_scores8(NQ, q8_kblock(k_store, kb, D), D, qv, sc, stride, (j - j0) * 16);
            continue;
        }
        __m256 a[6][2];
        for (int i = 0; i < NQ; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            prefetch_k_dim(kn, d, es);
            const __m256 k0 = k_load8(k_store, kb, D, d, 0, kt), k1 = k_load8(k_store, kb, D, d, 8, kt);
            for (int i = 0; i < NQ; i++) {
                const __m256 qd = _mm256_set1_ps(qs[i][d]);
                a[i][0] = _mm256_fmadd_ps(qd, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qd, k1, a[i][1]);
            }
        }
        for (int i = 0; i < NQ; i++) {
            _mm256_storeu_ps(sc + i * stride + (j - j0) * 16, a[i][0]);
            _mm256_storeu_ps(sc + i * stride + (j - j0) * 16 + 8, a[i][1]);
        }
    }
    const int64_t base = first - j0 * 16, end = last - j0 * 16;
    for (int i = 0; i < NQ; i++) {
        float *p = sc + i * stride;
        const int64_t off = lo[i] - j0 * 16, n = hi[i] - lo[i];
        softmax_rows(1, p, stride, off, n, cap);
        zero_outside(p, base, off, n, end);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) { /* vectors 0-2, then 3-5: counts the compiler knows */
        rows_pv8(NQ < 3 ? NQ : 3, 0, kt, t0, nh, h0, kvh, D, d0, v_store, NB, row, first, last, sc, stride,
                 base, out, H);
        if (NQ > 3)
            rows_pv8(NQ > 3 ? NQ - 3 : 1, 3, kt, t0, nh, h0, kvh, D, d0, v_store, NB, row, first, last, sc,
                     stride, base, out, H);
    }
}

/* One copy of a several-row kernel per cache type and vector count (up to 6 or 12). */
#define ROWS_CASE(fn, n, kv)                                                                   \
    case n:                                                                                    \
        fn(n, kv, q, ldq, t0, nh, h0, kvh, D, k_store, v_store, NB, row, lo, hi, scale, cap,   \
           sc, stride, out, H);                                                                \
        break;
#define ROWS_UP_TO_6(fn, kv)                                                                   \
    ROWS_CASE(fn, 1, kv) ROWS_CASE(fn, 2, kv) ROWS_CASE(fn, 3, kv)                             \
    ROWS_CASE(fn, 4, kv) ROWS_CASE(fn, 5, kv) ROWS_CASE(fn, 6, kv)
#define ROWS_UP_TO_12(fn, kv)                                                                  \
    ROWS_UP_TO_6(fn, kv) ROWS_CASE(fn, 7, kv) ROWS_CASE(fn, 8, kv) ROWS_CASE(fn, 9, kv)        \
    ROWS_CASE(fn, 10, kv) ROWS_CASE(fn, 11, kv) ROWS_CASE(fn, 12, kv)
#define ROWS_TASK(counts, fn)                                                                  \
    switch (kt) {                                                                              \
        case PG_KV_F32: switch (nq) { counts(fn, PG_KV_F32) } break;                           \
        case PG_KV_F16: switch (nq) { counts(fn, PG_KV_F16) } break;                           \
        case PG_KV_BF16: switch (nq) { counts(fn, PG_KV_BF16) } break;                         \
        case PG_KV_Q8: switch (nq) { counts(fn, PG_KV_Q8) } break;                             \
    }

/* One several-row task on AVX2: nq = rows x nh query vectors, up to 6 (rows_heads). */
static void rows_task(int nq, int kt, const float *q, int64_t ldq, int64_t t0, int64_t nh,
                      int64_t h0, int64_t kvh, int64_t D, const void *k_store, const void *v_store,
                      int64_t NB, const int64_t *row, const int64_t *lo, const int64_t *hi,
                      float scale, float cap, float *sc, int64_t stride, float *out, int64_t H) {
    ROWS_TASK(ROWS_UP_TO_6, rows_heads)
}

/* Tasks [t0, t1) of decode_avx2_part: (request, KV head, run of up to 4 of its query
 * heads), each through heads_fn (decode_heads, or decode_heads512 twice as wide), one copy
 * per cache type and run length. */
#define DECODE_HEADS(heads_fn, n, kv)                                                          \
    case n:                                                                                    \
        heads_fn(n, kv, q, ldq, b, h0, kvh, D, k_store, v_store, NB, row, lo[b], hi[b], scale, \
                 cap, sc, stride, out, H, &nx);                                                \
        break;
#define DECODE_KV_TYPE(heads_fn, kv)                                                           \
    case kv:                                                                                   \
        switch (G) {                                                                           \
            DECODE_HEADS(heads_fn, 1, kv) DECODE_HEADS(heads_fn, 2, kv)                        \
            DECODE_HEADS(heads_fn, 3, kv) DECODE_HEADS(heads_fn, 4, kv)                        \
        }                                                                                      \
        break;
#define DECODE_TASKS(heads_fn)                                                                 \
    for (int64_t t = t0; t < t1; t++) {                                                        \
        const int64_t b = t / (KVH * runs), kvh = t / runs % KVH;                              \
        const int64_t h0 = kvh * group + t % runs * run;                                       \
        const int64_t left = kvh * group + group - h0;                                         \
        const int G = (int)(left < run ? left : run);                                          \
        const int64_t *row = table + b * table_stride;                                         \
        next_task nx = {0};                                                                    \
        if (t + 1 < t1) { /* a task on other data: fetch it while this one computes */        \
            const int64_t nb = (t + 1) / (KVH * runs), nkvh = (t + 1) / runs % KVH;            \
            if (nb != b || nkvh != kvh) {                                                      \
                nx.row = table + nb * table_stride;                                            \
                nx.kvh = nkvh;                                                                 \
                nx.j0 = lo[nb] / 16;                                                           \
                nx.n = (hi[nb] + 15) / 16 - nx.j0;                                             \
            }                                                                                  \
        }                                                                                      \
        switch (kt) {                                                                          \
            DECODE_KV_TYPE(heads_fn, PG_KV_F32)                                                \
            DECODE_KV_TYPE(heads_fn, PG_KV_F16)                                                \
            DECODE_KV_TYPE(heads_fn, PG_KV_BF16)                                               \
            DECODE_KV_TYPE(heads_fn, PG_KV_Q8)                                                 \
        }                                                                                      \
    }

#ifdef PG_X86_DISPATCH
#define ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

/* exp_neg sixteen lanes at a time (EXP_NEG_STEPS): the same values. */
ATTN512 static inline __attribute__((always_inline)) __m512 exp_neg16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 e;
    EXP_NEG_STEPS(_mm512, 512, ROUND16, x, e);
    return _mm512_maskz_mov_ps((__mmask16)~under, e);
}

/* softmax_rows with its exponentials sixteen lanes at a time: the sum still takes them
 * eight at a time in softmax_rows' order, so every value is softmax_rows' bit for bit. */
ATTN512 static inline __attribute__((always_inline)) void softmax_rows512(
    const int G, float *sc, int64_t stride, int64_t off, int64_t n, float cap) {
    if (cap > 0.0f) { /* the capped scores: lane by lane, so any width */
        softmax_rows(G, sc, stride, off, n, cap);
        return;
    }
    for (int g = 0; g < G; g++) {
        float *p = sc + g * stride + off;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(p + i));
        float best = _mm512_reduce_max_ps(vmax);
        for (; i < n; i++) best = p[i] > best ? p[i] : best;
        const __m512 vb = _mm512_set1_ps(best);
        __m256 vsum = _mm256_setzero_ps();
        i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(p + i), vb));
            _mm512_storeu_ps(p + i, e);
            vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
            vsum = _mm256_add_ps(vsum, _mm512_extractf32x8_ps(e, 1));
        }
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(best)));
            _mm256_storeu_ps(p + i, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float total = pg_hsum(vsum);
        for (; i < n; i++) {
            p[i] = expf(p[i] - best);
            total += p[i];
        }
        const float inv = 1.0f / total;
        for (i = 0; i < n; i++) p[i] *= inv;
    }
}

/* Elements [i, i + 16) of a cache of type kt as floats. */
ATTN512 static inline __attribute__((always_inline)) __m512 kv_load16(const void *base, int64_t i, const int kt) {
    if (kt == PG_KV_F32) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (kt == PG_KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* k_load8 sixteen slots wide: a whole block's slots at dim d. */
ATTN512 static inline __attribute__((always_inline)) __m512 k_load16(const void *k, int64_t kblk, int64_t D,
                                                                     int64_t d, const int kt) {
    return kv_load16(k, (kblk * D + d) * 16, kt);
}

/* v_load8 sixteen dims wide. */
ATTN512 static inline __attribute__((always_inline)) __m512 v_load16(const void *v, int64_t vrow, int64_t D,
                                                                     int64_t d, const int kt) {
    if (kt != PG_KV_Q8) return kv_load16(v, vrow * D + d, kt);
    const int8_t *r = q8_vrow(v, vrow, D);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + d)))),
                         _mm512_set1_ps(v_scale(v, vrow, D, d, kt)));
}

/* q8_scores8 for all 16 slots of the block with VNNI: K's bytes read as unsigned (k + 128,
 * vpdpbusd's operand) and 128 x the query's sum taken off, the same exact int32 sums; two
 * chains of sums per vector where the registers allow (integers: any order). */
ATTN512 static inline __attribute__((always_inline)) void q8_scores16(const int NQ, const int8_t *b, int64_t D,
                                                                      const q8_query *qv, __m512 *a) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int two = NQ <= 6;
    for (int i = 0; i < NQ; i++) a[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 32; c++) {
        const __m512 dk = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 16 * D + 32 * c)));
        for (int l = 0; l < 2; l++) {
            __m512i s[12], t[6];
            for (int i = 0; i < NQ; i++) s[i] = _mm512_setzero_si512();
            if (two)
                for (int i = 0; i < NQ; i++) t[i] = _mm512_setzero_si512();
            for (int64_t u = 8 * c; u < 8 * c + 8; u += 2) {
                const __m512i k0 = _mm512_xor_si512(_mm512_loadu_si512(b + 64 * u), flip);
                const __m512i k1 = _mm512_xor_si512(_mm512_loadu_si512(b + 64 * (u + 1)), flip);
                for (int i = 0; i < NQ; i++) {
                    s[i] = _mm512_dpbusd_epi32(s[i], k0, _mm512_set1_epi32(q8_four(&qv[i], l, u)));
                    if (two)
                        t[i] = _mm512_dpbusd_epi32(t[i], k1, _mm512_set1_epi32(q8_four(&qv[i], l, u + 1)));
                    else
                        s[i] = _mm512_dpbusd_epi32(s[i], k1, _mm512_set1_epi32(q8_four(&qv[i], l, u + 1)));
                }
            }
            for (int i = 0; i < NQ; i++) {
                const __m512i sum = _mm512_sub_epi32(two ? _mm512_add_epi32(s[i], t[i]) : s[i],
                                                     _mm512_set1_epi32(qv[i].off[l][c]));
                a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dk, _mm512_set1_ps(qv[i].d[l][c])), a[i]);
            }
        }
    }
}

/* decode_heads on AVX-512 (chosen at run time, pg_isa_level): a K block's 16 slots in one
 * vector, 32 dims of a V row in two. Each score is the same chain of fused multiply-adds
 * over d, each output the same chain over slots, and the softmax the same code, so the
 * numbers are decode_heads' bit for bit; half the instructions. */
ATTN512 static inline __attribute__((always_inline)) void decode_heads512(
    const int G, const int kt, const float *q, int64_t ldq, int64_t b, int64_t h0, int64_t kvh,
    int64_t D, const void *k_store, const void *v_store, int64_t NB, const int64_t *row,
    int64_t lo, int64_t hi, float scale, float cap, float *sc, int64_t stride, float *out,
    int64_t H, const next_task *nx) {
    const char *kc = (const char *)k_store, *vc = (const char *)v_store;
    const int64_t es = kv_elem_bytes(kt), rb = kv_row_bytes(kt, D), kbytes = 16 * rb;
    const int64_t j0 = lo / 16, j1 = (hi + 15) / 16;
    float qs[4][256];
    for (int g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) qs[g][d] = q[b * ldq + (h0 + g) * D + d] * scale;
    q8_query qv[4];
    if (kt == PG_KV_Q8)
        for (int g = 0; g < G; g++) q8_query_of(qs[g], D, &qv[g]);
    /* two K blocks at a time: twice the independent chains (each score's chain over d is
     * unchanged); the next blocks' keys and the next task's keys and values are fetched
     * while these compute */
    const int64_t line = 64 / es; /* elements per cache line */
    for (int64_t j = j0; j < j1; j += 2) {
        const int two = j + 1 < j1;
        const int64_t kb = kvh * NB + row[j]; /* the block, numbered as k_load8's */
        const int64_t kb1 = two ? kvh * NB + row[j + 1] : kb;
        const int64_t jn = j + 2 < j1 ? j + 2 : j, jn1 = j + 3 < j1 ? j + 3 : jn;
        const char *kn = kc + (kvh * NB + row[jn]) * kbytes;
        const char *kn1 = kc + (kvh * NB + row[jn1]) * kbytes;
        int64_t offs[8];
        next_lines walk = {offs, next_blocks(nx, j - j0, 2, j1 - j0, NB, kbytes, offs), 0,
                           kbytes / 64, 0};
        if (kt == PG_KV_Q8) {
            q8_prefetch(kc, vc, kn, kbytes, &walk);
            if (kn1 != kn) q8_prefetch(kc, vc, kn1, kbytes, &walk);
            __m512 a[4];
            q8_scores16(G, q8_kblock(k_store, kb, D), D, qv, a);
            for (int g = 0; g < G; g++) _mm512_storeu_ps(sc + g * stride + (j - j0) * 16, a[g]);
            if (two) {
                q8_scores16(G, q8_kblock(k_store, kb1, D), D, qv, a);
                for (int g = 0; g < G; g++) _mm512_storeu_ps(sc + g * stride + (j + 1 - j0) * 16, a[g]);
            }
            continue;
        }
        __m512 a[4], c[4];
        for (int g = 0; g < G; g++) a[g] = c[g] = _mm512_setzero_ps();
        const int64_t per = (walk.m * walk.lines + D - 1) / D;
        for (int64_t d = 0; d < D; d++) {
            for (int64_t u = 0; u < per; u++) prefetch_next_line(kc, vc, &walk);
            if ((d * 16) % line == 0) {
                (void)(kn + d * 16 * es);
                (void)(kn1 + d * 16 * es);
            }
            const __m512 k = k_load16(k_store, kb, D, d, kt);
            const __m512 k1 = k_load16(k_store, kb1, D, d, kt);
            for (int g = 0; g < G; g++) {
                const __m512 qd = _mm512_set1_ps(qs[g][d]);
                a[g] = _mm512_fmadd_ps(qd, k, a[g]);
                c[g] = _mm512_fmadd_ps(qd, k1, c[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm512_storeu_ps(sc + g * stride + (j - j0) * 16, a[g]);
            if (two) _mm512_storeu_ps(sc + g * stride + (j + 1 - j0) * 16, c[g]);
        }
    }
    const int64_t n = hi - lo, off = lo - j0 * 16;
    softmax_rows512(G, sc, stride, off, n, cap);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512 a[4][2];
        for (int g = 0; g < G; g++) a[g][0] = a[g][1] = _mm512_setzero_ps();
        for (int64_t i = lo; i < hi; i++) {
            const int64_t vr = (kvh * NB + row[i / 16]) * 16 + i % 16; /* the V row */
            if (d0 == 0 && i / 16 + 1 < j1) {
                const char *vn = vc + ((kvh * NB + row[i / 16 + 1]) * 16 + i % 16) * rb;
                for (int64_t c = 0; c < rb; c += 64) (void)vn;
            }
            const __m512 v0 = v_load16(v_store, vr, D, d0, kt), v1 = v_load16(v_store, vr, D, d0 + 16, kt);
            for (int g = 0; g < G; g++) {
                const __m512 pi = _mm512_set1_ps(sc[g * stride + off + (i - lo)]);
                a[g][0] = _mm512_fmadd_ps(pi, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pi, v1, a[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            float *o = out + (b * H + h0 + g) * D + d0;
            _mm512_storeu_ps(o, a[g][0]);
            _mm512_storeu_ps(o + 16, a[g][1]);
        }
    }
}

/* The tasks [t0, t1) of decode_avx2_part on decode_heads512. */
ATTN512 static void tasks512(int64_t t0, int64_t t1, int64_t KVH, int64_t runs, int64_t run,
                             int64_t group, const float *q, int64_t ldq, int64_t H, int64_t D,
                             int kt, const void *k_store, const void *v_store, int64_t NB,
                             const int64_t *table, int64_t table_stride, const int64_t *lo,
                             const int64_t *hi, float scale, float cap, float *out, float *sc,
                             int64_t stride) {
    DECODE_TASKS(decode_heads512);
}

/* rows_heads512's outputs, dims [d0, d0 + 32), of its NC query vectors from c0: each its
 * chain over the task's slots [first, last) of probability times the V row's scale times
 * its values, each V row loaded once for the NC vectors. */
ATTN512 static inline __attribute__((always_inline)) void rows_pv512(
    const int NC, const int c0, const int kt, int64_t t0, int64_t nh, int64_t h0, int64_t kvh,
    int64_t D, int64_t d0, const void *v_store, int64_t NB, const int64_t *row, int64_t first,
    int64_t last, int64_t j1, const float *sc, int64_t stride, int64_t base, float *out, int64_t H) {
    const char *vc = (const char *)v_store;
    const int64_t rb = kv_row_bytes(kt, D);
    __m512 acc[8][2];
    for (int c = 0; c < NC; c++) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    for (int64_t i = first; i < last; i++) {
        const int64_t vr = (kvh * NB + row[i / 16]) * 16 + i % 16; /* the V row */
        if (d0 == 0 && c0 == 0 && i / 16 + 1 < j1) {
            const char *vn = vc + ((kvh * NB + row[i / 16 + 1]) * 16 + i % 16) * rb;
            for (int64_t c = 0; c < rb; c += 64) _mm_prefetch(vn + c, _MM_HINT_T0);
        }
        const __m512 v0 = v_load16(v_store, vr, D, d0, kt), v1 = v_load16(v_store, vr, D, d0 + 16, kt);
        for (int c = 0; c < NC; c++) {
            const __m512 pi = _mm512_set1_ps(sc[(c0 + c) * stride + base + (i - first)]);
            acc[c][0] = _mm512_fmadd_ps(pi, v0, acc[c][0]);
            acc[c][1] = _mm512_fmadd_ps(pi, v1, acc[c][1]);
        }
    }
    for (int c = 0; c < NC; c++) {
        const int64_t t = t0 + (c0 + c) / nh, h = h0 + (c0 + c) % nh;
        float *o = out + (t * H + h) * D + d0;
        _mm512_storeu_ps(o, acc[c][0]);
        _mm512_storeu_ps(o + 16, acc[c][1]);
    }
}

/* Prompt rows, several at a time (pg_paged_prefill): NQ query vectors (rows t0 .. of one
 * chunk, heads h0 .. h0 + nh - 1 of each, vector i = row i / nh, head i % nh), all reading
 * KV head kvh through the chunk's block row; vector i sees slots [lo[i], hi[i]). Each K
 * block is loaded once for all NQ vectors and each V row once per 8 of them. Every score
 * is decode_heads512's chain over d, every softmax its code over the same slots, and every
 * output its chain over slots (slots outside a vector's range weigh +0, which leaves a
 * float32 sum as it is), so a prompt row gets the bits it would get decoded alone. */
ATTN512 static inline __attribute__((always_inline)) void rows_heads512(
    const int NQ, const int kt, const float *q, int64_t ldq, int64_t t0, int64_t nh, int64_t h0,
    int64_t kvh, int64_t D, const void *k_store, const void *v_store, int64_t NB,
    const int64_t *row, const int64_t *lo, const int64_t *hi, float scale, float cap, float *sc,
    int64_t stride, float *out, int64_t H) {
    const char *kc = (const char *)k_store;
    const int64_t es = kv_elem_bytes(kt), rb = kv_row_bytes(kt, D), kbytes = 16 * rb;
    int64_t first, last;
    float qs[12][256];
    rows_setup(NQ, q, ldq, t0, nh, h0, D, scale, lo, hi, qs, &first, &last);
    q8_query qv[12];
    if (kt == PG_KV_Q8)
        for (int i = 0; i < NQ; i++) q8_query_of(qs[i], D, &qv[i]);
    const int64_t j0 = first / 16, j1 = (last + 15) / 16;
    for (int64_t j = j0; j < j1; j++) {
        const int64_t kb = kvh * NB + row[j]; /* the block, numbered as k_load8's */
        const char *kn = kc + (kvh * NB + row[j + 1 < j1 ? j + 1 : j]) * kbytes;
        __m512 a[12];
        if (kt == PG_KV_Q8) {
            for (int64_t l = 0; l < kbytes; l += 64) _mm_prefetch(kn + l, _MM_HINT_T0);
            q8_scores16(NQ, q8_kblock(k_store, kb, D), D, qv, a);
        } else {
            for (int i = 0; i < NQ; i++) a[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                prefetch_k_dim(kn, d, es);
                const __m512 k = k_load16(k_store, kb, D, d, kt);
                for (int i = 0; i < NQ; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i][d]), k, a[i]);
            }
        }
        for (int i = 0; i < NQ; i++) _mm512_storeu_ps(sc + i * stride + (j - j0) * 16, a[i]);
    }
    const int64_t base = first - j0 * 16, end = last - j0 * 16;
    for (int i = 0; i < NQ; i++) {
        float *p = sc + i * stride;
        const int64_t off = lo[i] - j0 * 16, n = hi[i] - lo[i];
        softmax_rows512(1, p, stride, off, n, cap);
        zero_outside(p, base, off, n, end);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) { /* vectors 0-7, then 8-11: counts the compiler knows */
        rows_pv512(NQ < 8 ? NQ : 8, 0, kt, t0, nh, h0, kvh, D, d0, v_store, NB, row, first, last, j1, sc,
                   stride, base, out, H);
        if (NQ > 8)
            rows_pv512(NQ > 8 ? NQ - 8 : 1, 8, kt, t0, nh, h0, kvh, D, d0, v_store, NB, row, first, last, j1,
                       sc, stride, base, out, H);
    }
}

/* One task of pg_paged_prefill: nq = rows x nh query vectors (see rows_heads512). */
ATTN512 static void rows_task512(int nq, int kt, const float *q, int64_t ldq, int64_t t0,
                                 int64_t nh, int64_t h0, int64_t kvh, int64_t D,
                                 const void *k_store, const void *v_store, int64_t NB,
                                 const int64_t *row, const int64_t *lo, const int64_t *hi,
                                 float scale, float cap, float *sc, int64_t stride, float *out,
                                 int64_t H) {
    ROWS_TASK(ROWS_UP_TO_12, rows_heads512)
}


#endif


/* Query vectors a several-row task holds here: 12 on AVX-512 (rows_heads512), 6 on AVX2. */
static int64_t task_vectors(void) {
#ifdef PG_X86_DISPATCH
    if (attn512()) return PREFILL_VECTORS;
#endif
    return 6;
}

/* Heads a several-row task takes of a KV head's group, and its rows. */
static void row_task_shape(int64_t group, int64_t *runs, int64_t *nh, int64_t *R) {
    const int64_t vectors = task_vectors();
    *runs = (group + vectors - 1) / vectors;
    *nh = (group + *runs - 1) / *runs; /* the last run may hold fewer */
    *R = vectors / *nh;
}

/* One several-row task on the widest kernel here. */
static void any_rows_task(int nq, int kt, const float *q, int64_t ldq, int64_t t0, int64_t nh,
                          int64_t h0, int64_t kvh, int64_t D, const void *k_store,
                          const void *v_store, int64_t NB, const int64_t *row, const int64_t *lo,
                          const int64_t *hi, float scale, float cap, float *sc, int64_t stride,
                          float *out, int64_t H) {
#ifdef PG_X86_DISPATCH
    if (attn512()) {
        rows_task512(nq, kt, q, ldq, t0, nh, h0, kvh, D, k_store, v_store, NB, row, lo, hi, scale,
                     cap, sc, stride, out, H);
        return;
    }
#endif
    rows_task(nq, kt, q, ldq, t0, nh, h0, kvh, D, k_store, v_store, NB, row, lo, hi, scale, cap,
              sc, stride, out, H);
}

/* Whether row b of a decode batch reads what row b - 1 reads and the next slot: the next
 * row of one prompt chunk or one verify run (RowAttention), which a task can attend
 * together with it. */
static int continues_row(const int64_t *table, int64_t ts, const int64_t *lo, const int64_t *hi,
                         int64_t b) {
    if (lo[b] != lo[b - 1] || hi[b] != hi[b - 1] + 1) return 0;
    const int64_t j0 = lo[b] / 16, j1 = (hi[b] + 15) / 16;
    return memcmp(table + b * ts + j0, table + (b - 1) * ts + j0, (size_t)(j1 - j0) * sizeof(int64_t)) == 0;
}

/* decode_avx2_part's rows where some continue the row before: runs of up to R such rows
 * per task (rows_heads512 / rows_heads, the same numbers as a row alone), the team's share
 * cut by the slots read. Returns 0 where no row continues another (plain decodes). */
static int row_runs(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH,
                               int64_t D, int kt, const void *k_store, const void *v_store,
                               int64_t NB, const int64_t *table, int64_t ts, const int64_t *lo,
                               const int64_t *hi, float scale, float cap, float *out, float *sc,
                               int64_t stride, int parallel, const pg_team *team) {
    int any = 0;
    for (int64_t b = 1; b < B && !any; b++) any = continues_row(table, ts, lo, hi, b);
    if (!any) return 0;
    const int64_t group = H / KVH;
    int64_t runs, nh, R;
    row_task_shape(group, &runs, &nh, &R);
    /* tasks in row order: (run of rows, KV head, head run), weighed by the slots read */
    int64_t total = 0;
    for (int64_t s = 0, e; s < B; s = e) {
        for (e = s + 1; e < B && e - s < R && continues_row(table, ts, lo, hi, e); e++) {}
        total += (hi[e - 1] - lo[s] + 16) * KVH * runs;
    }
    int64_t from = 0, to = total;
    if (pg_team_splits(parallel, team)) {
        from = total * team->ith / team->nth;
        to = total * (team->ith + 1) / team->nth;
    } else if (team->ith != 0) {
        return 1;
    }
    int64_t seen = 0;
    for (int64_t s = 0, e; s < B && seen < to; s = e) {
        for (e = s + 1; e < B && e - s < R && continues_row(table, ts, lo, hi, e); e++) {}
        const int64_t w = hi[e - 1] - lo[s] + 16;
        for (int64_t kvh = 0; kvh < KVH; kvh++)
            for (int64_t run = 0; run < runs; run++, seen += w) {
                if (seen < from || seen >= to) continue;
                const int64_t h0 = kvh * group + run * nh;
                const int64_t heads = h0 + nh <= (kvh + 1) * group ? nh : (kvh + 1) * group - h0;
                int64_t vlo[PREFILL_VECTORS], vhi[PREFILL_VECTORS];
                for (int64_t v = 0; v < (e - s) * heads; v++) {
                    vlo[v] = lo[s + v / heads];
                    vhi[v] = hi[s + v / heads];
                }
                any_rows_task((int)((e - s) * heads), kt, q, ldq, s, heads, h0, kvh, D, k_store,
                              v_store, NB, table + s * ts, vlo, vhi, scale, cap, sc, stride, out, H);
            }
    }
    return 1;
}

/* Tasks: (request, KV head, run of up to 4 of its query heads); sc: 4 * (max_slots + 32)
 * floats. */
static void decode_avx2_part(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH,
                             int64_t D, int kt, const void *k_store, const void *v_store, int64_t NB,
                             const int64_t *table, int64_t table_stride, const int64_t *lo,
                             const int64_t *hi, int64_t max_slots, float scale, float cap,
                             float *out, float *sc, const pg_team *team) {
    const int64_t group = H / KVH;
    /* runs of up to 4 heads share their K/V loads; single heads when that would leave
     * too few tasks for the threads (one long request) */
    int64_t run = group < 4 ? group : 4;
    if (B * KVH * ((group + run - 1) / run) < 8) run = 1;
    const int64_t runs = (group + run - 1) / run;
    const int64_t stride = max_slots + 32; /* whole blocks on both ends */
    int64_t t0, t1;
    if (row_runs(q, ldq, B, H, KVH, D, kt, k_store, v_store, NB, table, table_stride, lo, hi,
                 scale, cap, out, sc, stride, B * H * max_slots * D >= 32768, team))
        return;
    share_by_slots(B * H * max_slots * D >= 32768, B, KVH * runs, lo, hi, team, &t0, &t1);
#ifdef PG_X86_DISPATCH
    if (attn512()) {
        tasks512(t0, t1, KVH, runs, run, group, q, ldq, H, D, kt, k_store, v_store, NB, table,
                 table_stride, lo, hi, scale, cap, out, sc, stride);
        return;
    }
#endif
    DECODE_TASKS(decode_heads);
}
#endif

/* Tasks: (request, query head); scores: max_slots floats. Inlined into one copy per
 * element type kt. */
static inline __attribute__((always_inline)) void decode_portable_part(const float *q, int64_t ldq, int64_t B, int64_t H,
                                 int64_t KVH, int64_t D, int kt, const void *k_store,
                                 const void *v_store, int64_t NB, int64_t bs,
                                 const int64_t *table, int64_t table_stride, const int64_t *lo,
                                 const int64_t *hi, int64_t max_slots, float scale, float cap,
                                 float *out, float *scores, const pg_team *team) {
    int64_t group = H / KVH, t0, t1;
    share_by_slots(B * H * max_slots * D >= 32768, B, H, lo, hi, team, &t0, &t1);
    for (int64_t task = t0; task < t1; task++) {
        int64_t b = task / H, h = task % H, kvh = h / group;
        const float *qh = q + b * ldq + h * D;
        const int64_t *row = table + b * table_stride;
        float *o = out + (b * H + h) * D;
        int64_t first = lo[b], last = hi[b];
        float best = -INFINITY;
        for (int64_t i = first; i < last;) {
            int64_t blk = row[i / bs], s0 = i % bs;
            int64_t s1 = (last - (i - s0) < bs) ? last - (i - s0) : bs;
            const int64_t kb = ((kvh * NB + blk) * D) * bs;
            float *sc = scores + (i - first) - s0;
            for (int64_t s = s0; s < s1; s++) sc[s] = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                float qd = qh[d] * scale;
                const int64_t kd = kb + d * bs;
                for (int64_t s = s0; s < s1; s++) sc[s] += qd * kv_get(k_store, kd + s, kt);
            }
            for (int64_t s = s0; s < s1; s++) best = sc[s] > best ? sc[s] : best;
            i += s1 - s0;
        }
        int64_t n = last - first;
        if (cap > 0.0f) { /* the capped scores, and their maximum again */
            best = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                scores[j] = cap * tanhf(scores[j] / cap);
                best = scores[j] > best ? scores[j] : best;
            }
        }
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            scores[j] = expf(scores[j] - best);
            total += scores[j];
        }
        float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t i = first; i < last; i++) {
            int64_t blk = row[i / bs], s = i % bs;
            const int64_t vr = ((kvh * NB + blk) * bs + s) * D;
            float p = scores[i - first] * inv;
            for (int64_t d = 0; d < D; d++) o[d] += p * kv_get(v_store, vr + d, kt);
        }
    }
}

/* Floats of scratch one thread of pg_paged_decode_part needs: a score row for each query
 * vector of a task. */
int64_t pg_paged_decode_scratch(int64_t max_slots) { return PREFILL_VECTORS * (max_slots + 32); }

void pg_paged_decode_part(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int kv_type, const void *k_store, const void *v_store,
                          int64_t NB, int64_t bs, const int64_t *table, int64_t table_stride,
                          const int64_t *lo, const int64_t *hi, int64_t max_slots, float scale,
                          float cap, float *out, float *scratch, const pg_team *team) {
#ifdef PG_AVX2
    if (bs == 16 && D % 32 == 0 && D <= 256) {
        decode_avx2_part(q, ldq, B, H, KVH, D, kv_type, k_store, v_store, NB, table,
                         table_stride, lo, hi, max_slots, scale, cap, out, scratch, team);
        return;
    }
#endif
    switch (kv_type) { /* one copy of the loops per element type */
    case PG_KV_F16:
        decode_portable_part(q, ldq, B, H, KVH, D, PG_KV_F16, k_store, v_store, NB, bs, table,
                             table_stride, lo, hi, max_slots, scale, cap, out, scratch, team);
        break;
    case PG_KV_BF16:
        decode_portable_part(q, ldq, B, H, KVH, D, PG_KV_BF16, k_store, v_store, NB, bs, table,
                             table_stride, lo, hi, max_slots, scale, cap, out, scratch, team);
        break;
    default:
        decode_portable_part(q, ldq, B, H, KVH, D, PG_KV_F32, k_store, v_store, NB, bs, table,
                             table_stride, lo, hi, max_slots, scale, cap, out, scratch, team);
    }
}

int pg_paged_prefill_ready(int64_t D);

/* Whether pg_paged_decode_part reads a cache of type kv_type for heads of D dims in blocks
 * of bs: every float type anywhere; q8_0 on the AVX2 path only (bs 16, D a multiple of 32
 * up to 256), the same condition as pg_paged_prefill_ready. */
int pg_paged_decode_ready(int kv_type, int64_t D, int64_t bs) {
    return kv_type != PG_KV_Q8 || (bs == 16 && pg_paged_prefill_ready(D));
}

int pg_paged_decode(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH, int64_t D,
                    int kv_type, const void *k_store, const void *v_store, int64_t NB,
                    int64_t bs, const int64_t *table, int64_t table_stride, const int64_t *lo,
                    const int64_t *hi, int64_t max_slots, float scale, float cap, float *out) {
    if (!pg_paged_decode_ready(kv_type, D, bs)) return -2;
    atomic_int failed = 0;
    PG_TEAM_RUN(B * H * max_slots * D >= 32768, {
        float *scratch = malloc((size_t)pg_paged_decode_scratch(max_slots) * sizeof(float));
        if (scratch == NULL) {
            atomic_store(&failed, 1);
        } else {
            pg_paged_decode_part(q, ldq, B, H, KVH, D, kv_type, k_store, v_store, NB, bs, table,
                                 table_stride, lo, hi, max_slots, scale, cap, out, scratch, &team);
            free(scratch);
        }
    });
    return failed ? -1 : 0;
}

/* Key and value rows of T tokens ([T, KVH, D], rows ldk / ldv elements apart, heads D
 * apart) into their cache slots (slot = block * bs + offset), rounded to the cache's type. */
static inline __attribute__((always_inline)) void write_kv_rows(
    const int kt, const float *key, int64_t ldk, const float *value, int64_t ldv, int64_t t0,
    int64_t t1, int64_t KVH, int64_t D, void *k_store, void *v_store, int64_t NB, int64_t bs,
    const int64_t *slots) {
    for (int64_t t = t0; t < t1; t++) {
        int64_t blk = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < KVH; h++) {
            const float *kr = key + t * ldk + h * D, *vr = value + t * ldv + h * D;
            const int64_t kb = ((h * NB + blk) * D) * bs + off, vb = ((h * NB + blk) * bs + off) * D;
            for (int64_t d = 0; d < D; d++) {
                kv_put(k_store, kb + d * bs, kr[d], kt);
                kv_put(v_store, vb + d, vr[d], kt);
            }
        }
    }
}

/* The float16 scale of 32 values x, and x / scale rounded to int8 in q (llama.cpp's q8_0,
 * as its AVX2 quantizer does it: scale = max |x| / 127, x times 127 / max |x| rounded to
 * nearest even; a block of zeros has scale 0). The AVX2 and plain loops give the same
 * bytes for finite x (a NaN or infinity, which no finite model output holds, may not). */
static inline uint16_t q8_block(const float *x, int8_t *q) {
#ifdef PG_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    __m256i n[4];
    for (int i = 0; i < 4; i++)
        n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* the packs interleave 128-bit lanes; the permute puts the 32 bytes back in order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) q[i] = (int8_t)nearbyintf(x[i] * id);
#endif
    return f32_to_f16(d);
}

/* write_kv_rows for a q8_0 cache (the layout in the header). */
static void write_kv_rows_q8(const float *key, int64_t ldk, const float *value, int64_t ldv,
                             int64_t t0, int64_t t1, int64_t KVH, int64_t D, void *k_store,
                             void *v_store, int64_t NB, int64_t bs, const int64_t *slots) {
    const int64_t rb = kv_row_bytes(PG_KV_Q8, D);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t blk = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < KVH; h++) {
            const float *kr = key + t * ldk + h * D, *vr = value + t * ldv + h * D;
            uint8_t *kb = (uint8_t *)k_store + (h * NB + blk) * bs * rb;
            uint8_t *vrow = (uint8_t *)v_store + ((h * NB + blk) * bs + off) * rb;
            for (int64_t c = 0; c < D / 32; c++) {
                int8_t q[32];
                const uint16_t ks = q8_block(kr + 32 * c, q);
                for (int u = 0; u < 8; u++) memcpy(kb + ((8 * c + u) * bs + off) * 4, q + 4 * u, 4);
                memcpy(kb + D * bs + c * 2 * bs + 2 * off, &ks, 2);
                const uint16_t vs = q8_block(vr + 32 * c, (int8_t *)vrow + 32 * c);
                memcpy(vrow + D + 2 * c, &vs, 2);
            }
        }
    }
}

void pg_write_kv_part(const float *key, int64_t ldk, const float *value, int64_t ldv,
                      int64_t T, int64_t KVH, int64_t D, int kv_type, void *k_store,
                      void *v_store, int64_t NB, int64_t bs, const int64_t *slots,
                      const pg_team *team) {
    int64_t t0, t1;
    pg_share_if(T * KVH * D >= 65536, T, team, &t0, &t1);
    if (kv_type == PG_KV_Q8)
        write_kv_rows_q8(key, ldk, value, ldv, t0, t1, KVH, D, k_store, v_store, NB, bs, slots);
    else if (kv_type == PG_KV_F16)
        write_kv_rows(PG_KV_F16, key, ldk, value, ldv, t0, t1, KVH, D, k_store, v_store, NB, bs, slots);
    else if (kv_type == PG_KV_BF16)
        write_kv_rows(PG_KV_BF16, key, ldk, value, ldv, t0, t1, KVH, D, k_store, v_store, NB, bs, slots);
    else
        write_kv_rows(PG_KV_F32, key, ldk, value, ldv, t0, t1, KVH, D, k_store, v_store, NB, bs, slots);
}

void pg_write_kv(const float *key, int64_t ldk, const float *value, int64_t ldv, int64_t T,
                 int64_t KVH, int64_t D, int kv_type, void *k_store, void *v_store, int64_t NB,
                 int64_t bs, const int64_t *slots) {
    if (kv_type == PG_KV_Q8 && D % 32 != 0) return; /* refused by the caller (q8_0 blocks) */
    PG_TEAM_RUN(T * KVH * D >= 65536, pg_write_kv_part(key, ldk, value, ldv, T, KVH, D, kv_type,
                                                       k_store, v_store, NB, bs, slots, &team));
}

/* Whether pg_paged_prefill runs here for heads of D dims (block size 16): the AVX2 build,
 * twice as wide where the CPU has AVX-512. */
int pg_paged_prefill_ready(int64_t D) {
#ifdef PG_AVX2
    return D % 32 == 0 && D <= 256;
#else
    (void)D;
    return 0;
#endif
}

/* Prompt chunks' attention over the paged cache, several rows of a chunk per task sharing
 * each K and V load (the chunks' K/V already written). Chunk c holds rows [row0[c],
 * row1[c]) of q / out ([T, H, D] float32, q rows ldq apart); its row r sees the slots
 * [lo, first_hi[c] + r) of its block row table[c * table_stride ...], lo = 0, or with a
 * window W the last W of them. Each row's numbers are those pg_paged_decode gives it alone.
 * Block size 16. Returns 0; -1 where pg_paged_prefill_ready(D) is false or memory ran out. */
int pg_paged_prefill(const float *q, int64_t ldq, int64_t C, const int64_t *row0,
                     const int64_t *row1, const int64_t *first_hi, int64_t H, int64_t KVH,
                     int64_t D, int kv_type, const void *k_store, const void *v_store, int64_t NB,
                     const int64_t *table, int64_t table_stride, int64_t window, float scale,
                     float cap, float *out) {
#ifdef PG_AVX2
    if (!pg_paged_prefill_ready(D) || C <= 0) return -1;
    const int64_t group = H / KVH;
    int64_t runs, nh, R; /* head runs a KV head, heads and rows a task */
    row_task_shape(group, &runs, &nh, &R);
    /* tasks (chunk, row block, KV head, head run), weighed by the slots they read */
    int64_t ntasks = 0, max_slots = 0;
    for (int64_t c = 0; c < C; c++) {
        ntasks += (row1[c] - row0[c] + R - 1) / R * KVH * runs;
        const int64_t span = first_hi[c] + row1[c] - row0[c] - 1;
        max_slots = span > max_slots ? span : max_slots;
    }
    int64_t *task = malloc((size_t)(ntasks > 0 ? ntasks : 1) * 4 * sizeof(int64_t));
    int64_t *cum = malloc((size_t)(ntasks + 1) * sizeof(int64_t));
    if (task == NULL || cum == NULL) {
        free(task);
        free(cum);
        return -1;
    }
    int64_t n = 0;
    cum[0] = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t r = row0[c]; r < row1[c]; r += R)
            for (int64_t kvh = 0; kvh < KVH; kvh++)
                for (int64_t run = 0; run < runs; run++) {
                    int64_t *tk = task + 4 * n;
                    tk[0] = c, tk[1] = r, tk[2] = kvh, tk[3] = run;
                    const int64_t last = r + R < row1[c] ? r + R : row1[c];
                    int64_t w = first_hi[c] + (last - 1 - row0[c]);
                    if (window > 0 && w > window) w = window + (last - r);
                    cum[n + 1] = cum[n] + w + 16;
                    n++;
                }
    const int64_t stride = max_slots + 32; /* whole blocks on both ends */
    atomic_int failed = 0;
    PG_TEAM_RUN(cum[ntasks] * D * group >= 32768, {
        int64_t a = 0, b = ntasks;
        if (team.nth > 1) { /* the tasks whose weight starts in this thread's share */
            const int64_t from = cum[ntasks] * team.ith / team.nth;
            const int64_t to = cum[ntasks] * (team.ith + 1) / team.nth;
            while (a < ntasks && cum[a] < from) a++;
            b = a;
            while (b < ntasks && cum[b] < to) b++;
        }
        float *sc = a < b ? malloc((size_t)PREFILL_VECTORS * stride * sizeof(float)) : NULL;
        if (a < b && sc == NULL) atomic_store(&failed, 1);
        for (int64_t i = a; i < b && sc != NULL; i++) {
            const int64_t *tk = task + 4 * i;
            const int64_t c = tk[0], r = tk[1], kvh = tk[2], run = tk[3];
            const int64_t rows = r + R < row1[c] ? R : row1[c] - r;
            const int64_t h0 = kvh * group + run * nh;
            const int64_t heads = h0 + nh <= (kvh + 1) * group ? nh : (kvh + 1) * group - h0;
            int64_t lo[PREFILL_VECTORS], hi[PREFILL_VECTORS];
            for (int64_t v = 0; v < rows * heads; v++) {
                hi[v] = first_hi[c] + (r + v / heads - row0[c]);
                lo[v] = window > 0 && hi[v] > window ? hi[v] - window : 0;
            }
            any_rows_task((int)(rows * heads), kv_type, q, ldq, r, heads, h0, kvh, D, k_store,
                          v_store, NB, table + c * table_stride, lo, hi, scale, cap, sc, stride,
                          out, H);
        }
        free(sc);
    });
    free(task);
    free(cum);
    return failed ? -1 : 0;
#else
    (void)q, (void)ldq, (void)C, (void)row0, (void)row1, (void)first_hi, (void)H, (void)KVH, (void)D,
        (void)kv_type, (void)k_store, (void)v_store, (void)NB, (void)table, (void)table_stride,
        (void)window, (void)scale, (void)cap, (void)out;
    return -1;
#endif
}
