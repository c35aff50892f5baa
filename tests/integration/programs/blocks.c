/* blocks COUNT SIZE GROW: allocate COUNT blocks of SIZE bytes and keep them all; if GROW is 1, realloc each
 * to 2 * SIZE; then free them all. The live total only grows until the frees begin, so the peak is
 * COUNT * SIZE (or COUNT * 2 * SIZE with GROW) and the end state is empty. Blocks of 1000 bytes lie 1 KiB
 * apart, which puts them all in one bucket of a small block table: the test of the overflow table. */
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int count = atoi(argv[1]);
    size_t size = (size_t)atol(argv[2]);
    int grow = atoi(argv[3]);
    void **keep = calloc((size_t)count, sizeof(void *));
    if (!keep)
        return 1;
    for (int i = 0; i < count; i++)
        keep[i] = malloc(size);
    if (grow)
        for (int i = 0; i < count; i++)
            keep[i] = realloc(keep[i], 2 * size);
    for (int i = count - 1; i >= 0; i--)
        free(keep[i]);
    free(keep);
    return 0;
}
