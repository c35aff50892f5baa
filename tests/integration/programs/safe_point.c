/*
 * safe_point: threads where sampled mode's injection must and must not run, for the safe-point tests.
 *
 *   safe_point stale    one thread, blocked in pause() under a frame whose dead slots hold pointers into
 *                       malloc (left there by an earlier call at the same depth, as the fork that made an
 *                       nginx worker left one): safe, though a scan of every stack word says otherwise.
 *   safe_point locked   every thread inside the allocator: one in malloc_stats(), which holds the main arena's
 *                       lock while it writes to stderr, a pipe made full first; the main thread in malloc(),
 *                       waiting for that lock. Once the pipe is read, both go on and the main thread waits in
 *                       pause(): safe.
 *
 * Prints "ready" (stdout) once the threads are where they should be, "unlocked" when malloc has returned.
 */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 128

static __attribute__((noinline)) void leave_stale_pointers(void)
{
    void *volatile slots[SLOTS];
    for (int i = 0; i < SLOTS; i++)
        slots[i] = (char *)(void *)malloc + 16; /* inside malloc, as a return address would be */
    __asm__ volatile("" : : "r"(slots) : "memory");
}

static __attribute__((noinline)) void wait_here(void)
{
    char unused[SLOTS * sizeof(void *)]; /* over the slots above, never written */
    __asm__ volatile("" : : "r"(unused) : "memory");
    for (;;)
        pause();
}

static void *stats(void *arg)
{
    (void)arg;
    malloc_stats(); /* holds the main arena's lock while its fprintf blocks on the full pipe */
    return NULL;
}

static void fill_stderr(void)
{
    int flags = fcntl(2, F_GETFL);
    char block[4096];
    memset(block, '.', sizeof block);
    fcntl(2, F_SETFL, flags | O_NONBLOCK);
    while (write(2, block, sizeof block) > 0 || errno == EINTR)
        ;
    fcntl(2, F_SETFL, flags);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "locked") == 0) {
        free(malloc(64)); /* the main arena exists */
        fill_stderr();
        pthread_t t;
        pthread_create(&t, NULL, stats, NULL);
        usleep(200 * 1000); /* stats() is in its fprintf, the lock held */
        write(1, "ready\n", 6); /* not printf: its first use of stdout would malloc a buffer */
        void *p = malloc(100000); /* not from the thread cache: the arena, and its lock */
        printf("unlocked %p\n", p);
        fflush(stdout);
        pthread_join(t, NULL);
        wait_here();
    }
    printf("ready\n"); /* first: printf's own frames would overwrite the slots */
    fflush(stdout);
    leave_stale_pointers();
    wait_here();
    return 0;
}
