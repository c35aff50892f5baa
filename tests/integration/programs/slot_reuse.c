/* slot_reuse: two ways to use the same heap addresses (run it under setarch -R), for a profiler that keeps the
 * blocks of every target in one table.
 *   slot_reuse leave: says "ready", waits for a byte, allocates three 5000-byte blocks (tracked, and left live when
 *                     the profiler detaches), says "allocated", waits for another byte.
 *   slot_reuse free:  allocates the same three blocks first (before the attach: untracked), says "ready", waits for
 *                     a byte, frees them and allocates 100 bytes, says "allocated", waits for another byte.
 * Talks through write(2) only. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *volatile blocks[3];
static void *volatile small;

/* Says `word` (write(2) only) and waits for a byte on stdin. */
static void step(const char *word)
{
    char c;
    if (write(1, word, strlen(word)) < 0 || read(0, &c, 1) < 0)
        exit(1);
}

static void allocate(void)
{
    for (int i = 0; i < 3; i++)
        blocks[i] = malloc(5000);
}

int main(int argc, char **argv)
{
    int leave = argc > 1 && strcmp(argv[1], "leave") == 0;
    if (!leave)
        allocate();
    step("ready\n");
    if (leave) {
        allocate();
    } else {
        for (int i = 0; i < 3; i++)
            free(blocks[i]);
        small = malloc(100);
    }
    step("allocated\n");
    return 0;
}
