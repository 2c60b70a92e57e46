/* Collectives of the tensor-parallel ranks of one machine through a shared-memory
 * segment (pagellm/distributed/parallel_state.py, ShmChannel).
 *
 * The segment holds a flag per rank (one 64-byte line each) and two buffers of one slot
 * per rank. Operation s posts into buffer s % 2: a rank copies its data into its slot,
 * then raises its flag to s (a release store); a rank reads the slots once every flag has
 * reached s (acquire loads). Two buffers are enough: a rank posts operation s + 2 into
 * operation s's buffer only after every rank posted s + 1, which each does once it has
 * read what it needed of s.
 *
 * The sum of an all-reduce adds the slots in rank order on every rank, so every rank
 * holds the same bits (the ranks sample from the same logits). A wait spins briefly (the
 * ranks run the same step on cores of their own and meet within microseconds), then
 * yields the core, and returns after timeout_us so that the caller can check that its
 * peers are alive.
 */
#define _GNU_SOURCE /* sched_yield, clock_gettime under -std=c11 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define PG_SHM_FLAG_STRIDE 8 /* int64 values: one flag per cache line */
#define PG_SHM_SPINS 20000

static inline void shm_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t shm_now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* Copies nbytes from src into this rank's slot, then raises its flag to seq. */
void pg_shm_post(int64_t *flags, int64_t rank, int64_t seq, void *slot, const void *src, int64_t nbytes) {
    if (nbytes > 0) memcpy(slot, src, (size_t)nbytes);
    __atomic_store_n(&flags[rank * PG_SHM_FLAG_STRIDE], seq, __ATOMIC_RELEASE);
}

/* 0 once every one of the size ranks' flags has reached seq; -1 if timeout_us passed
 * first (call again to go on waiting). */
int pg_shm_wait(const int64_t *flags, int64_t size, int64_t seq, int64_t timeout_us) {
    int64_t spins = 0, start = 0;
    for (int64_t r = 0; r < size; r++) {
        while (__atomic_load_n(&flags[r * PG_SHM_FLAG_STRIDE], __ATOMIC_ACQUIRE) < seq) {
            if (++spins < PG_SHM_SPINS) {
                shm_relax();
                continue;
            }
            sched_yield();
            if ((spins & 63) == 0) {
                int64_t now = shm_now_us();
                if (start == 0) start = now;
                else if (now - start > timeout_us) return -1;
            }
        }
    }
    return 0;
}

/* out[i] = slot 0's [i] + slot 1's [i] + ... in rank order, float32; slots are
 * slot_floats apart from buf. */
void pg_shm_sum_f32(const float *buf, int64_t slot_floats, int64_t size, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float s = buf[i];
        for (int64_t r = 1; r < size; r++) s += buf[r * slot_floats + i];
        out[i] = s;
    }
}
