/* A heap that grows, churns and shrinks in about 700 allocator calls of varied sizes: enough for Massif's
 * schedule to cull several times, few enough that a Massif run with --max-snapshots=1000 keeps every call's
 * state. Only the allocator is called (no stdio), so the run under Valgrind makes the same calls. */
#include <stdlib.h>

#define SLOTS 96

void *volatile slot[SLOTS];

static size_t size_of(unsigned i)
{
    return 24 + (i * 2654435761u) % 1500;
}

int main(void)
{
    unsigned i;
    for (i = 0; i < 200; i++) { /* growth, with some reallocs */
        unsigned k = i % SLOTS;
        if (slot[k])
            slot[k] = realloc(slot[k], size_of(i) + 500);
        else
            slot[k] = malloc(size_of(i));
    }
    for (; i < 500; i++) { /* churn: free one, allocate another */
        unsigned k = (i * 7) % SLOTS;
        free(slot[k]);
        slot[k] = (i & 3) ? malloc(size_of(i)) : calloc(1, size_of(i) / 2);
    }
    for (i = 0; i < SLOTS; i++) { /* shrink to a third */
        if (i % 3) {
            free(slot[i]);
            slot[i] = 0;
        }
    }
    return 0;
}
