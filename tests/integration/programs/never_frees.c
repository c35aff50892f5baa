/* Forty allocations from three sites and no free, over in a few milliseconds (far less than one sampling tick):
 * Massif takes no peak snapshot (it looks for one only at a free) and no snapshot at exit. Only the allocator
 * is called. */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

void *volatile keep[40];

NOINLINE void *small(size_t n) { return malloc(n); }
NOINLINE void *medium(size_t n) { return calloc(1, n); }
NOINLINE void *large(size_t n) { return malloc(n); }

int main(void)
{
    for (unsigned i = 0; i < 40; i++) {
        if (i % 3 == 0)
            keep[i] = small(24 + i);
        else if (i % 3 == 1)
            keep[i] = medium(200 + 8 * i);
        else
            keep[i] = large(1000 + 100 * i);
    }
    return 0;
}
