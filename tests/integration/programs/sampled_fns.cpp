/* Known numbers of calls per allocation function, on a thread of their own, for MALT's per-function and
 * per-thread statistics in both modes.
 *
 * Usage: sampled_fns [CALLS]. A worker thread makes CALLS (default 20000) calls of each of malloc, calloc,
 * realloc, posix_memalign and operator new, each from its own function (fn_malloc, ...), with the sizes
 * below; a ring of 512 blocks per function keeps the live set small (the block a call replaces is freed,
 * with free or delete). The realloc chain starts from one malloc. At the end every block is freed, and the
 * program prints "calls FUNCTION N" for each function as exact mode names it (operator new is malloc, whose
 * calls libstdc++'s operator new makes; delete is free): the truth the tests compare with.
 *
 * Sizes of call i: malloc 32 + (i % 16) * 32; calloc (1 + i % 4) x 48; realloc 64 + (i % 32) * 32;
 * posix_memalign 256 (aligned to 64); operator new 40 + (i % 8) * 24. */
#include <new>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define RING 512

static long calls_per_fn = 20000;
static long n_malloc, n_calloc, n_realloc, n_posix_memalign, n_free;

static void *must(void *p)
{
    if (!p) {
        perror("alloc");
        exit(1);
    }
    return p;
}

static void *c_ring[4][RING]; /* malloc, calloc, posix_memalign, and the realloc chain in [3][0] */
static void *new_ring[RING];

static void put(void **ring, long i, void *p)
{
    if (ring[i % RING]) {
        free(ring[i % RING]);
        n_free++;
    }
    ring[i % RING] = p;
}

__attribute__((noinline)) static void fn_malloc(void)
{
    for (long i = 0; i < calls_per_fn; i++) {
        put(c_ring[0], i, must(malloc(32 + (i % 16) * 32)));
        n_malloc++;
    }
}

__attribute__((noinline)) static void fn_calloc(void)
{
    for (long i = 0; i < calls_per_fn; i++) {
        put(c_ring[1], i, must(calloc(1 + i % 4, 48)));
        n_calloc++;
    }
}

__attribute__((noinline)) static void fn_realloc(void)
{
    void *p = must(malloc(16));
    n_malloc++;
    for (long i = 0; i < calls_per_fn; i++) {
        p = must(realloc(p, 64 + (i % 32) * 32));
        n_realloc++;
    }
    c_ring[3][0] = p;
}

__attribute__((noinline)) static void fn_posix_memalign(void)
{
    for (long i = 0; i < calls_per_fn; i++) {
        void *p = nullptr;
        if (posix_memalign(&p, 64, 256) != 0)
            must(nullptr);
        put(c_ring[2], i, p);
        n_posix_memalign++;
    }
}

__attribute__((noinline)) static void fn_new(void)
{
    for (long i = 0; i < calls_per_fn; i++) {
        void *p = ::operator new(40 + (i % 8) * 24);
        if (new_ring[i % RING]) {
            ::operator delete(new_ring[i % RING]);
            n_free++;
        }
        new_ring[i % RING] = p;
        n_malloc++;
    }
}

static void *worker(void *)
{
    fn_malloc();
    fn_calloc();
    fn_realloc();
    fn_posix_memalign();
    fn_new();
    for (auto &ring : c_ring)
        for (auto &p : ring)
            if (p) {
                free(p);
                n_free++;
                p = nullptr;
            }
    for (auto &p : new_ring)
        if (p) {
            ::operator delete(p);
            n_free++;
            p = nullptr;
        }
    return nullptr;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        calls_per_fn = atol(argv[1]);
    pthread_t t;
    if (pthread_create(&t, nullptr, worker, nullptr) != 0 || pthread_join(t, nullptr) != 0)
        return 1;
    printf("calls malloc %ld\ncalls calloc %ld\ncalls realloc %ld\ncalls posix_memalign %ld\ncalls free %ld\n",
           n_malloc, n_calloc, n_realloc, n_posix_memalign, n_free);
    return 0;
}
