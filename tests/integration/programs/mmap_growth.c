/*
 * mmap_growth: a flat heap while the process maps memory of its own, outside malloc.
 *
 *   mmap_growth RUN_SECONDS
 *
 * Says "ready", waits for a line on stdin, allocates 100 x 10000 B with malloc (held: the heap, flat from then
 * on), then every 100 ms for RUN_SECONDS maps 256 KiB of anonymous memory with mmap(2) and touches every page (so
 * RSS grows with the mapped total: 2.5 MiB/s). Then exits.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define CHUNK (256 << 10)

static void *held[100];

NOINLINE static void hold(int i)
{
    held[i] = malloc(10000);
    memset(held[i], 1, 10000);
}

NOINLINE static void map_more(void)
{
    char *p = mmap(NULL, CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        _exit(1);
    memset(p, 1, CHUNK);
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    long run_ticks = atol(argv[1]) * 10;
    (void)!write(1, "ready\n", 6);
    char c;
    while (read(0, &c, 1) == 1 && c != '\n')
        ;
    for (int i = 0; i < 100; i++)
        hold(i);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (long tick = 0; tick < run_ticks; tick++) {
        map_more();
        next.tv_nsec += 100000000L;
        if (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    return 0;
}
