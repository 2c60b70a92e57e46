/* One-token decode attention over the paged KV cache, and the cache write, in float32.
 *
 * Cache storage (as attention/torch_backend.py allocates it):
 *   K [KVH, NB, D, bs]   a block's keys transposed: key dim d of slot s at [d * bs + s]
 *   V [KVH, NB, bs, D]   one row of D values per slot
 *
 * Request b reads the slots [lo[b], hi[b]) of its padded row, slot i living in block
 * table[b * table_stride + i / bs] at offset i % bs. Each (request, query head) pair is
 * one task: scores over its slots, a softmax, the probability-weighted sum of V rows.
 * Query head h reads KV head h / (H / KVH) (grouped-query attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int pg_paged_decode(const float *q, int64_t ldq, int64_t B, int64_t H, int64_t KVH, int64_t D,
                    const float *k_store, const float *v_store, int64_t NB, int64_t bs,
                    const int64_t *table, int64_t table_stride, const int64_t *lo,
                    const int64_t *hi, int64_t max_slots, float scale, float *out) {
    int64_t group = H / KVH;
    int failed = 0;
#pragma omp parallel if (B * H * max_slots * D >= 32768)
    {
        float *scores = (float *)malloc((size_t)(max_slots > 0 ? max_slots : 1) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < B * H; task++) {
                int64_t b = task / H, h = task % H, kvh = h / group;
                const float *qh = q + b * ldq + h * D;
                const int64_t *row = table + b * table_stride;
                float *o = out + (b * H + h) * D;
                int64_t first = lo[b], last = hi[b];
                float best = -INFINITY;
                for (int64_t i = first; i < last;) {
                    int64_t blk = row[i / bs], s0 = i % bs;
                    int64_t s1 = (last - (i - s0) < bs) ? last - (i - s0) : bs;
                    const float *kb = k_store + ((kvh * NB + blk) * D) * bs;
                    float *sc = scores + (i - first) - s0;
                    for (int64_t s = s0; s < s1; s++) sc[s] = 0.0f;
                    for (int64_t d = 0; d < D; d++) {
                        float qd = qh[d] * scale;
                        const float *kd = kb + d * bs;
                        for (int64_t s = s0; s < s1; s++) sc[s] += qd * kd[s];
                    }
                    for (int64_t s = s0; s < s1; s++) best = sc[s] > best ? sc[s] : best;
                    i += s1 - s0;
                }
                int64_t n = last - first;
                float total = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    scores[j] = expf(scores[j] - best);
                    total += scores[j];
                }
                float inv = 1.0f / total;
                for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t i = first; i < last; i++) {
                    int64_t blk = row[i / bs], s = i % bs;
                    const float *vr = v_store + ((kvh * NB + blk) * bs + s) * D;
                    float p = scores[i - first] * inv;
                    for (int64_t d = 0; d < D; d++) o[d] += p * vr[d];
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* Key and value rows of T tokens ([T, KVH, D], rows ldk / ldv elements apart, heads D
 * apart) into their cache slots (slot = block * bs + offset). */
void pg_write_kv(const float *key, int64_t ldk, const float *value, int64_t ldv, int64_t T,
                 int64_t KVH, int64_t D, float *k_store, float *v_store, int64_t NB, int64_t bs,
                 const int64_t *slots) {
#pragma omp parallel for schedule(static) if (T * KVH * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t blk = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < KVH; h++) {
            const float *kr = key + t * ldk + h * D, *vr = value + t * ldv + h * D;
            float *kb = k_store + ((h * NB + blk) * D) * bs + off;
            float *vb = v_store + ((h * NB + blk) * bs + off) * D;
            for (int64_t d = 0; d < D; d++) {
                kb[d * bs] = kr[d];
                vb[d] = vr[d];
            }
        }
    }
}
