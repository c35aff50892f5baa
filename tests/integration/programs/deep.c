/* Allocations deep in a recursion. A function calling itself from one line puts all those frames at one
 * return address: Massif's --depth still counts each call. With an argument the program says "allocated"
 * and waits for a line on stdin before it frees, so that a daemon can be asked for its state. */
#include <stdio.h>
#include <stdlib.h>

void *volatile keep[100];

static void descend(int level, int target)
{
    if (level == target) {
        keep[target] = malloc(1000 + target); /* LEAF */
        return;
    }
    descend(level + 1, target); /* RECURSE */
}

int main(int argc, char **argv)
{
    (void)argv;
    descend(0, 40); /* 41 calls of descend + main: Massif's tree keeps 30, its xtree all 42 */
    descend(0, 58); /* 59 + main: within Massif's capture of --depth + 49 frames, and our walk of 64 */
    descend(0, 5);
    if (argc > 1) {
        puts("allocated");
        fflush(stdout);
        getchar();
    }
    free(keep[5]);
    return 0;
}
