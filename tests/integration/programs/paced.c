/* Allocates and frees a block every 3 ms for about a second: its time goes to sleeping, so it runs about as long
 * under Valgrind as natively, and Massif's schedule in ms can be compared with heapscope's. Only the allocator
 * and nanosleep are called. */
#include <stdlib.h>
#include <time.h>

#define SLOTS 64

void *volatile slot[SLOTS];

int main(void)
{
    struct timespec pause = {0, 3000000};
    for (unsigned i = 0; i < 350; i++) {
        unsigned k = (i * 11) % SLOTS;
        free(slot[k]);
        slot[k] = malloc(100 + (i * 2654435761u) % 3000);
        nanosleep(&pause, 0);
    }
    for (unsigned k = 0; k < SLOTS; k++)
        free(slot[k]);
    return 0;
}
