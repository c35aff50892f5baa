/* Known bytes per call site, for sampled mode's estimates and exact mode's Massif comparison.
 *
 * Usage: modes_sites [SCALE [wait [threaded]]]. With `wait` it says "ready" and waits for a line on stdin before
 * allocating (so heapscope can attach first), then says "allocated" and waits for another line before it
 * frees site_churn's blocks and exits; without it, it runs straight through.
 *
 * Live at the end, for SCALE s (the default 1): site_small 40000*s blocks of 16..112 bytes (cycling, mean 64),
 * site_medium 2500*s blocks of 1000..1499 bytes (cycling, mean 1249.5), site_calloc 3000*s callocs of
 * 10 x 64 bytes, site_large 4*s blocks of 262144 bytes (at or above a rate of 262144: always sampled).
 * site_churn allocates and frees 20000*s blocks of 256 bytes along the way (none live at the end). A second
 * thread does site_medium's share, so hooks in two threads are exercised. With `threaded` an idle thread is
 * started before "ready": a process with threads when heapscope attaches.
 * Before exit it prints "site NAME BYTES" for each site's live bytes: the truth the tests compare with. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static long scale = 1;
static void *keep[1 << 22];
static long kept;

static void hold(void *p)
{
    if (!p) {
        perror("alloc");
        exit(1);
    }
    keep[kept++] = p;
}

__attribute__((noinline)) static long site_small(void)
{
    long bytes = 0;
    for (long i = 0; i < 40000 * scale; i++) {
        size_t n = 16 + (i % 7) * 16;
        hold(malloc(n));
        bytes += n;
    }
    return bytes;
}

static long medium_bytes;
__attribute__((noinline)) static void *site_medium(void *arg)
{
    (void)arg;
    for (long i = 0; i < 2500 * scale; i++) {
        size_t n = 1000 + (i % 500);
        void *p = malloc(n);
        if (!p)
            exit(1);
        ((void **)arg)[i] = p;
        medium_bytes += n;
    }
    return NULL;
}

__attribute__((noinline)) static long site_calloc(void)
{
    long bytes = 0;
    for (long i = 0; i < 3000 * scale; i++) {
        hold(calloc(10, 64));
        bytes += 640;
    }
    return bytes;
}

__attribute__((noinline)) static long site_large(void)
{
    long bytes = 0;
    for (long i = 0; i < 4 * scale; i++) {
        hold(malloc(262144));
        bytes += 262144;
    }
    return bytes;
}

__attribute__((noinline)) static void site_churn(void)
{
    for (long i = 0; i < 20000 * scale; i++) {
        char *p = malloc(256);
        if (!p)
            exit(1);
        p[0] = (char)i;
        free(p);
    }
}

static void wait_line(const char *say)
{
    char line[64];
    printf("%s\n", say);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        exit(2);
}

static void *idle(void *arg)
{
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        scale = atol(argv[1]);
    int waits = argc > 2 && strcmp(argv[2], "wait") == 0;
    pthread_t idler;
    if (argc > 3 && strcmp(argv[3], "threaded") == 0 && pthread_create(&idler, NULL, idle, NULL) != 0)
        return 1;
    if (waits)
        wait_line("ready");
    void **medium = malloc(sizeof(void *) * 2500 * scale);
    pthread_t t;
    if (!medium || pthread_create(&t, NULL, site_medium, medium) != 0)
        return 1;
    long small = site_small();
    site_churn();
    long cal = site_calloc();
    long large = site_large();
    pthread_join(t, NULL);
    if (waits)
        wait_line("allocated");
    printf("site site_small %ld\nsite site_medium %ld\nsite site_calloc %ld\nsite site_large %ld\n", small,
           medium_bytes, cal, large);
    fflush(stdout);
    return 0;
}
