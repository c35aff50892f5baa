/* The aligned allocation functions. Their blocks are compared site by site; their extra bytes are not:
 * Massif's slop for an aligned block is how far Valgrind's own arena placed the aligned payload inside a
 * larger block, which says nothing about the program. */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>

void *volatile keep[16];

int main(void)
{
    keep[0] = memalign(64, 1000);
    /* Alignment <= 16 makes glibc's memalign call malloc itself: still one block, booked to this line. */
    keep[1] = memalign(16, 200);
    void *pm = 0;
    if (posix_memalign(&pm, 128, 2000) != 0)
        return 1;
    keep[2] = pm;
    keep[3] = aligned_alloc(256, 512);
    keep[4] = valloc(3000);
    keep[5] = malloc(100);
    free(keep[1]);
    free(keep[4]);
    return 0;
}
