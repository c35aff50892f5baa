/* Reports the size of its main heap's top chunk (glibc's mallinfo2 keepcost) at each line it reads: how much of
 * the heap the program's own threads allocate from an injection took.
 *
 *   main_heap    prints "ready", then "top N" for every line read, until end of input. */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    void *kept[32]; /* a heap with something in it, as a service's has */
    for (int i = 0; i < 32; i++)
        kept[i] = malloc(64 + 48 * (size_t)i);
    char line[64];
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        struct mallinfo2 m = mallinfo2();
        printf("top %zu\n", m.keepcost);
    }
    for (int i = 0; i < 32; i++)
        free(kept[i]);
    return 0;
}
