/* How a product's weight rows are shared by the threads: each thread a contiguous share of the units (rows
 * or blocks of rows), which it takes in rounds from the front; a thread whose share is done takes the others' rounds
 * from their back. Each stream stays contiguous (the hardware's prefetcher follows it), and a thread that started
 * late or streams slower (a busy core, a page's placement) leaves no wait at the end: the even split alone left the
 * faster thread idle for part of each product. Which thread computes a unit changes none of its sums.
 *
 * Included by coded_kernel.c and groups_kernel.h (built with OpenMP: a cursor knows its thread by
 * omp_get_thread_num). */
#ifndef LMHEAD_THREAD_SHARES_H
#define LMHEAD_THREAD_SHARES_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

extern int omp_get_thread_num(void);

/* a share's rounds still to take: the next from the front in the low 32 bits, one past the last in the high — its
 * owner takes from the front, the others from the back, one compare-and-swap a round; a cache line each */
typedef struct {
    _Alignas(64) _Atomic uint64_t word;
} share_claim;

enum { SHARES_ON_STACK = 16 };

typedef struct {
    share_claim* claims;
    int64_t units, round;
    int threads;
    share_claim stack[SHARES_ON_STACK];
} shares;

/* the first unit of thread v's share (v = threads: the end) */
static inline int64_t share_first(const shares* s, int64_t v) { return s->units * v / s->threads; }

/* `units` in rounds of `round` over `threads` shares → 0, or -1 when the claims cannot be allocated */
static inline int shares_open(shares* s, int64_t units, int64_t round, int threads) {
    s->units = units, s->round = round, s->threads = threads < 1 ? 1 : threads;
    s->claims = s->threads <= SHARES_ON_STACK ? s->stack : aligned_alloc(64, sizeof(share_claim) * s->threads);
    if (!s->claims) return -1;
    for (int v = 0; v < s->threads; v++) {
        const int64_t rounds = (share_first(s, v + 1) - share_first(s, v) + round - 1) / round;
        atomic_init(&s->claims[v].word, (uint64_t)rounds << 32);
    }
    return 0;
}

static inline void shares_close(shares* s) {
    if (s->claims != s->stack) free(s->claims);
}

/* a round of the share to take (from the front for its owner), or -1 when none is left */
static inline int64_t share_claim_round(_Atomic uint64_t* word, int owner) {
    uint64_t w = atomic_load_explicit(word, memory_order_relaxed);
    for (;;) {
        const uint64_t front = w & 0xffffffffu, back = w >> 32;
        if (front >= back) return -1;
        const uint64_t next = owner ? w + 1 : w - ((uint64_t)1 << 32);
        if (atomic_compare_exchange_weak_explicit(word, &w, next, memory_order_relaxed, memory_order_relaxed))
            return (int64_t)(owner ? front : back - 1);
    }
}

/* where a thread is: its number, the share it takes from (0: its own, then the others' in turn) and the units left
 * of its round */
typedef struct {
    int tid, v;
    int64_t next, end;
} share_cursor;

/* the calling thread's cursor, at the front of its own share */
static inline share_cursor share_start(void) { return (share_cursor){omp_get_thread_num(), 0, 0, 0}; }

/* the cursor's thread's next round: its first unit, *count its units; -1 when every share is taken */
static inline int64_t shares_next(shares* s, share_cursor* c, int64_t* count) {
    for (; c->v < s->threads; c->v++) {
        const int victim = (c->tid + c->v) % s->threads;
        const int64_t r = share_claim_round(&s->claims[victim].word, c->v == 0);
        if (r < 0) continue;
        const int64_t u0 = share_first(s, victim) + r * s->round, end = share_first(s, victim + 1);
        *count = end - u0 < s->round ? end - u0 : s->round;
        return u0;
    }
    return -1;
}

/* the cursor's thread's next unit, a round claimed as the one before runs out; -1 when every share is taken */
static inline int64_t shares_unit(shares* s, share_cursor* c) {
    if (c->next == c->end) {
        int64_t count;
        const int64_t u0 = shares_next(s, c, &count);
        if (u0 < 0) return -1;
        c->next = u0, c->end = u0 + count;
    }
    return c->next++;
}

#endif
