/*
 * sampler_hooks: the cost of the sampler's hooks alone, armed against disarmed in one process.
 *
 *   sampler_hooks PAIRS      reads a line per round from stdin, runs PAIRS malloc/free pairs (sizes 16..2063 B,
 *                            4096 live slots, as churn.c), prints the loop's nanoseconds per pair
 *
 * Driven by bench/sampler_cost.py --hooks, which injects the sampler once and alternates armed and disarmed
 * rounds: the process has the same threads in both, so the difference is the hooks' own cost (and the
 * kernel's, on the sampled calls, when a probe is attached).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    long pairs = argc > 1 ? atol(argv[1]) : 2000000;
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        double start = now();
        for (long i = 0; i < pairs; i++) {
            uint64_t r = next_random();
            unsigned slot = (unsigned)(r % SLOTS);
            free(slots[slot]);
            slots[slot] = malloc(MIN_SIZE + (size_t)((r >> 32) % SIZE_SPAN));
        }
        double elapsed = now() - start;
        printf("%.3f\n", elapsed / (double)pairs * 1e9);
    }
    return 0;
}
