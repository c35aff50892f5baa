/* heap_trim.c: malloc's heap top grown and trimmed again and again, as a server's glibc does at each request: blocks
 * below the mmap threshold come from brk, and freeing them all gives the top back (M_TRIM_THRESHOLD). Once, in the
 * middle, the heap grows four times higher: the peak of the mapped total, which no tick need see.
 * Usage: heap_trim CYCLES (default 2000) */
#include <stdlib.h>
#include <string.h>

#define BLOCK 100000 /* under the mmap threshold: from the break */
#define BLOCKS 80    /* 8 MB a cycle */

static void *blocks[4 * BLOCKS];

int main(int argc, char **argv)
{
    long cycles = argc > 1 ? atol(argv[1]) : 2000;
    for (long c = 0; c < cycles; c++) {
        int n = c == cycles / 2 ? 4 * BLOCKS : BLOCKS;
        for (int i = 0; i < n; i++) {
            blocks[i] = malloc(BLOCK);
            if (!blocks[i])
                return 1;
            memset(blocks[i], 1, 64);
        }
        for (int i = n - 1; i >= 0; i--)
            free(blocks[i]);
    }
    return 0;
}
