/* page_burst.c: quiet for a while (the profile's loop then looks at it once a second), then a burst of page
 * syscalls ten times what sampled mode's page ring holds, paced in batches, then quiet again. Every one of
 * them sent must reach user space: the ring a quarter full wakes the loop.
 * Usage: page_burst [PAIRS [SIZE]] (mmap + munmap pairs, default 30000, of SIZE bytes, default 4096) */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long pairs = argc > 1 ? atol(argv[1]) : 30000;
    size_t size = argc > 2 ? (size_t)atol(argv[2]) : 4096;
    void *keep = malloc(64); /* one allocation: the sampler is there */
    sleep(3);
    for (long i = 0; i < pairs; i++) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return 1;
        munmap(p, size);
        if (i % 500 == 499)
            usleep(10000); /* ~80,000 events a second: half the ring (~3,000) fills in ~35 ms */
    }
    sleep(1);
    free(keep);
    return 0;
}
