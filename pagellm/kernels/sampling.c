/* Picking the next token from a batch of float32 logits rows (`ld` floats apart, a row's
 * values contiguous):
 *
 *   pg_argmax_rows   greedy rows, with torch.argmax's rules for ties and NaN
 *   pg_sample_rows   random rows: top-k, then top-p over what top-k kept, then one draw
 *
 * The torch composition they replace is in pagellm/sample/ops.py (apply_top_k_top_p,
 * random_sample), and is what tests compare against. Rows are split across threads only
 * when there are enough values to pay for waking a team.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#define PG_ROWS_PARALLEL_MIN 65536 /* elements below which one thread does all rows */

/* out[t] = the index of the largest of row t's N values, as torch.argmax: the first one
 * when several are equal, the first NaN when the row has any. Eight lanes each keep
 * their best value and its index (a strict `>` keeps the earliest); the lanes are then
 * merged, the lowest index winning ties, and the tail is scanned after them. */
void pg_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T * N >= 4 * PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        v8f best = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                    -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, idx = at, nan = {0};
        int64_t i = 0;
        for (; i + 8 <= N && i + 8 <= INT32_MAX; i += 8, idx += 8) {
            v8f v;
            memcpy(&v, r + i, sizeof v);
            const v8i better = v > best;
            nan |= v != v;
            best = (v8f)(((v8i)v & better) | ((v8i)best & ~better));
            at = (idx & better) | (at & ~better);
        }
        int64_t k = at[0];
        float b = best[0];
        int any_nan = nan[0] != 0;
        for (int j = 1; j < 8; j++) {
            any_nan |= nan[j] != 0;
            if (best[j] > b || (best[j] == b && at[j] < k)) {
                b = best[j];
                k = at[j];
            }
        }
        for (; i < N; i++) {
            any_nan |= r[i] != r[i];
            if (r[i] > b) {
                b = r[i];
                k = i;
            }
        }
        if (any_nan)
            for (k = 0; r[k] == r[k]; k++) {
            }
        out[t] = k;
    }
}

/* A token that may be kept: its logit and its column. Tokens are ordered best first: by
 * logit, then by column (lower first), so no two are equal. */
typedef struct {
    float logit;
    int32_t index;
} pg_candidate;

static inline int better(pg_candidate a, pg_candidate b) {
    return a.logit > b.logit || (a.logit == b.logit && a.index < b.index);
}

