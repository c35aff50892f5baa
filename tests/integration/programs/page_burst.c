/* page_burst.c: quiet for a while (the profile's loop then looks at it once a second), then a burst of page
 * syscalls ten times what sampled mode's page ring holds, paced in batches, then quiet again. Every one of
 * them must reach the page map: the ring half full wakes the loop.
 * Usage: page_burst PAIRS (mmap + munmap pairs; default 30000) */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long pairs = argc > 1 ? atol(argv[1]) : 30000;
    void *keep = malloc(64); /* one allocation: the sampler is there */
    sleep(3);
    for (long i = 0; i < pairs; i++) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return 1;
        munmap(p, 4096);
        if (i % 500 == 499)
            usleep(10000); /* ~80,000 events a second: half the ring (~3,000) fills in ~35 ms */
    }
    sleep(1);
    free(keep);
    return 0;
}
