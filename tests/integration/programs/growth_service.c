/*
 * growth_service: a steady leak among a cache that fills then stops and a sawtooth, for "what is growing".
 *
 *   growth_service CACHE_SECONDS RUN_SECONDS
 *
 * Says "ready", waits for a line on stdin, then for RUN_SECONDS on a 10 ms clock (absolute deadlines, so a
 * late tick is caught up and the rates hold over any stretch of a second or more):
 *   leak_one:   2 x 1000 B every tick, never freed: 200,000 B/s;
 *   cache_fill: 10000 B at 2 ticks of every 5 for the first CACHE_SECONDS, kept: 400,000 B/s, then nothing;
 *   saw_tooth:  50000 B every 100 ms, all freed once 33 are held (a tooth of 1.65 MB every 3.3 s).
 * Every 100 ms it prints "WALL_NS LEAKED_BYTES" (CLOCK_REALTIME, the clock heapscope's store keeps): the leak's
 * truth over any window. Then exits.
 *
 * No stdio buffers on the heap: dprintf into a stack buffer, write(2).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define TICK_NS 10000000LL
#define TOOTH 33

static void *leaked[1 << 17]; /* 655 s of leaking */
static long n_leaked;
static void *cache[1 << 16];
static long n_cache;
static void *tooth[TOOTH];
static int n_tooth;

NOINLINE static void leak_one(void)
{
    leaked[n_leaked++] = malloc(1000);
}

NOINLINE static void cache_fill(void)
{
    cache[n_cache++] = malloc(10000);
}

NOINLINE static void saw_tooth(void)
{
    if (n_tooth == TOOTH) {
        for (int i = 0; i < TOOTH; i++)
            free(tooth[i]);
        n_tooth = 0;
    }
    tooth[n_tooth++] = malloc(50000);
}

static long long now_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    long long cache_ticks = atoll(argv[1]) * 100, run_ticks = atoll(argv[2]) * 100;
    char line[64];
    (void)!write(1, "ready\n", 6);
    char c;
    while (read(0, &c, 1) == 1 && c != '\n')
        ;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    if (run_ticks * 2 > (long long)(sizeof leaked / sizeof *leaked))
        return 2;
    for (long long tick = 0; tick < run_ticks; tick++) {
        leak_one();
        leak_one();
        if (tick < cache_ticks && (tick % 5 == 0 || tick % 5 == 2))
            cache_fill();
        if (tick % 10 == 0)
            saw_tooth();
        if (tick % 10 == 0) {
            int n = snprintf(line, sizeof line, "%lld %ld\n", now_ns(CLOCK_REALTIME), n_leaked * 1000);
            (void)!write(1, line, n);
        }
        next.tv_nsec += TICK_NS;
        if (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    return 0;
}
