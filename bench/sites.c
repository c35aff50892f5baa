/*
 * sites: allocates at many distinct call stacks, as fast as it can, for bench/latency.py and the daemon's
 * "never in the target's way" test.
 *
 *   sites [N_SITES [SECONDS]]      (defaults: 10000 sites, 30 s)
 *
 * Allocation i is made at path i % N_SITES: LEVELS nested calls, each level through one of two functions
 * (w0, w1) chosen by one bit of the path, so every path is a distinct stack. 4096 blocks stay live (a ring).
 * Every 100 ms it writes one line to stdout:  <ms since start> <allocations in the interval> <max gap us>
 * where the gap is the longest time between two progress checks (one every 64 allocations): a stall of the
 * process (a stop, a lock held by someone else) shows there.
 * With SITES_WAIT set in the environment it waits for one byte on stdin before it starts (so that a profiler
 * can attach while no allocator call is in flight).
 * Built with -O0 so that no call becomes a tail jump and the stacks stay distinct.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LEVELS 14 /* 2^14 = 16384 distinct paths */
#define RING 4096

static void *ring[RING];

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void *w1(unsigned path, int level, size_t size);

static void *w0(unsigned path, int level, size_t size)
{
    if (level == 0)
        return malloc(size);
    if (path & 1)
        return w1(path >> 1, level - 1, size);
    return w0(path >> 1, level - 1, size);
}

static void *w1(unsigned path, int level, size_t size)
{
    if (level == 0)
        return malloc(size);
    if (path & 1)
        return w1(path >> 1, level - 1, size);
    return w0(path >> 1, level - 1, size);
}

int main(int argc, char **argv)
{
    unsigned n_sites = argc > 1 ? (unsigned)atoi(argv[1]) : 10000;
    double seconds = argc > 2 ? atof(argv[2]) : 30.0;
    if (n_sites == 0 || n_sites > (1u << LEVELS))
        n_sites = 1u << LEVELS;
    if (getenv("SITES_WAIT")) {
        char c;
        (void)!read(0, &c, 1);
    }
    double start = now_us(), last_check = start, next_report = start + 100e3, max_gap = 0;
    unsigned long i = 0, in_interval = 0;
    char line[96];
    for (;;) {
        unsigned path = (unsigned)(i % n_sites);
        size_t slot = i % RING;
        free(ring[slot]);
        ring[slot] = w0(path, LEVELS, 16 + (path % 64) * 8);
        i++;
        in_interval++;
        if ((i & 63) == 0) {
            double t = now_us();
            if (t - last_check > max_gap)
                max_gap = t - last_check;
            last_check = t;
            if (t >= next_report) {
                int n = snprintf(line, sizeof line, "%.0f %lu %.0f\n", (t - start) / 1e3, in_interval, max_gap);
                (void)!write(1, line, (size_t)n);
                in_interval = 0;
                max_gap = 0;
                next_report += 100e3;
                if (t - start >= seconds * 1e6)
                    break;
            }
        }
    }
    return 0;
}
