/* --ignore-fn and realloc (run with --ignore-fn=quiet_alloc --ignore-fn=quiet_realloc). Massif's rules: a block
 * allocated in an ignored function is not counted, nor are its reallocs or its free, wherever they are made; a
 * realloc made in an ignored function is not counted, and the block it reallocates is ignored from then on, its
 * old size staying counted for good. test_ignore_realloc.py lists the figures each line leads to. */
#include <stdlib.h>

__attribute__((noinline)) void *quiet_alloc(size_t n) { return malloc(n); }
__attribute__((noinline)) void *quiet_realloc(void *p, size_t n) { return realloc(p, n); }
__attribute__((noinline)) void *grow(void *p, size_t n) { return realloc(p, n); }

int main(void)
{
    void *a = quiet_alloc(100);   /* ignored */
    a = grow(a, 800);             /* the realloc elsewhere of an ignored block: ignored */
    void *b = malloc(200);        /* counted */
    b = quiet_realloc(b, 2000);   /* a realloc in an ignored function: 200 B stay counted, for good */
    void *c = malloc(300);
    c = grow(c, 3000);            /* counted: the block moves to grow's stack */
    void *d = quiet_alloc(50);
    d = grow(d, 10);              /* an ignored block shrunk elsewhere: ignored (no negative heap) */
    void *e = quiet_realloc(quiet_alloc(70), 700); /* ignored twice over */
    free(c);                      /* counted */
    void *f = malloc(64);
    free(f);
    free(b);                      /* ignored: b is an ignored block since quiet_realloc */
    free(a);
    free(d);
    free(e);
    void *g = malloc(40);         /* live at exit, with b's 200 B */
    return g == NULL;
}
