/* A decoder stack (Llama's layer, with Qwen3's and Gemma's extras) for a batch of
 * single-token decodes in one call: for each layer the same kernels, in the same order,
 * as the module path runs them one Python call at a time (models/fused_decode.py builds
 * the descriptions and says when it applies):
 *
 *   res = res + x (layer 0: res = x)      normed = rms_norm(res) * w1     pg_add_rms_norm
 *   qkv = normed @ Wqkv.T (+ b)            per group: pg_gemm (up to direct_rows rows) or
 *                                          pg_gemm_batched, or pg_gemm_f32_blocked; the
 *                                          step's n_q8 decode rows through pg_gemm_q8
 *                                          (x rounded to int8 once per linear)
 *   [q, k heads rms-normed in place]                                      pg_head_rms_norm
 *   [rotate q|k heads of qkv in place (the layer's rope tables)]          pg_rope
 *   k, v heads -> this layer's paged cache                                pg_write_kv
 *   attn = decode attention of the q heads over the cache (the layer's    pg_paged_decode
 *          view: its window's slots, and its scale)
 *   x = attn @ Wo.T (+ b)                 [x = rms_norm(x) * w_post_attn, in place]
 *   res = res + x                         normed = rms_norm(res) * w2
 *   gu = normed @ Wgate_up.T (+ b)        act = silu(gate) * up           pg_act_and_mul
 *                                         (or gelu_tanh(gate) * up)
 *   x = act @ Wdown.T (+ b)               [x = rms_norm(x) * w_post_ffn, in place]
 *
 * A layer with experts (Qwen3-MoE) replaces the last three lines by its router and the
 * experts it picks (moe_ffn): logits = normed @ Wrouter.T, each row's top k experts
 * (pg_moe_route), then every expert any row picked, in expert order, over its rows:
 * gate|up, silu-and-mul, down, each output row added to x weighted by its probability.
 *
 * On return x holds the last layer's MLP output and res the residual stream, as the
 * module path leaves them for the final norm.
 *
 * The whole stack is one OpenMP parallel region: each kernel runs as its part (team.h)
 * and the team meets at pg_team_sync between kernels, so a step wakes the sleeping
 * threads once instead of once per kernel. Each thread's share of a kernel is the share
 * that kernel's own region would give it, so the numbers are the same.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

int pg_type_supported(int type);
int pg_q8_supported(int type);
void pg_quantize_q8_part(const float *X, int64_t ldx, const int64_t *rows, int64_t M,
                         int64_t K, int64_t levels, int8_t *QX, float *DX, int32_t *SX,
                         const pg_team *team);
void pg_gemm_q8_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                     const int8_t *QX, const float *DX, const int32_t *SX, int64_t M,
                     int64_t levels, float *Y, int64_t ldy, const int64_t *yrows,
                     const pg_team *team);
int64_t pg_q8_chunks(int64_t N, int64_t row_bytes);
void pg_gemm_q8_chunk(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const int8_t *QX, const float *DX, const int32_t *SX, int64_t M,
                      int64_t levels, float *Y, int64_t ldy, const int64_t *yrows, int64_t c);
int pg_f32_blocked_supported(int64_t nb, int64_t kp, int64_t K);
int64_t pg_gemm_scratch(int64_t K);
void pg_gemm_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                  const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy, float *wrow,
                  const pg_team *team);
void pg_gemm_f32_blocked_part(const float *Wp, int64_t nb, int64_t kp, int64_t N, int64_t K,
                              const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy,
                              const pg_team *team);
int64_t pg_gemm_batched_xp(int64_t K, int64_t M);
int64_t pg_gemm_batched_wbuf(int64_t K);
void pg_gemm_batched_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                          const float *X, int64_t ldx, int64_t M, float *Y, int64_t ldy,
                          float *xp, float *wbuf, const pg_team *team);
void pg_add_rms_norm_part(float *x, int64_t ldx, const float *res, int64_t ldr,
                          const float *w, int64_t T, int64_t N, float eps, float *out,
                          int64_t ldo, const pg_team *team);
void pg_rope_part(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t D,
                  const int64_t *pos, const float *cos_table, const float *sin_table,
                  const pg_team *team);
void pg_act_and_mul_part(const float *x, int64_t ldx, int64_t T, int64_t I, int act,
                         float *out, int64_t ldo, const pg_team *team);
int pg_i8gemm_supported(int type);
int64_t pg_gemm_i8_tile_bytes(int type, int64_t K);
void pg_gemm_i8_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                     const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
                     int64_t ldy, uint8_t *tile, const pg_team *team);
void pg_gemm_i8_tiles(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const int8_t *QX, const float *DX, const int32_t *SX, int64_t M, float *Y,
                      int64_t ldy, uint8_t *tile, int64_t t0, int64_t t1, int64_t after, int same);
int pg_amx_ready(void);
int pg_amx_supported(int type, int64_t K);
int64_t pg_gemm_amx_scratch(int type, int64_t K);
int64_t pg_amx_rows_bytes(int64_t M, int64_t K);
void pg_bf16_rows_part(const float *X, int64_t ldx, int64_t M, int64_t K, uint16_t *A,
                       const pg_team *team);
int64_t pg_gemm_amx_gated_scratch(int tg, int tu, int64_t K);
void pg_gemm_amx_gated_part(int tg, const uint8_t *Wg, int64_t rbg, int tu, const uint8_t *Wu,
                            int64_t rbu, int64_t I, int64_t K, const uint16_t *A, int64_t M,
                            int act, float *Y, int64_t ldy, uint8_t *scratch,
                            const pg_team *team);
void pg_gemm_amx_part(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                      const uint16_t *A, int64_t M, float *Y, int64_t ldy, uint8_t *scratch,
                      const pg_team *team);

void pg_head_rms_norm_part(float *x, int64_t ldx, int64_t T, int64_t nq, int64_t nk, int64_t D,
                           const float *wq, const float *wk, float eps, const pg_team *team);
void pg_moe_route_part(const float *logits, int64_t T, int64_t E, int64_t k, int renorm,
                       float *probs, int64_t *ids, float *weights, const pg_team *team);
int64_t pg_paged_decode_scratch(int64_t max_slots);
void pg_paged_decode_part(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int kv_type, const void *k_store, const void *v_store,
                          int64_t NB, int64_t bs, const int64_t *table, int64_t table_stride,
                          const int64_t *lo, const int64_t *hi, int64_t max_slots, float scale,
                          float cap, float *out, float *scratch, const pg_team *team);
void pg_write_kv_part(const float *key, int64_t ldk, const float *value, int64_t ldv,
                      int64_t T, int64_t KVH, int64_t D, int kv_type, void *k_store,
                      void *v_store, int64_t NB, int64_t bs, const int64_t *slots,
                      const pg_team *team);

/* Output rows [row_start, row_start + rows) of a linear: `block` 0, rows of one ggml
 * type (`row_bytes` each); `block` > 0, float32 in column blocks of `block` outputs with
 * `k_pad` values each (dense_f32.c). */
