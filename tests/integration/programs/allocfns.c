/* The allocation entry points whose extra bytes Massif models without its own arena's placement: calloc,
 * realloc (grow, shrink in place, from NULL), reallocarray, and the corner cases free(NULL) and malloc(0).
 * The aligned ones are in aligned.c. */
#define _GNU_SOURCE
#include <stdlib.h>

void *volatile keep[32];

int main(void)
{
    keep[0] = calloc(10, 100);
    /* Zero-byte blocks still cost Massif's admin bytes; free(NULL) frees nothing. */
    free(NULL);
    keep[8] = malloc(0);
    keep[9] = calloc(0, 8);

    /* A realloc chain that starts from NULL (glibc forwards that to malloc), grows, then shrinks. */
    void *r = realloc(NULL, 100);
    r = realloc(r, 1000);
    r = realloc(r, 5000);
    r = realloc(r, 300);
    keep[1] = r;

    /* reallocarray calls realloc inside libc: one allocation, booked to this line. */
    keep[7] = reallocarray(NULL, 10, 40);
    keep[7] = reallocarray(keep[7], 20, 40);
    keep[2] = malloc(2500);

    free(keep[0]);
    free(keep[8]);
    return 0;
}
