/* Several allocation sites, a deeper call chain and a loop; no stdio (Valgrind runs __libc_freeres). */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

/* Stored in a global so that -O2 cannot drop the malloc/free pairs. */
void *volatile keep[64];

NOINLINE void *leaf(size_t n)
{
    return malloc(n);
}

NOINLINE void *level3(size_t n)
{
    return leaf(n);
}

NOINLINE void *level2(size_t n)
{
    void *p = level3(n);
    keep[40] = malloc(n / 2);
    return p;
}

NOINLINE void *level1(size_t n)
{
    return level2(n);
}

NOINLINE void loop_site(int count)
{
    for (int i = 0; i < count; i++) {
        keep[i] = malloc(100 + 16 * i);
    }
}

int main(void)
{
    loop_site(10);
    keep[20] = level1(3000);
    keep[21] = level1(5000);
    keep[22] = leaf(777);
    keep[23] = malloc(12345);
    for (int i = 0; i < 5; i++) {
        free(keep[i]);
    }
    keep[24] = level3(2048);
    free(keep[23]);
    keep[25] = malloc(64);
    return 0;
}