typedef struct {
    int64_t type, row_bytes, row_start, rows;
    const uint8_t *data;
    int64_t block, k_pad;
} pg_weight_group;

typedef struct {
    int64_t n_groups, n_in, n_out;
    const pg_weight_group *groups;
    const float *bias; /* [n_out] or NULL */
} pg_linear;

enum { PG_ACT_SILU = 0, PG_ACT_GELU_TANH = 1 }; /* pg_act_and_mul_part's act */
#define PG_MAX_VIEWS 2 /* kinds of attention in one model (Gemma: sliding and global) */

typedef struct {
    const float *norm1, *norm2; /* the RMSNorm weights before attention and before the MLP */
    pg_linear qkv, o, gate_up, down;
    void *k_store, *v_store; /* K [KVH, NB, D, bs], V [KVH, NB, bs, D] of the step's kv_type */
    const float *q_norm, *k_norm;          /* per-head norm weights [D], or NULL */
    const float *post_attn, *post_ffn;     /* norms of the sub-blocks' outputs, or NULL */
    const float *cos_table, *sin_table;    /* this layer's rope tables [max_pos, D], or NULL */
    float scale;                           /* q.k scale */
    float soft_cap;                        /* scores capped as cap * tanh(s / cap); 0: none */
    int64_t view;                          /* which of the step's attention views */
    int64_t act;                           /* PG_ACT_* */
    /* experts (moe_experts > 0; gate_up and down unused): the router, and each
     * projection of all experts stacked (expert e's rows follow expert e-1's) */
    pg_linear router;
    int64_t moe_experts, moe_top_k, moe_inter, moe_renorm;
    pg_weight_group moe_gate, moe_up, moe_down; /* rows: one expert's; data: expert 0's */
} pg_layer;

/* The slots each row attends to, for the layers of one sliding window (or none): row t
 * reads slots [lo[t], hi[t]) of its padded row of blocks table[t * table_stride ...]. */
typedef struct {
    const int64_t *table, *lo, *hi;
    int64_t table_stride, max_slots;
} pg_attn_view;

/* What every layer shares in one step. Scratch rows are T x the width named. */
typedef struct {
    int64_t T, hidden, H, KVH, D, inter, NB, bs;
    int64_t kv_type; /* the caches' element type (paged_attention.c's PG_KV_*) */
    int64_t direct_rows; /* GGUF products take pg_gemm up to this many rows, else pg_gemm_batched */
    int64_t n_q8;        /* rows whose products with the GGUF groups pg_q8_supported takes
                          * multiply int8-rounded activations (ggml_q8.c): the step's
                          * decodes, q8_rows[i] (NULL: rows 0 .. n_q8-1); 0: none */
    int64_t int8_levels; /* int8 levels each of those rows is rounded in (ggml_q8.c) */
    int64_t i8_batched;  /* 1: the products of more than direct_rows rows round every row to
                          * int8 and take the int8 GEMM (ggml_i8gemm.c) for the groups it
                          * unpacks; the q8 rows then as above */
    int64_t amx_min_rows; /* rows of a product from which those products run on AMX tiles in
                           * bfloat16 instead, where the CPU has AMX-BF16 (amx_gemm.c): the
                           * module path's bound, quantization/gguf.py amx_min_rows */
    float eps;
    const int64_t *positions, *slots, *q8_rows;
    pg_attn_view views[PG_MAX_VIEWS];
    /* expert layers' scratch: router logits and probabilities (T x E), picks (T x k), the
     * rows routed to one expert (in and out: T x hidden), their positions (T) */
    float *moe_logits, *moe_probs, *moe_weights, *moe_x, *moe_y;
    int64_t *moe_ids, *moe_rows, *moe_slots, *moe_q8;
    float *normed; /* hidden */
    float *qkv;    /* (H + 2 KVH) D */
    float *attn;   /* H D */
    float *gate_up; /* 2 inter */
    float *act;    /* inter */
} pg_step;

