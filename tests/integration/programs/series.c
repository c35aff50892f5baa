/* A heap that grows, churns and shrinks from five sites, with reallocs both ways, in about 700 allocator calls:
 * enough for Massif's schedule to cull with its defaults, and for trees that differ from one snapshot to the
 * next (sites that appear late, sites emptied to 0 bytes). Each slot keeps one size, so Valgrind's allocator
 * reuses freed blocks as the size model says. Only the allocator is called (no stdio). With an argument the
 * program sleeps 2 ms every 16 calls: the same calls over about 100 ms, many sampling ticks. */
#include <stdlib.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define SLOTS 48

void *volatile slot[SLOTS];
static unsigned calls;
static int paced;

static void tick(void)
{
    if (paced && ++calls % 16 == 0)
        usleep(2000);
}

static size_t size_of(unsigned k)
{
    return 64 * (1 + (k * 7) % 13);
}

NOINLINE void *grow_a(size_t n) { tick(); return malloc(n); }
NOINLINE void *grow_b(size_t n) { tick(); return calloc(1, n); }
NOINLINE void *resize(void *p, size_t n) { tick(); return realloc(p, n); }
NOINLINE void *late(size_t n) { tick(); return malloc(n); }
NOINLINE void release(void *p) { tick(); free(p); }

int main(int argc, char **argv)
{
    (void)argv;
    paced = argc > 1;
    for (unsigned k = 0; k < SLOTS; k++) /* growth */
        slot[k] = (k & 1) ? grow_b(size_of(k)) : grow_a(size_of(k));
    for (unsigned r = 0; r < 6; r++) { /* churn: each slot freed and allocated again at its size */
        for (unsigned k = 0; k < SLOTS; k++) {
            unsigned j = (k * 5 + r) % SLOTS;
            release(slot[j]);
            slot[j] = (r & 1) ? grow_b(size_of(j)) : grow_a(size_of(j));
        }
    }
    for (unsigned k = 0; k < SLOTS; k += 3) /* shrink some in place, grow others */
        slot[k] = resize(slot[k], size_of(k) / 2);
    for (unsigned k = 1; k < SLOTS; k += 3)
        slot[k] = resize(slot[k], 4 * size_of(k));
    for (unsigned k = 0; k < SLOTS; k += 2) { /* a late site takes the even slots' place */
        release(slot[k]);
        slot[k] = late(size_of(k) * 3);
    }
    for (unsigned k = 0; k < SLOTS; k++) /* shrink to a third */
        if (k % 3) {
            release(slot[k]);
            slot[k] = 0;
        }
    return 0;
}
