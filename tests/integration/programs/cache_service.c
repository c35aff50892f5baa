/*
 * cache_service: a service whose heap moves all the time, for the history store's SIGKILL tests (issue: the
 * history that stopped recording a busy target). Every 50 ms it adds 50 entries of 64 to 4,159 bytes to a
 * cache of at most 5,000, which it trims back to its newest 2,500 when full: 1,000 allocations a second, a heap
 * that rises and falls, and the brk heap growing and shrinking with it.
 *
 *   cache_service                 runs until killed; prints "ready" once started
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CAP 5000

static void *cache[CAP];
static int n;

static __attribute__((noinline)) void *make_entry(size_t size)
{
    void *p = malloc(size);
    memset(p, 1, size);
    return p;
}

static __attribute__((noinline)) void trim(void)
{
    for (int j = 0; j < CAP / 2; j++)
        free(cache[j]);
    memmove(cache, cache + CAP / 2, CAP / 2 * sizeof cache[0]);
    n = CAP / 2;
}

int main(void)
{
    unsigned seed = 1;
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        for (int i = 0; i < 50; i++) {
            if (n == CAP)
                trim();
            seed = seed * 1103515245u + 12345u;
            cache[n++] = make_entry(64 + (seed >> 16) % 4096);
        }
        usleep(50000);
    }
}
