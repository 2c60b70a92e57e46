/* One OpenMP team through many kernels: a kernel's work is written once as a "part"
 * that does thread ith's share of nth; the kernel's own entry runs its part in a parallel
 * region of its own, and decode_step.c runs every kernel of a decode step as parts inside
 * one region, with pg_team_sync between them.
 *
 * Why: a decode step is hundreds of small kernels. Each region of its own wakes the
 * team's sleeping threads (OMP_WAIT_POLICY=PASSIVE, pagellm's default) and waits for them
 * to sleep again: a futex round trip per kernel, which on a shared VM costs tens of
 * microseconds. Inside one region the threads are all awake, and pg_team_sync spins
 * briefly (the other thread is usually microseconds behind) before it sleeps on a futex
 * itself, so a descheduled partner costs a bounded spin, not a spinning core. Between
 * steps the team sleeps in OpenMP's passive wait as before.
 */
#ifndef PAGELLM_TEAM_H
#define PAGELLM_TEAM_H

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

/* A barrier for one region's team: counters zeroed, and how long an early thread spins
 * before it sleeps. */
typedef struct {
    atomic_int arrived, generation, sleepers;
    int64_t spin_ns;
    _Alignas(64) atomic_llong claimed; /* pg_claim's counter, on a line of its own */
} pg_barrier;

/* The spin decode_step.c gives its barrier (team.c; settable for experiments). */
extern int64_t pg_team_spin_ns;

/* Whether int8 products claim their work as the team goes (team.c): the decode kernels'
 * rows in chunks, the int8 GEMM's 16-row tiles one at a time. */
extern int pg_q8_claim;

typedef struct {
    int ith, nth;
    pg_barrier *barrier; /* NULL in a region whose team never meets (a kernel's own) */
} pg_team;

/* [*lo, *hi): thread ith's contiguous share of n items (the first n % nth threads take
 * one more), as OpenMP's schedule(static) splits a loop. */
static inline void pg_share(int64_t n, const pg_team *team, int64_t *lo, int64_t *hi) {
    const int64_t q = n / team->nth, r = n % team->nth, i = team->ith;
    *lo = i * q + (i < r ? i : r);
    *hi = *lo + q + (i < r);
}

/* Whether a team splits a kernel's work: when it is worth a region of its own (`parallel`:
 * what a kernel's `if` clause decides), or when the team is awake anyway (inside a shared
 * region). pg_share_if gives the share, else all of it to thread 0. */
static inline int pg_team_splits(int parallel, const pg_team *team) {
    return parallel || team->nth == 1 || team->barrier != NULL;
}

static inline void pg_share_if(int parallel, int64_t n, const pg_team *team, int64_t *lo,
                               int64_t *hi) {
    if (pg_team_splits(parallel, team)) {
        pg_share(n, team, lo, hi);
    } else {
        *lo = 0;
        *hi = team->ith == 0 ? n : 0;
    }
}

/* Every thread of the team waits here until all have arrived (a no-op for one thread). */
void pg_team_sync(const pg_team *team);

/* Shares claimed as the team goes, for work that a static split leaves uneven (a thread
 * of a shared VM runs slower for a while). Two threads take chunks from the two ends of
 * the work, thread 0 from the front and thread 1 from the back, each in one direction
 * (a stream the hardware prefetcher follows), until they meet: every claim adds to one
 * shared count, and a claim that would pass the other thread's chunks gets -1. One
 * thread calls pg_claim_reset while the count is idle, the team meets, then each thread
 * calls pg_claim until it returns -1 (`taken` its own count, from 0). Other team sizes
 * take their static share (pg_share) in order. */
static inline void pg_claim_reset(const pg_team *team) {
    if (team->barrier != NULL && team->ith == 0)
        atomic_store_explicit(&team->barrier->claimed, 0, memory_order_relaxed);
}

static inline int64_t pg_claim(const pg_team *team, int64_t n_chunks, int64_t *taken) {
    if (team->nth != 2 || team->barrier == NULL) {
        int64_t lo, hi;
        pg_share(n_chunks, team, &lo, &hi);
        return lo + *taken < hi ? lo + (*taken)++ : -1;
    }
    if (atomic_fetch_add_explicit(&team->barrier->claimed, 1, memory_order_relaxed) >= n_chunks)
        return -1;
    const int64_t k = (*taken)++;
    return team->ith == 0 ? k : n_chunks - 1 - k;
}

/* The chunk a thread's next pg_claim would return if the other thread took none before it
 * (its direction's neighbour of chunk c), or -1: what to fetch ahead of time. */
static inline int64_t pg_claim_next(const pg_team *team, int64_t n_chunks, int64_t c) {
    const int64_t next = team->nth == 2 && team->barrier != NULL && team->ith == 1 ? c - 1 : c + 1;
    return next >= 0 && next < n_chunks ? next : -1;
}

/* Runs the statement given (which may use `team`) in a region of its own when `parallel`, else on the
 * calling thread alone. */
#define PG_TEAM_RUN(parallel, ...)                                                         \
    do {                                                                                   \
        const int pg_par_ = (parallel);                                                    \
        _Pragma("omp parallel if (pg_par_)") {                                             \
            pg_team team = {omp_get_thread_num(), omp_get_num_threads(), NULL};            \
            __VA_ARGS__;                                                                   \
        }                                                                                  \
    } while (0)

#endif
