/* Large blocks: Valgrind's arena gives a block too big for its 4 MiB superblocks a superblock of its own, and
 * Massif's extra bytes run to that superblock's page end (test_large_extra.py). The pages are never touched. */
#include <stdlib.h>

int main(void)
{
    void *a = malloc(10 << 20);        /* 10 MiB: 4,032 bytes of slop */
    void *b = calloc(1, 100000000);
    void *c = malloc(4194240);         /* the largest that fits a 4 MiB superblock: no slop */
    void *d = malloc(4194241);         /* one more byte: a superblock of its own, 4,095 bytes of slop */
    void *e = malloc(4194224);         /* fills a 4 MiB superblock but for 16 bytes, which it gets too */
    void *f = malloc(1000);
    a = realloc(a, (10 << 20) + 4000); /* within its slop: stays in place, the slop shrinks */
    b = realloc(b, 150000001);         /* moves to a new superblock */
    free(c);
    free(f);
    void *g = malloc(33333333);
    free(d);
    return !(a && b && e && g);
}
