/* xmalloc is given as --alloc-fn (trimmed like malloc); quiet_alloc as --ignore-fn (its blocks are not counted). */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

void *volatile keep[16];

NOINLINE void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (!p)
        abort();
    return p;
}

NOINLINE void *quiet_alloc(size_t n)
{
    return malloc(n);
}

NOINLINE void user_a(void)
{
    keep[0] = xmalloc(1000);
}

NOINLINE void user_b(void)
{
    keep[1] = xmalloc(2000);
    keep[2] = quiet_alloc(3000);
}

int main(void)
{
    user_a();
    user_b();
    keep[3] = quiet_alloc(700);
    keep[4] = malloc(400);
    free(keep[3]);
    return 0;
}
