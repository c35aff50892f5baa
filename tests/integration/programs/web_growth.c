/*
 * web_growth: a program with a known growth, for the web page's tests, driven by lines on stdin.
 *
 *   start:  allocates 8 x 2000 B in keep_site (held), says "ready", waits for a line.
 *   line 1: allocates 40 x 25000 B in grow_site (held): the known growth, 1,000,000 B; says "grown".
 *   EOF:    exits.
 *
 * No stdio: write(2) only, so the only heap activity is the known allocations.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

static void *kept[8];
static void *grown[40];

static void say(const char *s) { (void)!write(1, s, strlen(s)); }

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

static NOINLINE void keep_site(void)
{
    for (int i = 0; i < 8; i++) {
        kept[i] = malloc(2000);
        memset(kept[i], 1, 2000);
    }
}

static NOINLINE void grow_site(void)
{
    for (int i = 0; i < 40; i++) {
        grown[i] = malloc(25000);
        memset(grown[i], 2, 25000);
    }
}

int main(void)
{
    keep_site();
    say("ready\n");
    if (wait_line()) {
        grow_site();
        say("grown\n");
    }
    while (wait_line())
        ;
    return 0;
}
