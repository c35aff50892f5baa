/* Known allocator calls for the pprof tests: every figure test_pprof.py checks follows from the lines marked
 * below (count x size). Each function is its own call site (noinline), grow_buffer is inlined into
 * fill_buffers (always_inline, also at -O0); no stdio. */
#include <stdlib.h>

void *volatile keep[32];

__attribute__((noinline)) void keep_blocks(void)
{
    for (int i = 0; i < 5; i++)
        keep[i] = malloc(1000);                  /* KEEP: 5 x 1000 B, live at exit */
}

__attribute__((noinline)) void churn(void)
{
    for (int i = 0; i < 10; i++)
        free(malloc(100));                       /* CHURN: 10 x 100 B, all freed */
}

static inline __attribute__((always_inline)) void *grow_buffer(size_t n)
{
    return malloc(n);                            /* INLINED: 3 x 256 B, live at exit */
}

__attribute__((noinline)) void fill_buffers(void)
{
    for (int i = 0; i < 3; i++)
        keep[8 + i] = grow_buffer(256);          /* INLINE_CALL: the call site of the inlined grow_buffer */
}

__attribute__((noinline)) void half_freed(void)
{
    for (int i = 0; i < 4; i++)
        keep[16 + i] = calloc(1, 512);           /* HALF: 4 x 512 B, the first 2 freed */
    free(keep[16]);
    free(keep[17]);
}

int main(void)
{
    keep_blocks();
    churn();
    fill_buffers();
    half_freed();
    return 0;
}
