/* pg_team_sync (team.h): a barrier for a team already inside one parallel region.
 *
 * A thread that arrives before the others spins for up to the barrier's spin_ns, then sleeps
 * on a futex; the last to arrive opens the barrier and wakes sleepers only when there
 * are any. The spin is short because the work between two syncs is split evenly, so the
 * partner is usually microseconds away; when it is not (descheduled by a busy
 * neighbour), the waiter gives its core back after the spin.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "team.h"

/* 50 us: in-process A/B on this 2-core VM (benchmarks/README.md, "One parallel region per
 * decode step"), spins of 10-100 us ran level with each other and well ahead of sleeping at once. */
int64_t pg_team_spin_ns = 50000;

/* 0: the int8 products split their rows (the int8 GEMM its tiles) statically instead of
 * claiming them (team.h; for tests and A/B measurements). */
int pg_q8_claim = 1;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void pg_team_sync(const pg_team *team) {
    if (team->nth <= 1 || team->barrier == NULL) return;
    pg_barrier *b = team->barrier;
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == team->nth - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        /* sequentially consistent: a sleeper either registered before this load (and is
         * woken) or reads the new generation before it waits */
        if (atomic_load(&b->sleepers) > 0)
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    const int64_t deadline = now_ns() + b->spin_ns;
    for (int i = 1;; i++) {
        if (atomic_load(&b->generation) != gen) return;
        cpu_relax();
        if (i % 64 == 0 && now_ns() > deadline) break;
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == gen)
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
}

/* For tests: `rounds` rounds in which every thread of a region writes the round number
 * into its slot, meets the others, reads every slot, and meets them again. Returns how
 * many reads saw another round's number (0 when the barrier holds), or -1 when memory ran
 * out. */
int64_t pg_team_check(int64_t rounds, int64_t spin_ns) {
    int64_t *slots = calloc((size_t)omp_get_max_threads(), sizeof *slots);
    if (slots == NULL) return -1;
    pg_barrier barrier = {0};
    barrier.spin_ns = spin_ns;
    int64_t wrong = 0;
#pragma omp parallel reduction(+ : wrong)
    {
        const pg_team team = {omp_get_thread_num(), omp_get_num_threads(), &barrier};
        for (int64_t r = 1; r <= rounds; r++) {
            atomic_store_explicit((_Atomic int64_t *)&slots[team.ith], r, memory_order_relaxed);
            pg_team_sync(&team);
            for (int i = 0; i < team.nth; i++)
                wrong += atomic_load_explicit((_Atomic int64_t *)&slots[i], memory_order_relaxed) != r;
            pg_team_sync(&team);
        }
    }
    free(slots);
    return wrong;
}
