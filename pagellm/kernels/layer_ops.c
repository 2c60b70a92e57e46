/* The small per-layer ops of a decoder step, each fused into one pass over its rows, in
 * float32: residual add + RMSNorm, per-head RMSNorm of q and k, rotary embedding of q and
 * k in place, SiLU-and-mul and GELU(tanh)-and-mul.
 * Their torch compositions live beside their callers (layers/layernorm.py,
 * rotary_embedding.py, activation.py) and are what tests compare these against.
 *
 * Plain C that -O3 vectorises with whatever the build allows (AVX2 with the SIMD flags,
 * SSE2 without), and GCC/clang vector types (vec8.h) for the exponential: no intrinsics,
 * no libm calls in inner loops. Rows are
 * `ld*` floats apart, elements of a row contiguous. Rows are split across threads only
 * when there are enough of them to pay for waking a team. Each op is also a part
 * (team.h) that decode_step.c runs inside its one region.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "team.h"
#include "vec8.h"

#define PG_ROWS_PARALLEL_MIN 65536 /* elements below which one thread does all rows */

/* Sum of squares of n floats, in 8 interleaved partial sums (vectorisable without
 * reassociating, which -O3 alone may not do), added pairwise at the end. */
static inline float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += x[i] * x[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* For each of T rows of width N: when `res` is given, x += res (in place: x becomes the
 * new residual stream); then out = x * rsqrt(mean(x^2) + eps) * w. The same products as
 * Hugging Face's LlamaRMSNorm in float32; only the order of the squares' sum differs. */
void pg_add_rms_norm_part(float *x, int64_t ldx, const float *res, int64_t ldr,
                          const float *w, int64_t T, int64_t N, float eps, float *out,
                          int64_t ldo, const pg_team *team) {
    int64_t t0, t1;
    pg_share_if(T * N >= PG_ROWS_PARALLEL_MIN, T, team, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        float *xr = x + t * ldx, *o = out + t * ldo;
        if (res != NULL) {
            const float *r = res + t * ldr;
            for (int64_t i = 0; i < N; i++) xr[i] += r[i];
        }
        float inv = 1.0f / sqrtf(sum_squares(xr, N) / (float)N + eps);
        for (int64_t i = 0; i < N; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

void pg_add_rms_norm(float *x, int64_t ldx, const float *res, int64_t ldr, const float *w,
                     int64_t T, int64_t N, float eps, float *out, int64_t ldo) {
    PG_TEAM_RUN(T * N >= PG_ROWS_PARALLEL_MIN,
                pg_add_rms_norm_part(x, ldx, res, ldr, w, T, N, eps, out, ldo, &team));
}

/* Per-head RMSNorm of q and k in place (Qwen3, Gemma 3): row t holds nq q heads then nk
 * k heads, D values each, from x + t * ldx; q heads are scaled by wq, k heads by wk. Each
 * head is pg_add_rms_norm's row: the same sums and products. */
void pg_head_rms_norm_part(float *x, int64_t ldx, int64_t T, int64_t nq, int64_t nk, int64_t D,
                           const float *wq, const float *wk, float eps, const pg_team *team) {
    int64_t t0, t1;
    pg_share_if(T * (nq + nk) * D >= PG_ROWS_PARALLEL_MIN, T, team, &t0, &t1);
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = 0; h < nq + nk; h++) {
            float *xr = x + t * ldx + h * D;
            const float *w = h < nq ? wq : wk;
            float inv = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
            for (int64_t i = 0; i < D; i++) xr[i] = (xr[i] * inv) * w[i];
        }
}

void pg_head_rms_norm(float *x, int64_t ldx, int64_t T, int64_t nq, int64_t nk, int64_t D,
                      const float *wq, const float *wk, float eps) {
    PG_TEAM_RUN(T * (nq + nk) * D >= PG_ROWS_PARALLEL_MIN,
                pg_head_rms_norm_part(x, ldx, T, nq, nk, D, wq, wk, eps, &team));
}

/* Rotary embedding ("rotate half", NeoX/Hugging Face layout) of `heads` heads of D values
 * per row, in place. Row t holds its heads D apart from x + t * ldx (q heads then k heads
 * of a fused qkv output) and sits at position pos[t]; cos/sin are the tables of
 * RotaryEmbedding ([max_pos, D]: cos repeated for both halves, sin negated in the first):
 *     x[i]       <- x[i] * cos[i]             + x[i + D/2] * sin[i]
 *     x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
 * which is x * cos + roll(x, D/2) * sin, product for product. */
void pg_rope_part(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t D,
                  const int64_t *pos, const float *cos_table, const float *sin_table,
                  const pg_team *team) {
    int64_t half = D / 2, t0, t1;
    pg_share_if(T * heads * D >= PG_ROWS_PARALLEL_MIN, T, team, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos_table + pos[t] * D, *s = sin_table + pos[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ldx + h * D, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                float lo = a[i], hi = b[i];
                a[i] = lo * c[i] + hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

void pg_rope(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t D, const int64_t *pos,
             const float *cos_table, const float *sin_table) {
    PG_TEAM_RUN(T * heads * D >= PG_ROWS_PARALLEL_MIN,
                pg_rope_part(x, ldx, T, heads, D, pos, cos_table, sin_table, &team));
}

/* The gates (vec8.h's PG_SILU, PG_GELU_TANH). */
static inline v8f silu8(v8f g) { return PG_SILU(g, v8_exp); }

static inline v8f gelu_tanh8(v8f g) { return PG_GELU_TANH(g, v8_exp); }

/* o[i] = act(g[i]) * u[i] for i < n, eight at a time; the tail is padded into a vector
 * (memcpy of a constant 32 bytes compiles to one unaligned load or store). Each lane's
 * arithmetic is its own: amx_gemm.c's gated product takes the same steps sixteen lanes
 * at a time. */
static void act_mul_row(const float *g, const float *u, float *o, int64_t n, int gelu) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        v8f ov = (gelu ? gelu_tanh8(gv) : silu8(gv)) * uv;
        memcpy(o + i, &ov, sizeof ov);
    }
    if (i < n) {
        v8f gv = {0}, uv = {0};
        memcpy(&gv, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(&uv, u + i, (size_t)(n - i) * sizeof(float));
        v8f ov = (gelu ? gelu_tanh8(gv) : silu8(gv)) * uv;
        memcpy(o + i, &ov, (size_t)(n - i) * sizeof(float));
    }
}

/* out[t, i] = act(x[t, i]) * x[t, I + i] for i < I: the gate and up halves of a fused
 * gate_up output; act 0 is silu(g) = g / (1 + e^-g), 1 GELU's tanh form (Gemma). */
void pg_act_and_mul_part(const float *x, int64_t ldx, int64_t T, int64_t I, int act,
                         float *out, int64_t ldo, const pg_team *team) {
    int64_t t0, t1;
    pg_share_if(T * I >= PG_ROWS_PARALLEL_MIN, T, team, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) act_mul_row(x + t * ldx, x + t * ldx + I, out + t * ldo, I, act);
}

void pg_silu_and_mul(const float *x, int64_t ldx, int64_t T, int64_t I, float *out,
                     int64_t ldo) {
    PG_TEAM_RUN(T * I >= PG_ROWS_PARALLEL_MIN,
                pg_act_and_mul_part(x, ldx, T, I, 0, out, ldo, &team));
}

void pg_gelu_tanh_and_mul(const float *x, int64_t ldx, int64_t T, int64_t I, float *out,
                          int64_t ldo) {
    PG_TEAM_RUN(T * I >= PG_ROWS_PARALLEL_MIN,
                pg_act_and_mul_part(x, ldx, T, I, 1, out, ldo, &team));
}

/* Mixture-of-experts routing of T rows of E router logits: the softmax of each row (in
 * float32: the max taken out, e^x, the sum, a division), then its k largest
 * probabilities (k <= E; equal ones in expert order), renormalised to sum to 1 when
 * `renorm` (Qwen3-MoE's norm_topk_prob). Writes ids [T, k] (int64, the largest first)
 * and weights [T, k]. The module path and the one-region stack both route here, so a
 * token picks the same experts on either. */
void pg_moe_route_part(const float *logits, int64_t T, int64_t E, int64_t k, int renorm,
                       float *probs, int64_t *ids, float *weights, const pg_team *team) {
    int64_t t0, t1;
    pg_share_if(T * E >= PG_ROWS_PARALLEL_MIN, T, team, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *x = logits + t * E;
        float *p = probs + t * E, m = x[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) m = x[e] > m ? x[e] : m;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(x[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        int64_t *id = ids + t * k;
        float *w = weights + t * k, total = 0.0f;
        for (int64_t j = 0; j < k; j++) { /* k is small (2-8): selection by scans */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            w[j] = p[best];
            total += p[best];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++) w[j] /= total;
    }
}

void pg_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int renorm, float *probs,
                  int64_t *ids, float *weights) {
    PG_TEAM_RUN(T * E >= PG_ROWS_PARALLEL_MIN,
                pg_moe_route_part(logits, T, E, k, renorm, probs, ids, weights, &team));
}
