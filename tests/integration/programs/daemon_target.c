/*
 * daemon_target: a long-running service for the daemon tests, driven by lines on stdin.
 *
 *   start: says "ready", then waits for a line.
 *   line 1: allocates 5 x 1000 B in site_small and 3 x 4000 B in site_big (held), says "allocated".
 *   line 2: frees the site_small blocks, says "freed".
 *   EOF:   exits (the site_big blocks are still live).
 *
 * No stdio: write(2) only, so the only heap activity is the known allocations.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

static void *small[5];
static void *big[3];

static void say(const char *s) { (void)!write(1, s, strlen(s)); }

/* Reads up to a newline; returns 0 at EOF. */
static int wait_line(void)
{
    char c;
    for (;;) {
        ssize_t n = read(0, &c, 1);
        if (n <= 0)
            return 0;
        if (c == '\n')
            return 1;
    }
}

static NOINLINE void site_small(void)
{
    for (int i = 0; i < 5; i++) {
        small[i] = malloc(1000);
        memset(small[i], 1, 1000);
    }
}

static NOINLINE void site_big(void)
{
    for (int i = 0; i < 3; i++) {
        big[i] = malloc(4000);
        memset(big[i], 2, 4000);
    }
}

int main(void)
{
    say("ready\n");
    if (!wait_line())
        return 0;
    site_small();
    site_big();
    say("allocated\n");
    if (!wait_line())
        return 0;
    for (int i = 0; i < 5; i++)
        free(small[i]);
    say("freed\n");
    while (wait_line())
        ;
    return 0;
}
