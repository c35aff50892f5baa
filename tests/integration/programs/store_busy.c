/*
 * store_busy: a service that allocates without pause at many distinct stacks, for the history store's tests.
 *
 *   store_busy [N_SITES [SECONDS]]      (defaults: 64 sites, 60 s)
 *
 * Allocation i is made at path i % N_SITES through LEVELS nested calls, each level through one of two functions
 * chosen by one bit of the path, so every path is its own stack. 1024 blocks stay live (a ring). Every 100 ms it
 * writes one line to stdout: "<allocations so far>". It ends after SECONDS, or at EOF on stdin when started with
 * STORE_BUSY_STDIN set (then it reads stdin from a thread of its own).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LEVELS 10 /* 1024 distinct paths */
#define RING 1024

static void *ring[RING];
static volatile int stop;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *b(unsigned path, int level, size_t size);

static __attribute__((noinline)) void *a(unsigned path, int level, size_t size)
{
    if (level == 0)
        return malloc(size);
    return (path & 1) ? b(path >> 1, level - 1, size) : a(path >> 1, level - 1, size);
}

static __attribute__((noinline)) void *b(unsigned path, int level, size_t size)
{
    if (level == 0)
        return malloc(size);
    return (path & 1) ? b(path >> 1, level - 1, size) : a(path >> 1, level - 1, size);
}

static void *watch_stdin(void *arg)
{
    char buf[64];
    (void)arg;
    while (read(0, buf, sizeof buf) > 0)
        ;
    stop = 1;
    return NULL;
}

int main(int argc, char **argv)
{
    unsigned sites = argc > 1 ? (unsigned)atoi(argv[1]) : 64;
    double seconds = argc > 2 ? atof(argv[2]) : 60;
    if (sites < 1 || sites > (1u << LEVELS))
        sites = 64;
    if (getenv("STORE_BUSY_STDIN")) {
        pthread_t t;
        pthread_create(&t, NULL, watch_stdin, NULL);
    }
    double start = now_s(), next = start + 0.1;
    unsigned long n = 0;
    while (!stop) {
        unsigned path = n % sites;
        void **slot = &ring[n % RING];
        free(*slot);
        *slot = a(path, LEVELS, 16 + 8 * (path % 32));
        n++;
        if ((n & 255) == 0) {
            double t = now_s();
            if (t >= next) {
                printf("%lu\n", n);
                fflush(stdout);
                next = t + 0.1;
            }
            if (t - start >= seconds)
                break;
            usleep(200); /* a service, not a benchmark: leave the CPU to the profiler too */
        }
    }
    for (int i = 0; i < RING; i++)
        free(ring[i]);
    return 0;
}
