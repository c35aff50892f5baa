/* Every allocation entry point Massif intercepts, plus the corner cases free(NULL) and malloc(0). */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>

void *volatile keep[32];

int main(void)
{
    keep[0] = calloc(10, 100);
    /* Zero-byte blocks still cost Massif's admin bytes; free(NULL) frees nothing. */
    free(NULL);
    keep[8] = malloc(0);
    keep[9] = calloc(0, 8);

    /* A realloc chain that grows, then shrinks, and starts from NULL (glibc forwards that to malloc). */
    void *r = realloc(NULL, 100);
    r = realloc(r, 1000);
    r = realloc(r, 5000);
    r = realloc(r, 300);
    keep[1] = r;

    keep[2] = memalign(64, 1000);
    /* Alignment <= 16 makes glibc's memalign call malloc itself: must still count once. */
    keep[3] = memalign(16, 200);
    void *pm = 0;
    if (posix_memalign(&pm, 128, 2000) != 0)
        return 1;
    keep[4] = pm;
    keep[5] = aligned_alloc(256, 512);
    keep[6] = valloc(3000);
    keep[7] = reallocarray(NULL, 10, 40);
    keep[7] = reallocarray(keep[7], 20, 40);

    free(keep[0]);
    free(keep[3]);
    free(keep[6]);
    return 0;
}
