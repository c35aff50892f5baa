/* Twenty waves, each higher than the last and freed down before the next: Massif takes a peak snapshot at the
 * first free of each wave (the total has come down from a new high), and the last wave's peak stays. Each wave
 * allocates from its own call of wave_block, so the peak trees differ. Only the allocator is called. */
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))
#define WAVES 20
#define MAX_BLOCKS 64

void *volatile held[MAX_BLOCKS];
void *volatile floor_block[WAVES];

NOINLINE void *wave_block(size_t n) { return malloc(n); }
NOINLINE void *floor_alloc(size_t n) { return malloc(n); }

int main(void)
{
    for (unsigned w = 0; w < WAVES; w++) {
        unsigned n = 8 + 2 * w;
        floor_block[w] = floor_alloc(96);  /* the floor rises a little at each wave */
        for (unsigned i = 0; i < n; i++)
            held[i] = wave_block(256 + 64 * (i % 4));
        for (unsigned i = 0; i < n; i++)
            free(held[i]);
    }
    return 0;
}
