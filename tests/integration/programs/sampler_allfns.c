/* Every C allocation function once, each with 1 MiB (at or above the test's rate: always sampled).
 *
 *   sampler_allfns SAMPLER
 *
 * dlopens SAMPLER, prints "ready", waits for "go", then allocates through malloc, calloc, realloc (NULL),
 * realloc (growing the malloc'd block), reallocarray, posix_memalign, aligned_alloc, memalign, valloc and
 * pvalloc, printing "NAME 0xADDR" for each block (for the growing realloc, "realloc_old" too), frees all,
 * prints "done" and waits for "exit". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1 << 20)

int main(int argc, char **argv)
{
    if (argc < 2 || !dlopen(argv[1], RTLD_NOW | RTLD_NODELETE))
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[32];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0)
        return 3;
    void *blocks[16];
    int n = 0;
    void *m = malloc(MIB);
    printf("malloc %p\n", m);
    blocks[n] = calloc(1, MIB);
    printf("calloc %p\n", blocks[n++]);
    blocks[n] = realloc(NULL, MIB);
    printf("realloc_null %p\n", blocks[n++]);
    printf("realloc_old %p\n", m);
    blocks[n] = realloc(m, 4 * MIB);
    printf("realloc %p\n", blocks[n++]);
    blocks[n] = reallocarray(NULL, 1024, 1024);
    printf("reallocarray %p\n", blocks[n++]);
    void *pm = NULL;
    if (posix_memalign(&pm, 4096, MIB) != 0)
        return 4;
    blocks[n] = pm;
    printf("posix_memalign %p\n", blocks[n++]);
    blocks[n] = aligned_alloc(4096, MIB);
    printf("aligned_alloc %p\n", blocks[n++]);
    blocks[n] = memalign(4096, MIB);
    printf("memalign %p\n", blocks[n++]);
    blocks[n] = valloc(MIB);
    printf("valloc %p\n", blocks[n++]);
    blocks[n] = pvalloc(MIB);
    printf("pvalloc %p\n", blocks[n++]);
    for (int i = 0; i < n; i++)
        free(blocks[i]);
    printf("done\n");
    return fgets(line, sizeof line, stdin) ? 0 : 5;
}