/* The layout of the structs above as this compiler lays them out, for the ctypes mirrors
 * in models/fused_decode.py to be checked against at load. One list of fields per struct
 * (declaration order) gives both the offsets and the names. */
#define PG_GROUP_FIELDS(X, S) X(S, type) X(S, row_bytes) X(S, row_start) X(S, rows) X(S, data) \
    X(S, block) X(S, k_pad)
#define PG_LINEAR_FIELDS(X, S) X(S, n_groups) X(S, n_in) X(S, n_out) X(S, groups) X(S, bias)
#define PG_LAYER_FIELDS(X, S) X(S, norm1) X(S, norm2) X(S, qkv) X(S, o) X(S, gate_up) X(S, down) \
    X(S, k_store) X(S, v_store) X(S, q_norm) X(S, k_norm) X(S, post_attn) X(S, post_ffn) \
    X(S, cos_table) X(S, sin_table) X(S, scale) X(S, soft_cap) X(S, view) X(S, act) X(S, router) \
    X(S, moe_experts) X(S, moe_top_k) X(S, moe_inter) X(S, moe_renorm) X(S, moe_gate) X(S, moe_up) \
    X(S, moe_down)
#define PG_VIEW_FIELDS(X, S) X(S, table) X(S, lo) X(S, hi) X(S, table_stride) X(S, max_slots)
#define PG_STEP_FIELDS(X, S) X(S, T) X(S, hidden) X(S, H) X(S, KVH) X(S, D) X(S, inter) X(S, NB) \
    X(S, bs) X(S, kv_type) X(S, direct_rows) X(S, n_q8) X(S, int8_levels) X(S, i8_batched) \
    X(S, amx_min_rows) X(S, eps) \
    X(S, positions) X(S, slots) X(S, q8_rows) X(S, views) X(S, moe_logits) X(S, moe_probs) \
    X(S, moe_weights) X(S, moe_x) X(S, moe_y) X(S, moe_ids) X(S, moe_rows) X(S, moe_slots) \
    X(S, moe_q8) X(S, normed) X(S, qkv) X(S, attn) X(S, gate_up) X(S, act)
#define PG_OFF(S, f) (int64_t)offsetof(S, f),
#define PG_NAME(S, f) #f " "
#define PG_LAYOUT(LIST, S) {(int64_t)sizeof(S), LIST(PG_OFF, S)}
static const int64_t pg_group_layout[] = PG_LAYOUT(PG_GROUP_FIELDS, pg_weight_group);
static const int64_t pg_linear_layout[] = PG_LAYOUT(PG_LINEAR_FIELDS, pg_linear);
static const int64_t pg_layer_layout[] = PG_LAYOUT(PG_LAYER_FIELDS, pg_layer);
static const int64_t pg_view_layout[] = PG_LAYOUT(PG_VIEW_FIELDS, pg_attn_view);
static const int64_t pg_step_layout[] = PG_LAYOUT(PG_STEP_FIELDS, pg_step);
static const int64_t *const pg_layouts[] = {pg_group_layout, pg_linear_layout, pg_layer_layout,
                                            pg_view_layout, pg_step_layout};
static const int64_t pg_layout_counts[] = {
    sizeof(pg_group_layout) / 8, sizeof(pg_linear_layout) / 8, sizeof(pg_layer_layout) / 8,
    sizeof(pg_view_layout) / 8, sizeof(pg_step_layout) / 8};
static const char *const pg_layout_names[] = {
    PG_GROUP_FIELDS(PG_NAME, _), PG_LINEAR_FIELDS(PG_NAME, _), PG_LAYER_FIELDS(PG_NAME, _),
    PG_VIEW_FIELDS(PG_NAME, _), PG_STEP_FIELDS(PG_NAME, _)};

/* Struct `which` (0 pg_weight_group, 1 pg_linear, 2 pg_layer, 3 pg_attn_view, 4 pg_step):
 * its size, then each field's offset, into out (at most cap values); *names gets its field
 * names, space-separated. Returns how many values the struct has, -1 for an unknown one. */
