/* A single-threaded program for a sampler that runs without a thread of its own (the test starts it at its
 * RLIMIT_NPROC). One word a line on stdin/stdout: it prints "ready"; on "alloc" it allocates BLOCKS blocks of
 * BLOCK bytes at site_block and keeps them ("allocated"); on "free" it frees them ("freed"); on "exit" it exits
 * with status 7. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCKS 20000
#define BLOCK 1000

static void *blocks[BLOCKS];

__attribute__((noinline)) void *site_block(size_t n)
{
    return malloc(n);
}

int main(void)
{
    char word[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(word, sizeof word, stdin)) {
        if (strcmp(word, "alloc\n") == 0) {
            for (int i = 0; i < BLOCKS; i++)
                blocks[i] = site_block(BLOCK);
            printf("allocated\n");
        } else if (strcmp(word, "free\n") == 0) {
            for (int i = 0; i < BLOCKS; i++)
                free(blocks[i]);
            printf("freed\n");
        } else if (strcmp(word, "exit\n") == 0) {
            return 7;
        }
    }
    return 1;
}
