/*
 * churn: malloc/free pairs as fast as the allocator goes; the cost a heap profiler adds per call.
 *
 *   churn [PAIRS]      default 2,000,000 malloc/free pairs, sizes 16..2063 B, 4096 live slots
 *
 * Every iteration frees the block in a random slot (if any) and puts a new block there; the blocks
 * still live at the end are freed after the loop, so mallocs and frees are exactly PAIRS each.
 * The PRNG is fixed-seed xorshift64*, so every run and every tool sees the same calls.
 *
 * Environment:
 *   CHURN_TIME_FILE  write the loop's own elapsed seconds there (the process start, a profiler's
 *                    attach and its teardown are not part of it)
 *   CHURN_GATE       path of a FIFO: block on it before the loop, until someone writes a byte.
 *                    This lets a tool that attaches to a running PID (memleak -p) attach first.
 *   CHURN_DEPTH      run the loop this many calls deep (default 0): every malloc and free then has a
 *                    stack of about CHURN_DEPTH + 3 frames, to measure what a profiler's stack walk costs.
 *   CHURN_MMAP       1: each pair is an munmap and an mmap of 1..16 anonymous pages instead (the same
 *                    slots and random sequence): what tracing the page system calls costs.
 *   CHURN_WARMUP     N: before the timed loop, N untimed pairs and a 2 s pause: a profiler's one-time work
 *                    at its first calls (symbolizing their stacks) is then done before the loop, which
 *                    measures the steady cost per call (the same calls, so the loop is still PAIRS pairs).
 *   CHURN_THREAD     1: start an idle second thread before the loop. glibc's malloc then takes its arena
 *                    lock, as in any multi-threaded service (and in any process sampled mode's sampler,
 *                    with its control thread, is in): the native baseline of that case.
 *
 * Prints nothing; no stdio (its buffers would be allocations outside the loop).
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum { SLOTS = 4096, MIN_SIZE = 16, SIZE_SPAN = 2048 };

static void *slots[SLOTS];

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t next_random(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void wait_for_gate(const char *path)
{
    char byte;
    int fd = open(path, O_RDONLY); /* blocks until a writer opens the FIFO */
    if (fd < 0)
        _exit(2);
    while (read(fd, &byte, 1) < 0)
        ;
    close(fd);
}

/* Seconds as text without stdio: whole microseconds are enough. */
static void write_seconds(const char *path, double seconds)
{
    char buf[32];
    uint64_t us = (uint64_t)(seconds * 1e6 + 0.5);
    uint64_t whole = us / 1000000, frac = us % 1000000;
    char digits[24];
    int n = 0, len = 0;
    do {
        digits[n++] = (char)('0' + whole % 10);
        whole /= 10;
    } while (whole);
    while (n)
        buf[len++] = digits[--n];
    buf[len++] = '.';
    for (uint64_t div = 100000; div; div /= 10)
        buf[len++] = (char)('0' + frac / div % 10);
    buf[len++] = '\n';

    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        _exit(3);
    if (write(fd, buf, (size_t)len) != len)
        _exit(3);
    close(fd);
}

static void churn(long pairs)
{
    for (long i = 0; i < pairs; i++) {
        uint64_t r = next_random();
        size_t slot = (size_t)(r >> 32) % SLOTS;
        size_t size = MIN_SIZE + (size_t)(r % SIZE_SPAN);
        if (slots[slot])
            free(slots[slot]);
        char *p = malloc(size);
        p[0] = (char)i; /* touch it: the block is really used */
        slots[slot] = p;
    }
    for (size_t s = 0; s < SLOTS; s++) {
        if (slots[s])
            free(slots[s]);
        slots[s] = NULL; /* the timed loop after a warm-up starts empty too */
    }
}

/* The same loop with page mappings: 1..16 pages, the first byte touched. */
static void churn_pages(long pairs)
{
    static size_t lengths[SLOTS];
    for (long i = 0; i < pairs; i++) {
        uint64_t r = next_random();
        size_t slot = (size_t)(r >> 32) % SLOTS;
        size_t length = (1 + (size_t)(r % 16)) * 4096;
        if (slots[slot])
            munmap(slots[slot], lengths[slot]);
        char *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            _exit(4);
        p[0] = (char)i;
        slots[slot] = p;
        lengths[slot] = length;
    }
    for (size_t s = 0; s < SLOTS; s++) {
        if (slots[s])
            munmap(slots[s], lengths[s]);
        slots[s] = NULL;
    }
}

static int page_mode;

/* Recursion the compiler may not flatten: the volatile depth keeps every level a real call. */
__attribute__((noinline)) static void descend(volatile int depth, long pairs)
{
    if (depth > 0)
        descend(depth - 1, pairs);
    else if (page_mode)
        churn_pages(pairs);
    else
        churn(pairs);
    __asm__ volatile("" ::: "memory"); /* no tail call: each level keeps its frame */
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
    long pairs = argc > 1 ? atol(argv[1]) : 2000000L;
    const char *time_file = getenv("CHURN_TIME_FILE");
    const char *gate = getenv("CHURN_GATE");
    const char *depth = getenv("CHURN_DEPTH");
    const char *pages = getenv("CHURN_MMAP");
    page_mode = pages && *pages == '1';
    const char *thread = getenv("CHURN_THREAD");
    pthread_t idler;
    if (thread && *thread == '1' && pthread_create(&idler, NULL, idle, NULL) != 0)
        return 3;

    if (gate && *gate)
        wait_for_gate(gate);

    const char *warmup = getenv("CHURN_WARMUP");
    if (warmup && atol(warmup) > 0) {
        descend(depth ? atoi(depth) : 0, atol(warmup));
        struct timespec pause = {2, 0};
        nanosleep(&pause, NULL);
    }

    double start = now_seconds();
    descend(depth ? atoi(depth) : 0, pairs);
    double elapsed = now_seconds() - start;

    if (time_file && *time_file)
        write_seconds(time_file, elapsed);
    return 0;
}
