/* A single-threaded program for a sampler that runs without a thread of its own (the test starts it at its
 * RLIMIT_NPROC). One word a line on stdin/stdout: it prints "ready"; on "alloc" it allocates BLOCKS blocks of
 * BLOCK bytes at site_block and keeps them ("allocated"); on "free" it frees them ("freed"); on "load" it dlopens
 * the shared object its first argument names ("loaded"), on "plugin" it calls that object's plugin_alloc(BLOCK)
 * BLOCKS times ("plugged"); on "exit" it exits with status 7. */
#include <dlfcn.h>
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

int main(int argc, char **argv)
{
    char word[64];
    void *(*plugin_alloc)(size_t) = NULL;
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
        } else if (strcmp(word, "load\n") == 0 && argc > 1) {
            void *handle = dlopen(argv[1], RTLD_NOW);
            plugin_alloc = handle ? (void *(*)(size_t))dlsym(handle, "plugin_alloc") : NULL;
            printf(plugin_alloc ? "loaded\n" : "not loaded\n");
        } else if (strcmp(word, "plugin\n") == 0 && plugin_alloc) {
            for (int i = 0; i < BLOCKS; i++)
                plugin_alloc(BLOCK);
            printf("plugged\n");
        } else if (strcmp(word, "exit\n") == 0) {
            return 7;
        }
    }
    return 1;
}
