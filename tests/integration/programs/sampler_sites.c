/* Known bytes per call site, for the in-process sampler's estimates.
 *
 *   sampler_sites LOG [LIBRARY]
 *
 * With LIBRARY it dlopens the sampler itself (no LD_PRELOAD); without, the test injects it. Then it talks
 * over stdin/stdout, one word a line: it prints "ready", waits for "go", allocates through four sites from
 * two threads and keeps every block, writes LOG (one record per block: address, site, size), prints
 * "allocated"; on "free" it frees every block of site 0 and prints "freed"; on "exit" it exits.
 * Sizes come from a fixed-seed generator, so a run's bytes per site are known from LOG alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 2
#define PER_THREAD 200000

struct record {
    uint64_t ptr;
    uint32_t site;
    uint32_t size;
};

static struct record *records[THREADS];
static size_t counts[THREADS];

static uint64_t next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Four sites, each its own call of an allocation function, holding about 28/37/24/11 % of the bytes. */
static __attribute__((noinline)) void *site_tiny(size_t n) { return malloc(n); }
static __attribute__((noinline)) void *site_medium(size_t n) { return malloc(n); }
static __attribute__((noinline)) void *site_large(size_t n) { return malloc(n); }
static __attribute__((noinline)) void *site_calloc(size_t n) { return calloc(1, n); }

static void *worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    uint64_t s = 0x9E3779B97F4A7C15ULL * (uint64_t)(t + 1);
    struct record *r = records[t];
    size_t k = 0;
    for (int i = 0; i < PER_THREAD; i++) {
        uint64_t x = next(&s);
        uint32_t site, size;
        void *p;
        unsigned pick = (unsigned)(x % 1000);
        if (pick < 800) { /* 80% of calls, ~28% of bytes */
            site = 0;
            size = 16 + (uint32_t)((x >> 12) % 112);
            p = site_tiny(size);
        } else if (pick < 815) { /* 1.5% of calls, ~37% of bytes */
            site = 1;
            size = 2048 + (uint32_t)((x >> 12) % 6144);
            p = site_medium(size);
        } else if (pick < 817) { /* 0.2% of calls, ~24% of bytes */
            site = 2;
            size = 16384 + (uint32_t)((x >> 12) % 16384);
            p = site_large(size);
        } else { /* 18.3% of calls, ~11% of bytes */
            site = 3;
            size = 24 + (uint32_t)((x >> 12) % 200);
            p = site_calloc(size);
        }
        if (!p)
            abort();
        r[k++] = (struct record){(uint64_t)(uintptr_t)p, site, size};
    }
    counts[t] = k;
    return NULL;
}

static int expect(const char *word)
{
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 0;
    line[strcspn(line, "\n")] = 0;
    return strcmp(line, word) == 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    if (argc > 2 && !dlopen(argv[2], RTLD_NOW | RTLD_NODELETE)) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    for (int t = 0; t < THREADS; t++)
        records[t] = calloc(PER_THREAD, sizeof(struct record));
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    if (!expect("go"))
        return 4;
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++)
        pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t);
    for (int t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    FILE *log = fopen(argv[1], "wb");
    for (int t = 0; t < THREADS; t++)
        fwrite(records[t], sizeof(struct record), counts[t], log);
    fclose(log);
    printf("allocated\n");
    if (!expect("free"))
        return 5;
    for (int t = 0; t < THREADS; t++)
        for (size_t i = 0; i < counts[t]; i++)
            if (records[t][i].site == 0)
                free((void *)(uintptr_t)records[t][i].ptr);
    printf("freed\n");
    if (!expect("exit"))
        return 6;
    return 0;
}