static inline void swap_candidates(pg_candidate *c, int64_t i, int64_t j) {
    const pg_candidate t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* Splits c[lo..hi) (hi - lo >= 3) around the median of its first, middle and last entry:
 * returns q with c[lo..q) better than c[q], c[q+1..hi) worse. */
static int64_t partition(pg_candidate *c, int64_t lo, int64_t hi) {
    const int64_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (better(c[mid], c[lo]))
        swap_candidates(c, mid, lo);
    if (better(c[last], c[lo]))
        swap_candidates(c, last, lo);
    if (better(c[last], c[mid]))
        swap_candidates(c, last, mid);
    swap_candidates(c, mid, last); /* the median is the pivot, parked at the end */
    const pg_candidate pivot = c[last];
    int64_t q = lo;
    for (int64_t j = lo; j < last; j++)
        if (better(c[j], pivot))
            swap_candidates(c, q++, j);
    swap_candidates(c, q, last);
    return q;
}

/* Insertion sort of c[lo..hi), best first (for the few left once partitions are small). */
static void sort_small(pg_candidate *c, int64_t lo, int64_t hi) {
    for (int64_t i = lo + 1; i < hi; i++) {
        const pg_candidate x = c[i];
        int64_t j = i;
        for (; j > lo && better(x, c[j - 1]); j--)
            c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Reorders c[0..n) so that c[0..k) are its k best (in no particular order), 0 < k < n. */
static void select_best(pg_candidate *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    while (hi - lo > 16) {
        const int64_t q = partition(c, lo, hi);
        if (q == k || q == k - 1)
            return;
        if (q > k)
            hi = q;
        else
            lo = q + 1;
    }
    sort_small(c, lo, hi);
}

/* Reorders c[0..n) so that its best tokens come first and returns j, the fewest of them
 * whose weights e reach `limit` (at least 1): top-p keeps a token while the mass of the
 * better ones is under the limit. c[0..lo) are kept, with weight limit - need; c[hi..n)
 * are dropped; the answer lies in [lo, hi]. */
static int64_t nucleus(pg_candidate *c, int64_t n, const float *e, double limit) {
    int64_t lo = 0, hi = n;
    double need = limit;
    while (hi - lo > 16) {
        const int64_t q = partition(c, lo, hi);
        double mass = 0.0;
        for (int64_t j = lo; j < q; j++)
            mass += e[c[j].index];
        if (mass >= need) {
            hi = q;
        } else {
            need -= mass + e[c[q].index];
            lo = q + 1;
            if (need <= 0.0)
                return lo;
        }
    }
    sort_small(c, lo, hi);
    double acc = 0.0;
    int64_t j = lo;
    while (j < hi && (j == 0 || acc < need))
        acc += e[c[j++].index];
    return j;
}

/* The largest value of r[0..n), NaN ignored (-inf when there is none). */
static float row_max(const float *r, int64_t n) {
    v8f best = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, r + i, sizeof v);
        best = v8_select(v > best, v, best); /* NaN > x is false: NaN never wins */
    }
    float m = best[0];
    for (int j = 1; j < 8; j++)
        m = best[j] > m ? best[j] : m;
    for (; i < n; i++)
        m = r[i] > m ? r[i] : m;
    return m;
}

/* The sum of exp(r[i] - m) over the row, -inf and NaN logits counting 0. With e, each
 * term is also stored in e[i] (the row's unnormalised probabilities: a masked token gets
 * exactly 0, so it can never be drawn). Partial sums in float over 1024 values at a
 * time, added up in double. */
static double row_exp(const float *r, int64_t n, float m, float *e) {
    double total = 0.0;
    for (int64_t start = 0; start < n; start += 1024) {
        const int64_t end = start + 1024 < n ? start + 1024 : n;
        v8f acc = {0};
        int64_t i = start;
        for (; i + 8 <= end; i += 8) {
            v8f v;
            memcpy(&v, r + i, sizeof v);
            const v8f p = v8_select(v > -INFINITY, v8_exp(v - m), (v8f){0});
            if (e != NULL)
                memcpy(e + i, &p, sizeof p);
            acc += p;
        }
        float part = 0.0f;
        for (int j = 0; j < 8; j++)
            part += acc[j];
        for (; i < end; i++) {
            const float p = r[i] > -INFINITY ? expf(r[i] - m) : 0.0f;
            if (e != NULL)
                e[i] = p;
            part += p;
        }
        total += part;
    }
    return total;
}

/* The tokens whose weight e is at least `floor` (every weighted token when floor is 0),
 * into c; returns how many, and their summed weight in *mass. */
static int64_t gather(const float *r, const float *e, int64_t n, float floor, pg_candidate *c,
                      double *mass) {
    int64_t count = 0;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (e[i] > 0.0f && e[i] >= floor) {
            c[count].logit = r[i];
            c[count].index = (int32_t)i;
            count++;
            sum += e[i];
        }
    }
    *mass = sum;
    return count;
}

/* The kept tokens of a row are always its best ones: every token up to and including
 * `last` in the best-first order. */
static inline int kept(float logit, int64_t index, pg_candidate last) {
    return logit > last.logit || (logit == last.logit && index <= last.index);
}

/* One draw from row r (n values) with uniform number u in [0, 1):
 *
 * 1. e = exp(r - max), unnormalised probabilities (0 for masked tokens).
 * 2. Which tokens are kept: all of them, or with top-k / top-p the best ones. Only the
 *    best can survive, so they are gathered first: those with e >= 2^-10 of the best
 *    token's, then 2^-24, 2^-60, then all, until there are at least k of them (top-k) or
 *    they hold at least top_p of the mass (top-p alone: the nucleus lies within any set
 *    of best tokens holding that much). top-k keeps the k best and any token tied with
 *    the k-th (as the torch path does); top-p then keeps tokens, best first, while the
 *    mass of those kept before them is under top_p of what top-k kept: the smallest
 *    nucleus, and the best token always. Both are selections (partitions), not sorts.
 * 3. The draw: the first kept token, in column order, whose running sum of e passes
 *    u * (sum of the kept e).
 * c: scratch for n candidates; e: scratch for n floats. */
