/* A first high-water mark that is freed, then a higher one that is never freed.
 * Massif only looks for a peak when a block is freed, so its peak snapshot is the first wave (20 x 1000 B),
 * while the real maximum is the end state (30 x 1500 B). heapscope's peak is exact: it must be the end state. */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

void *volatile keep[64];

NOINLINE void first_wave(void)
{
    for (int i = 0; i < 20; i++)
        keep[i] = malloc(1000);
    for (int i = 0; i < 20; i++)
        free(keep[i]);
}

NOINLINE void *second_wave_block(size_t n)
{
    return malloc(n);
}

NOINLINE void second_wave(void)
{
    for (int i = 0; i < 30; i++)
        keep[i] = second_wave_block(1500);
}

int main(void)
{
    first_wave();
    second_wave();
    return 0;
}
