/* release_target MARKER: allocates, works for a moment, then writes "finished" to MARKER and exits 0.
 * Used to show that a target held at an event runs on to its end when heapscope is killed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *volatile keep[64];

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < 64; i++) {
            free(keep[i]);
            keep[i] = malloc(100 + (size_t)i * 10);
        }
        usleep(10000);
    }
    FILE *f = fopen(argv[1], "w");
    if (!f)
        return 3;
    fputs("finished\n", f);
    return fclose(f) == 0 ? 0 : 4;
}