static int64_t sample_row(const float *r, int64_t n, int64_t k, float p, double u, float *e,
                          pg_candidate *c) {
    const float m = row_max(r, n);
    if (m == -INFINITY || m == INFINITY) { /* nothing finite to weigh: torch's argmax */
        int64_t i = 0;
        while (i < n - 1 && !(r[i] == m || (m == -INFINITY && r[i] != r[i])))
            i++;
        return i;
    }
    const double total = row_exp(r, n, m, e);
    const int use_k = k > 0 && k < n, use_p = p < 1.0f;
    pg_candidate last = {-INFINITY, INT32_MAX}; /* everything with weight is kept */
    if (use_k || use_p) {
        static const float floors[] = {0x1p-10f, 0x1p-24f, 0x1p-60f, 0.0f};
        int64_t count = 0;
        double mass = 0.0;
        for (int f = 0; f < 4; f++) {
            count = gather(r, e, n, floors[f], c, &mass);
            if (use_k ? count >= k : mass >= (double)p * total)
                break;
        }
        int64_t n_kept = count;
        if (use_k && count > k) {
            select_best(c, count, k);
            float kth = c[0].logit; /* the worst of the k best, and its ties after them */
            for (int64_t j = 1; j < k; j++)
                kth = c[j].logit < kth ? c[j].logit : kth;
            n_kept = k;
            for (int64_t j = k; j < count; j++)
                if (c[j].logit == kth)
                    swap_candidates(c, n_kept++, j);
            mass = 0.0;
            for (int64_t j = 0; j < n_kept; j++)
                mass += e[c[j].index];
        }
        if (use_p)
            n_kept = nucleus(c, n_kept, e, (double)p * (use_k ? mass : total));
        last = c[0];
        for (int64_t j = 1; j < n_kept; j++)
            last = better(last, c[j]) ? c[j] : last;
    }
    double kept_mass = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && kept(r[i], i, last))
            kept_mass += e[i];
    const double target = u * kept_mass;
    double cum = 0.0;
    int64_t chosen = last.index == INT32_MAX ? 0 : last.index;
    for (int64_t i = 0; i < n; i++) {
        if (e[i] > 0.0f && kept(r[i], i, last)) {
            cum += e[i];
            chosen = i; /* rounding: the last kept token, should the sum fall short */
            if (cum > target)
                break;
        }
    }
    return chosen;
}

/* out[t] = one token drawn from softmax(row t) for every row whose skip[t] is 0 (skip may
 * be NULL), with top_k[t] (<= 0 or >= N: off; top_k may be NULL) and top_p[t] (>= 1: off;
 * may be NULL) applied as in sample_row, from u[t] in [0, 1). Rows with skip[t] set are
 * left as they were. Returns 0, or -1 when scratch memory could not be had. */
int pg_sample_rows(const float *x, int64_t ldx, int64_t T, int64_t N, const int64_t *top_k,
                   const float *top_p, const double *u, const uint8_t *skip, int64_t *out) {
    if (N <= 0 || N > INT32_MAX)
        return -1;
    int failed = 0;
#pragma omp parallel if (T > 1 && T * N >= PG_ROWS_PARALLEL_MIN)
    {
        float *e = malloc((size_t)N * sizeof *e);
        pg_candidate *c = malloc((size_t)N * sizeof *c);
        if (e == NULL || c == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < T; t++) {
            if (e == NULL || c == NULL || (skip != NULL && skip[t]))
                continue;
            out[t] = sample_row(x + t * ldx, N, top_k ? top_k[t] : 0, top_p ? top_p[t] : 1.0f,
                                u[t], e, c);
        }
        free(e);
        free(c);
    }
    return failed ? -1 : 0;
}

/* Penalties on rows of logits, touching only the tokens a request has seen (the torch
 * composition in sample/ops.py, apply_penalties, makes ~10 passes over the vocabulary):
 * a token in the prompt (prompt[t, :], padded with N) or the output (out_ids from
 * out_offsets[t] to out_offsets[t + 1]) has its logit divided by repetition[t] when
 * positive, multiplied when not, once; an output token then loses frequency[t] times its
 * count and presence[t]. The same float32 operations as the torch path, in the same order
 * per token. Returns 0, or -1 when scratch memory could not be had. */
