/* A steady churn far above sampled mode's budget, for the sampling budget's tests.
 *
 * Usage: budget_churn SECONDS [BYTES_A_SECOND]. Says "ready", waits for a line on stdin, then for SECONDS allocates
 * and frees blocks of 64 KiB in site_churn, paced to BYTES_A_SECOND (default 2 GB: at the default rate of 512 KiB,
 * where about one block in 8.5 is sampled, some 3,600 samples a second without a budget), says "done", then
 * "bytes N" (the bytes it asked for: the truth), and waits for another line before it exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((noinline)) static unsigned long long site_churn(double seconds, double pace)
{
    unsigned long long bytes = 0;
    double start = now(), end = start + seconds;
    struct timespec nap = {0, 100000};
    for (double t = start; t < end; t = now()) {
        if (bytes > pace * (t - start)) { /* ahead of the pace */
            nanosleep(&nap, NULL);
            continue;
        }
        for (int i = 0; i < 64; i++) {
            char *volatile p = malloc(65536);
            if (!p) {
                perror("malloc");
                exit(1);
            }
            p[0] = (char)i;
            free(p);
            bytes += 65536;
        }
    }
    return bytes;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 3.0, pace = argc > 2 ? atof(argv[2]) : 2e9;
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin))
        return 1;
    unsigned long long bytes = site_churn(seconds, pace);
    printf("done\nbytes %llu\n", bytes);
    if (!fgets(line, sizeof line, stdin))
        return 1;
    return 0;
}
