/* A target for `heapscope attach`: allocates before the attach, says "ready", waits on stdin, then allocates
 * known amounts at known sites and frees two of the blocks it allocated before the attach.
 * With argument "hold" it waits on stdin a second time, so the profiler can detach first, then allocates more.
 * Talks through write(2) only: no stdio. Exits with status 7 so the test can tell a normal exit. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

void *volatile before[3];
void *volatile after[8];

static void say(const char *s)
{
    ssize_t r = write(1, s, strlen(s));
    (void)r;
}

static void wait_for_byte(void)
{
    char c;
    ssize_t r = read(0, &c, 1);
    (void)r;
}

NOINLINE void site_loop(void)
{
    for (int i = 0; i < 4; i++)
        after[i] = malloc(1111);
}

NOINLINE void site_single(void)
{
    after[4] = malloc(2222);
}

NOINLINE void site_freed(void)
{
    after[5] = malloc(3333);
    free(after[5]);
}

int main(int argc, char **argv)
{
    for (int i = 0; i < 3; i++)
        before[i] = malloc(5000);
    say("ready\n");
    wait_for_byte();

    site_loop();
    site_single();
    site_freed();
    free(before[0]);
    free(before[1]);
    say("allocated\n");

    if (argc > 1 && strcmp(argv[1], "hold") == 0) {
        wait_for_byte();
        /* Keep allocating after the profiler has gone: a probe left behind would show here. */
        for (int i = 0; i < 10000; i++)
            free(malloc(64 + i % 512));
    }
    say("done\n");
    return 7;
}