int pg_apply_penalties(float *x, int64_t ldx, int64_t T, int64_t N, const int64_t *prompt,
                       int64_t ldp, int64_t prompt_width, const int64_t *out_ids,
                       const int64_t *out_offsets, const float *presence,
                       const float *frequency, const float *repetition) {
    int failed = 0;
#pragma omp parallel if (T > 1 && T * N >= PG_ROWS_PARALLEL_MIN)
    {
        int32_t *count = calloc((size_t)N, sizeof *count); /* output occurrences */
        uint8_t *done = calloc((size_t)N, 1); /* repetition applied */
        if (count == NULL || done == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < T; t++) {
            if (count == NULL || done == NULL)
                continue;
            float *r = x + t * ldx;
            const int64_t *p = prompt ? prompt + t * ldp : NULL;
            const int64_t *o = out_ids + out_offsets[t];
            const int64_t n_out = out_offsets[t + 1] - out_offsets[t];
            const int64_t n_prompt = p ? prompt_width : 0;
            const float rep = repetition[t];
            for (int64_t j = 0; j < n_out; j++)
                if (o[j] >= 0 && o[j] < N)
                    count[o[j]]++;
            for (int pass = 0; pass < 2; pass++) { /* the prompt's tokens, then the output's */
                const int64_t *ids = pass ? o : p;
                const int64_t n = pass ? n_out : n_prompt;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t id = ids[j];
                    if (id < 0 || id >= N || done[id])
                        continue;
                    done[id] = 1;
                    const float v = r[id];
                    r[id] = v > 0.0f ? v / rep : v * rep;
                }
            }
            for (int64_t j = 0; j < n_out; j++) { /* each distinct output token once */
                const int64_t id = o[j];
                if (id < 0 || id >= N || count[id] == 0)
                    continue;
                const float by_count = frequency[t] * (float)count[id];
                r[id] = r[id] - by_count;
                r[id] = r[id] - presence[t];
                count[id] = 0;
            }
            for (int64_t j = 0; j < n_prompt; j++)
                if (p[j] >= 0 && p[j] < N)
                    done[p[j]] = 0;
            for (int64_t j = 0; j < n_out; j++)
                if (o[j] >= 0 && o[j] < N)
                    done[o[j]] = 0;
        }
        free(count);
        free(done);
    }
    return failed ? -1 : 0;
}

/* Logprobs of row t's chosen token and its k best, as log_softmax + topk + a rank count
 * in torch (sample/sampler.py, gather_logprobs), in two passes over the row with no
 * [T, N] buffer: the row's log-sum-exp, then the k best kept in a small sorted list (a
 * value enters only when it beats the list's worst, so most of the row is one compare).
 * Outputs: ids[t, 0] = chosen[t], ids[t, 1..k] the k best, best first (ties: lower
 * column first); lp the same columns' logprobs; rank[t] = 1 + how many tokens have a
 * higher logprob than the chosen one. NaN logits rank nowhere. 0 <= k <= 64. */
int pg_logprobs_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t k,
                     const int64_t *chosen, int64_t *ids, float *lp, int64_t *rank) {
    if (k < 0 || k > 64 || k > N)
        return -1;
#pragma omp parallel for schedule(static) if (T > 1 && T * N >= PG_ROWS_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        const float m = row_max(r, N);
        const float lse = m == -INFINITY ? -INFINITY : (float)((double)m + log(row_exp(r, N, m, NULL)));
        const int64_t c = chosen[t];
        const float chosen_lp = r[c] - lse;
        /* rank: the values above the chosen one, eight at a time */
        int64_t above = 0, i = 0;
        v8i count = {0};
        for (; i + 8 <= N && i + 8 <= INT32_MAX; i += 8) {
            v8f v;
            memcpy(&v, r + i, sizeof v);
            count -= (v8i)((v - lse) > chosen_lp); /* true lanes are -1 */
        }
        for (int j = 0; j < 8; j++)
            above += count[j];
        for (; i < N; i++)
            above += r[i] - lse > chosen_lp;
        /* the k best: a block of eight is looked at lane by lane only when one of its
         * values beats the list's worst (later equal values never do: higher columns) */
        pg_candidate best[64];
        int64_t n_best = 0;
        for (i = 0; k > 0 && i < N; i += 8) {
            const int64_t end = i + 8 < N ? i + 8 : N;
            if (n_best == k && end - i == 8) {
                v8f v;
                memcpy(&v, r + i, sizeof v);
                const v8i beats = (v8i)((v - lse) > best[k - 1].logit);
                int any = 0;
                for (int j = 0; j < 8; j++)
                    any |= beats[j];
                if (!any)
                    continue;
            }
            for (int64_t l = i; l < end; l++) {
                const float v = r[l] - lse;
                if (v != v)
                    continue;
                const pg_candidate cand = {v, (int32_t)l};
                if (n_best == k && !better(cand, best[k - 1]))
                    continue;
                int64_t j = n_best < k ? n_best++ : k - 1;
                for (; j > 0 && better(cand, best[j - 1]); j--)
                    best[j] = best[j - 1];
                best[j] = cand;
            }
        }
        int64_t *row_ids = ids + t * (k + 1);
        float *row_lp = lp + t * (k + 1);
        row_ids[0] = c;
        row_lp[0] = chosen_lp;
        for (int64_t j = 0; j < k; j++) {
            row_ids[j + 1] = j < n_best ? best[j].index : 0;
            row_lp[j + 1] = j < n_best ? best[j].logit : -INFINITY;
        }
        rank[t] = above + 1;
    }
    return 0;
}