int64_t pg_struct_layout(int64_t which, int64_t *out, int64_t cap, const char **names) {
    if (which < 0 || which >= 5) return -1;
    for (int64_t i = 0; i < pg_layout_counts[which] && i < cap; i++) out[i] = pg_layouts[which][i];
    if (names) *names = pg_layout_names[which];
    return pg_layout_counts[which];
}
#undef PG_OFF
#undef PG_NAME
#undef PG_LAYOUT

/* 1 when every weight group of L is one the parts take. */
static int linear_supported(const pg_linear *L) {
    for (int64_t g = 0; g < L->n_groups; g++) {
        const pg_weight_group *w = &L->groups[g];
        if (w->block > 0 ? !pg_f32_blocked_supported(w->block, w->k_pad, L->n_in)
                         : !pg_type_supported((int)w->type))
            return 0;
    }
    return 1;
}

/* Each thread's buffers: weight rows (`wrow`), attention scores, an int8 weight tile
 * (`tile`, for pg_gemm_i8) or bfloat16 weight panels (`amx`, for pg_gemm_amx_part); and the
 * team's packed rows of x (`xp`, for pg_gemm_batched), x's q8 rows rounded to int8 (`qx`,
 * `dx`, `sx`, for pg_gemm_q8) and all its rows rounded once (`bqx`, `bdx`, `bsx`, for
 * pg_gemm_i8; or `bx`, bfloat16, for the AMX products). */
typedef struct {
    float *wrow, *scores, *xp;
    int8_t *qx;
    float *dx;
    int32_t *sx;
    uint8_t *tile;
    int8_t *bqx;
    float *bdx;
    int32_t *bsx;
    uint8_t *amx;
    uint16_t *bx;
} scratch;

/* Whether linear L's products of T rows take the int8 GEMM (for the groups it unpacks). */
static int takes_i8(const pg_linear *L, int64_t T, const pg_step *s) {
    if (!s->i8_batched || T <= s->direct_rows || L->n_in % 32) return 0;
    for (int64_t g = 0; g < L->n_groups; g++)
        if (L->groups[g].block == 0 && pg_i8gemm_supported((int)L->groups[g].type)) return 1;
    return 0;
}

static int q8_group(const pg_weight_group *w) {
    return w->block == 0 && pg_q8_supported((int)w->type);
}

/* Whether linear L multiplies int8 activations for the step's q8 rows (any group with a
 * q8 kernel). */
static int takes_q8(const pg_linear *L, const pg_step *s) {
    if (s->n_q8 == 0 || L->n_in % 32) return 0;
    for (int64_t g = 0; g < L->n_groups; g++)
        if (q8_group(&L->groups[g])) return 1;
    return 0;
}

/* The q8 groups of L for every row of a step (all int8), in chunks of rows the team claims
 * as it goes (one count over all the groups' chunks, ggml_q8.c's pg_q8_chunks): a decode
 * step is a few hundred of these products, and a static split waits at each for the
 * thread that a shared VM slowed. Each output is the same dot product whoever computes it. */
static void q8_claimed(const pg_linear *L, const pg_step *s, const scratch *sc, float *y,
                       const pg_team *team) {
    int64_t total = 0, taken = 0;
    for (int64_t g = 0; g < L->n_groups; g++)
        if (q8_group(&L->groups[g])) total += pg_q8_chunks(L->groups[g].rows, L->groups[g].row_bytes);
    for (int64_t c; (c = pg_claim(team, total, &taken)) >= 0;) {
        const pg_weight_group *w = L->groups;
        for (;; w++) { /* the group of chunk c, and c within it */
            const int64_t n = q8_group(w) ? pg_q8_chunks(w->rows, w->row_bytes) : 0;
            if (c < n) break;
            c -= n;
        }
        pg_gemm_q8_chunk((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, sc->qx, sc->dx,
                         sc->sx, s->n_q8, s->int8_levels, y + w->row_start, L->n_out,
                         s->q8_rows, c);
    }
}

/* Whether `linear` multiplies group w in the int8 GEMM (its i8 branch). */
static int i8_group(const pg_weight_group *w, int64_t T, const pg_step *s, int i8, int amx) {
    return i8 && !amx && w->block <= 0 && T > s->direct_rows && pg_i8gemm_supported((int)w->type);
}

/* The int8 GEMM's groups of L (i8_group), their 16-row tiles claimed one at a time as the
 * team goes (one count over all the groups' tiles), as q8_claimed does for the decode
 * kernels: a static split waits at every product for the thread that a shared VM slowed.
 * Each output is the same sum whoever computes it. */
static void i8_claimed(const pg_linear *L, int64_t T, const pg_step *s, const scratch *sc,
                       float *y, int i8, int amx, const pg_team *team) {
    int64_t total = 0, taken = 0, last_type = -1;
    for (int64_t g = 0; g < L->n_groups; g++)
        if (i8_group(&L->groups[g], T, s, i8, amx)) total += (L->groups[g].rows + 15) / 16;
    for (int64_t c; (c = pg_claim(team, total, &taken)) >= 0;) {
        const pg_weight_group *w = L->groups;
        int64_t t = c;
        for (;; w++) { /* the group of tile c, and t within it */
            const int64_t n = i8_group(w, T, s, i8, amx) ? (w->rows + 15) / 16 : 0;
            if (t < n) break;
            t -= n;
        }
        const int64_t next = pg_claim_next(team, total, c), after = next < 0 ? -1 : t + (next - c);
        pg_gemm_i8_tiles((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, sc->bqx, sc->bdx,
                         sc->bsx, T, y + w->row_start, L->n_out, sc->tile, t, t + 1, after,
                         w->type == last_type);
        last_type = w->type;
    }
}

/* y = x @ W.T (+ bias) for T rows, with the kernel the module path picks for T rows:
 * this thread's columns of every group, then (after the team has met) its rows of the
 * bias. */
static void linear(const pg_linear *L, const float *x, int64_t T, float *y, const pg_step *s,
                   const scratch *sc, const pg_team *team) {
    const int64_t direct_rows = s->direct_rows;
    /* every row int8 (a decode step), or some (the decodes beside prompt chunks: every row
     * float32 first, then the decode rows' columns of q8 groups again, in int8) */
    const int q8 = takes_q8(L, s), every = q8 && s->n_q8 == T;
    const int i8 = !every && takes_i8(L, T, s);
    const int amx = i8 && T >= s->amx_min_rows && pg_amx_ready(); /* every i8 group then */
    if (q8 || i8) { /* the q8 rows rounded once for every group; every row for the int8 GEMM */
        pg_claim_reset(team); /* idle: the team met after the last claims */
        if (q8)
            pg_quantize_q8_part(x, L->n_in, s->q8_rows, s->n_q8, L->n_in, s->int8_levels, sc->qx,
                                sc->dx, sc->sx, team);
        if (amx)
            pg_bf16_rows_part(x, L->n_in, T, L->n_in, sc->bx, team);
        else if (i8)
            pg_quantize_q8_part(x, L->n_in, NULL, T, L->n_in, 1, sc->bqx, sc->bdx, sc->bsx, team);
        pg_team_sync(team);
    }
    const int claim_i8 = i8 && !amx && pg_q8_claim && team->barrier != NULL && team->nth == 2;
    if (claim_i8) i8_claimed(L, T, s, sc, y, i8, amx, team); /* its groups skipped below */
    for (int64_t g = 0; g < L->n_groups; g++) {
        const pg_weight_group *w = &L->groups[g];
        if (every && q8_group(w))
            continue; /* int8 only, below */
        if (claim_i8 && i8_group(w, T, s, i8, amx)) continue;
        if (w->block > 0)
            pg_gemm_f32_blocked_part((const float *)w->data, w->block, w->k_pad, w->rows,
                                     L->n_in, x, L->n_in, T, y + w->row_start, L->n_out, team);
        else if (T <= direct_rows)
            pg_gemm_part((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, x, L->n_in, T,
                         y + w->row_start, L->n_out, sc->wrow, team);
        else if (amx && pg_i8gemm_supported((int)w->type))
            pg_gemm_amx_part((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, sc->bx, T,
                             y + w->row_start, L->n_out, sc->amx, team);
        else if (i8 && pg_i8gemm_supported((int)w->type))
            pg_gemm_i8_part((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, sc->bqx,
                            sc->bdx, sc->bsx, T, y + w->row_start, L->n_out, sc->tile, team);
        else
            pg_gemm_batched_part((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, x,
                                 L->n_in, T, y + w->row_start, L->n_out, sc->xp, sc->wrow,
                                 team);
    }
    if (every && pg_q8_claim) {
        q8_claimed(L, s, sc, y, team);
    } else if (q8) { /* some rows: after their float32 values are in y, which these replace */
        if (!every) pg_team_sync(team);
        for (int64_t g = 0; g < L->n_groups; g++) {
            const pg_weight_group *w = &L->groups[g];
            if (q8_group(w))
                pg_gemm_q8_part((int)w->type, w->data, w->row_bytes, w->rows, L->n_in, sc->qx,
                                sc->dx, sc->sx, s->n_q8, s->int8_levels, y + w->row_start,
                                L->n_out, s->q8_rows, team);
        }
    }
    pg_team_sync(team);
    if (L->bias != NULL) {
        int64_t t0, t1;
        pg_share(T, team, &t0, &t1);
        for (int64_t t = t0; t < t1; t++)
            for (int64_t n = 0; n < L->n_out; n++) y[t * L->n_out + n] += L->bias[n];
        pg_team_sync(team);
    }
}

/* Whether row t of the step multiplies int8 activations (the step's q8 rows). */
static int q8_row(const pg_step *s, int64_t t) {
    if (s->q8_rows == NULL) return t < s->n_q8;
    for (int64_t i = 0; i < s->n_q8; i++)
        if (s->q8_rows[i] == t) return 1;
    return 0;
}

/* x = the experts' weighted sum for s->normed's rows (see the top of the file). Every
 * thread walks the experts in the same order; thread 0 gathers an expert's rows, the
 * team runs its three kernels, and each thread adds its share of the rows to x. A row
 * picks an expert at most once, so the rows of one expert are distinct. */
static void moe_ffn(const pg_layer *L, const pg_step *s, const scratch *sc, float *x,
                    const pg_team *team) {
    const int64_t T = s->T, hid = s->hidden, E = L->moe_experts, K = L->moe_top_k,
                  I = L->moe_inter;
    linear(&L->router, s->normed, T, s->moe_logits, s, sc, team);
    if (team->ith == 0) { /* a few rows: thread 0 alone, as a team of one */
        const pg_team solo = {0, 1, team->barrier};
        pg_moe_route_part(s->moe_logits, T, E, K, (int)L->moe_renorm, s->moe_probs, s->moe_ids,
                          s->moe_weights, &solo);
        memset(x, 0, (size_t)(T * hid) * sizeof(float));
    }
    pg_team_sync(team);
    for (int64_t e = 0; e < E; e++) {
        int64_t m = 0;
        for (int64_t i = 0; i < T * K; i++) m += s->moe_ids[i] == e;
        if (m == 0) continue; /* every thread sees the same picks */
        pg_step ls = *s;      /* the expert's rows as a step of m rows */
        ls.n_q8 = 0;
        if (team->ith == 0) {
            int64_t j = 0, all_q8 = 1;
            for (int64_t i = 0; i < T * K; i++) {
                if (s->moe_ids[i] != e) continue;
                const int64_t t = i / K;
                s->moe_rows[j] = t;
                s->moe_slots[j] = i;
                memcpy(s->moe_x + j * hid, s->normed + t * hid, (size_t)hid * sizeof(float));
                j++;
            }
            int64_t n = 0;
            for (j = 0; j < m; j++)
                if (s->n_q8 > 0 && q8_row(s, s->moe_rows[j])) s->moe_q8[n++] = j;
                else all_q8 = 0;
            s->moe_q8[T] = n; /* the count, after the T slots of indices */
            s->moe_q8[T + 1] = all_q8;
        }
        pg_team_sync(team);
        ls.n_q8 = s->moe_q8[T];
        ls.q8_rows = s->moe_q8[T + 1] ? NULL : s->moe_q8;
        pg_weight_group gu[2] = {L->moe_gate, L->moe_up}, dn = L->moe_down;
        gu[0].data += e * I * gu[0].row_bytes;
        gu[1].data += e * I * gu[1].row_bytes;
        dn.data += e * hid * dn.row_bytes;
        gu[1].row_start = I;
        const pg_linear lin_gu = {2, hid, 2 * I, gu, NULL}, lin_dn = {1, I, hid, &dn, NULL};
        linear(&lin_gu, s->moe_x, m, s->gate_up, &ls, sc, team);
        pg_act_and_mul_part(s->gate_up, 2 * I, m, I, PG_ACT_SILU, s->act, I, team);
        pg_team_sync(team);
        linear(&lin_dn, s->act, m, s->moe_y, &ls, sc, team);
        int64_t j0, j1;
        pg_share(m, team, &j0, &j1);
        for (int64_t j = j0; j < j1; j++) {
            float *xr = x + s->moe_rows[j] * hid;
            const float *y = s->moe_y + j * hid, w = s->moe_weights[s->moe_slots[j]];
            for (int64_t i = 0; i < hid; i++) xr[i] += y[i] * w;
        }
        pg_team_sync(team);
    }
}

/* The group of L holding output rows [start, start + rows) from a whole 16-row bundle, as
 * the AMX gated product reads it (*data its first row), or NULL. */
static const pg_weight_group *rows_of(const pg_linear *L, int64_t start, int64_t rows,
                                      const uint8_t **data) {
    for (int64_t g = 0; g < L->n_groups; g++) {
        const pg_weight_group *w = &L->groups[g];
        if (w->block == 0 && pg_i8gemm_supported((int)w->type) && w->row_start <= start &&
            start + rows <= w->row_start + w->rows && (start - w->row_start) % 16 == 0) {
            *data = w->data + (start - w->row_start) * w->row_bytes;
            return w;
        }
    }
    return NULL;
}

/* The MLP's act(gate) * up into s->act in one AMX pass (pg_gemm_amx_gated: the numbers of
 * the gate_up product and the activation pass), where linear() would run every row of
 * gate_up on AMX; returns 0 (and does nothing) elsewhere. */
static int gated_amx(const pg_layer *L, const pg_step *s, const scratch *sc, const pg_team *team) {
    const pg_linear *gu = &L->gate_up;
    const int64_t T = s->T, I = s->inter;
    if (takes_q8(gu, s) || !takes_i8(gu, T, s) || T < s->amx_min_rows || !pg_amx_ready() ||
        gu->bias != NULL || gu->n_out != 2 * I)
        return 0;
    const uint8_t *dg, *du;
    const pg_weight_group *g = rows_of(gu, 0, I, &dg), *u = rows_of(gu, I, I, &du);
    if (g == NULL || u == NULL) return 0;
    pg_bf16_rows_part(s->normed, gu->n_in, T, gu->n_in, sc->bx, team);
    pg_team_sync(team);
    pg_gemm_amx_gated_part((int)g->type, dg, g->row_bytes, (int)u->type, du, u->row_bytes, I,
                           gu->n_in, sc->bx, T, (int)L->act, s->act, I, sc->amx, team);
    pg_team_sync(team);
    return 1;
}

static void decode_layers(const pg_layer *layers, int64_t n_layers, const pg_step *s, float *x,
                          float *res, const scratch *sc, const pg_team *team) {
    const int64_t T = s->T, hid = s->hidden, qkv_w = (s->H + 2 * s->KVH) * s->D;
    for (int64_t l = 0; l < n_layers; l++) {
        const pg_layer *L = &layers[l];
        if (l == 0) {
            if (team->ith == 0) memcpy(res, x, (size_t)(T * hid) * sizeof(float));
            pg_team_sync(team);
        }
        /* res += x is x += res of the module path: the same sums */
        pg_add_rms_norm_part(res, hid, l == 0 ? NULL : x, hid, L->norm1, T, hid, s->eps,
                             s->normed, hid, team);
        pg_team_sync(team);
        linear(&L->qkv, s->normed, T, s->qkv, s, sc, team);
        if (L->q_norm != NULL) {
            pg_head_rms_norm_part(s->qkv, qkv_w, T, s->H, s->KVH, s->D, L->q_norm, L->k_norm,
                                  s->eps, team);
            pg_team_sync(team);
        }
        if (L->cos_table != NULL) { /* NULL: a layer without rope (SmolLM3) */
            pg_rope_part(s->qkv, qkv_w, T, s->H + s->KVH, s->D, s->positions, L->cos_table,
                         L->sin_table, team);
            pg_team_sync(team);
        }
        const float *key = s->qkv + s->H * s->D, *value = key + s->KVH * s->D;
        pg_write_kv_part(key, qkv_w, value, qkv_w, T, s->KVH, s->D, (int)s->kv_type, L->k_store,
                         L->v_store, s->NB, s->bs, s->slots, team);
        pg_team_sync(team);
        const pg_attn_view *v = &s->views[L->view];
        pg_paged_decode_part(s->qkv, qkv_w, T, s->H, s->KVH, s->D, (int)s->kv_type, L->k_store,
                             L->v_store, s->NB, s->bs, v->table, v->table_stride, v->lo, v->hi,
                             v->max_slots, L->scale, L->soft_cap, s->attn, sc->scores, team);
        pg_team_sync(team);
        linear(&L->o, s->attn, T, x, s, sc, team);
        if (L->post_attn != NULL) { /* in place: each row's scale is taken before it is written */
            pg_add_rms_norm_part(x, hid, NULL, 0, L->post_attn, T, hid, s->eps, x, hid, team);
            pg_team_sync(team);
        }
        pg_add_rms_norm_part(res, hid, x, hid, L->norm2, T, hid, s->eps, s->normed, hid, team);
        pg_team_sync(team);
        if (L->moe_experts > 0) {
            moe_ffn(L, s, sc, x, team);
            continue;
        }
        if (!gated_amx(L, s, sc, team)) {
            linear(&L->gate_up, s->normed, T, s->gate_up, s, sc, team);
            pg_act_and_mul_part(s->gate_up, 2 * s->inter, T, s->inter, (int)L->act, s->act,
                                s->inter, team);
            pg_team_sync(team);
        }
        linear(&L->down, s->act, T, x, s, sc, team);
        if (L->post_ffn != NULL) {
            pg_add_rms_norm_part(x, hid, NULL, 0, L->post_ffn, T, hid, s->eps, x, hid, team);
            pg_team_sync(team);
        }
    }
}

/* Runs `n_layers` layers over x [T, hidden] (in: the embeddings; out: the last MLP
 * output) and res [T, hidden] (out: the residual stream), every kernel a part of one
 * parallel region. Returns 0, or -1 when a weight has no kernel or memory ran out. */
int pg_decode_layers(const pg_layer *layers, int64_t n_layers, const pg_step *s, float *x,
                     float *res) {
    int64_t k_max = 1, xp_floats = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const pg_layer *L = &layers[l];
        /* an expert layer's experts as one linear of each shape, for the checks */
        const pg_weight_group moe_gu[2] = {L->moe_gate, L->moe_up};
        const pg_linear gu = {2, s->hidden, 2 * L->moe_inter, moe_gu, NULL},
                        dn = {1, L->moe_inter, s->hidden, &L->moe_down, NULL};
        const int moe = L->moe_experts > 0;
        const pg_linear *lin[4] = {&L->qkv, &L->o, moe ? &gu : &L->gate_up, moe ? &dn : &L->down};
        if (moe && !linear_supported(&L->router)) return -1;
        for (int i = 0; i < 4; i++) {
            if (!linear_supported(lin[i])) return -1;
            if (lin[i]->n_in > k_max) k_max = lin[i]->n_in;
            if (s->T > s->direct_rows) {
                const int64_t xp = pg_gemm_batched_xp(lin[i]->n_in, s->T);
                if (xp > xp_floats) xp_floats = xp;
            }
        }
    }
    /* per thread: weight rows, then attention scores, then an int8 tile or AMX panels (each a multiple
     * of 16 floats) */
    int64_t wrow = pg_gemm_scratch(k_max), batched = pg_gemm_batched_wbuf(k_max);
    wrow = ((wrow > batched ? wrow : batched) + 15) / 16 * 16;
    int64_t tile_floats = 0;
    const int amx = s->i8_batched && s->T >= s->amx_min_rows && pg_amx_ready();
#define TILE_FOR(type_, k_)                                                                        \
    do {                                                                                           \
        int64_t f = pg_gemm_i8_tile_bytes((type_), (k_));                                          \
        if (amx && f > 0 && pg_amx_supported((type_), (k_))) f = pg_gemm_amx_scratch((type_), (k_)); \
        if ((f + 3) / 4 > tile_floats) tile_floats = (f + 3) / 4;                                  \
    } while (0)
    if (s->i8_batched && s->T > s->direct_rows)
        for (int64_t l = 0; l < n_layers; l++) {
            const pg_layer *L = &layers[l];
            const pg_linear *lin[5] = {&L->qkv, &L->o, &L->gate_up, &L->down, &L->router};
            for (int i = 0; i < 5; i++)
                for (int64_t g = 0; g < lin[i]->n_groups; g++)
                    TILE_FOR((int)lin[i]->groups[g].type, lin[i]->n_in);
            const pg_linear *gu = &L->gate_up;
            if (amx && gu->n_groups > 0) { /* the gated product's two panels a group (gated_amx) */
                const int64_t f = pg_gemm_amx_gated_scratch((int)gu->groups[0].type,
                                                            (int)gu->groups[gu->n_groups - 1].type, gu->n_in);
                if ((f + 3) / 4 > tile_floats) tile_floats = (f + 3) / 4;
            }
            if (L->moe_experts > 0) { /* the experts' shapes */
                const pg_weight_group *e[3] = {&L->moe_gate, &L->moe_up, &L->moe_down};
                for (int i = 0; i < 3; i++)
                    TILE_FOR((int)e[i]->type, i < 2 ? s->hidden : L->moe_inter);
            }
        }
#undef TILE_FOR
    tile_floats = (tile_floats + 15) / 16 * 16;
    int64_t max_slots = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        if (layers[l].view < 0 || layers[l].view >= PG_MAX_VIEWS) return -1;
        const int64_t m = s->views[layers[l].view].max_slots;
        if (m > max_slots) max_slots = m;
    }
    const int64_t scores = (pg_paged_decode_scratch(max_slots) + 15) / 16 * 16;
    const int64_t threads = omp_get_max_threads();
    /* then the team's x rows: packed (xp), and as int8 values, scales and sums per 16 (q8) */
    const int64_t xp = (xp_floats + 15) / 16 * 16;
    const int64_t q8_values = s->n_q8 > 0 ? (s->n_q8 * s->int8_levels * k_max + 63) / 64 * 64 : 0;
    const int64_t q8_floats = (q8_values / 4 + 3 * (q8_values / 32) + 15) / 16 * 16;
    const int64_t i8_values = tile_floats > 0 ? (s->T * k_max + 63) / 64 * 64 : 0;
    int64_t i8_floats = (i8_values / 4 + 3 * (i8_values / 32) + 15) / 16 * 16;
    if (amx && tile_floats > 0) { /* or the rows in bfloat16 */
        const int64_t bx_floats = (pg_amx_rows_bytes(s->T, k_max) / 4 + 15) / 16 * 16;
        if (bx_floats > i8_floats) i8_floats = bx_floats;
    }
    const int64_t per_thread = wrow + scores + tile_floats;
    float *buf = (float *)aligned_alloc(
        64, (size_t)(threads * per_thread + xp + q8_floats + i8_floats) * sizeof(float));
    if (buf == NULL) return -1;
    float *team_x = buf + threads * per_thread;
    int8_t *qx = (int8_t *)(team_x + xp);
    float *dx = (float *)(qx + q8_values);
    int32_t *sx = (int32_t *)(dx + q8_values / 32);
    int8_t *bqx = (int8_t *)(team_x + xp + q8_floats);
    float *bdx = (float *)(bqx + i8_values);
    int32_t *bsx = (int32_t *)(bdx + i8_values / 32);
    pg_barrier barrier = {0};
    barrier.spin_ns = pg_team_spin_ns;
#pragma omp parallel
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        float *mine = buf + team.ith * per_thread;
        const scratch sc = {mine, mine + wrow, team_x, qx, dx, sx,
                            (uint8_t *)(mine + wrow + scores), bqx, bdx, bsx,
                            (uint8_t *)(mine + wrow + scores), (uint16_t *)bqx};
        decode_layers(layers, n_layers, s, x, res, &sc, &team);
    }
    free(buf);
    return 0;
}
