/*
 * idle_target: a service for bench/daemon_cost.py.
 *
 *   idle_target            allocates a few blocks, says "ready", then sleeps until killed
 *   idle_target busy RATE  says "ready", then allocates and frees RATE blocks a second, in bursts every 10 ms,
 *                          from 64 call sites, holding up to 256 blocks
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

static void *held[256];

static NOINLINE void *site(int i, size_t size)
{
    /* 64 distinct stacks: one return address per branch of the switch */
    switch (i & 63) {
#define S(n) case n: return malloc(size + n);
        S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7) S(8) S(9) S(10) S(11) S(12) S(13) S(14) S(15)
        S(16) S(17) S(18) S(19) S(20) S(21) S(22) S(23) S(24) S(25) S(26) S(27) S(28) S(29) S(30) S(31)
        S(32) S(33) S(34) S(35) S(36) S(37) S(38) S(39) S(40) S(41) S(42) S(43) S(44) S(45) S(46) S(47)
        S(48) S(49) S(50) S(51) S(52) S(53) S(54) S(55) S(56) S(57) S(58) S(59) S(60) S(61) S(62) S(63)
#undef S
    }
    return NULL;
}

int main(int argc, char **argv)
{
    for (int i = 0; i < 8; i++)
        held[i] = site(i, 100);
    (void)!write(1, "ready\n", 6);
    if (argc < 3 || strcmp(argv[1], "busy") != 0) {
        for (;;)
            pause();
    }
    long rate = atol(argv[2]);
    long per_burst = rate / 100 > 0 ? rate / 100 : 1;
    struct timespec tick = {0, 10 * 1000 * 1000};
    unsigned n = 0;
    for (;;) {
        for (long k = 0; k < per_burst; k++, n++) {
            unsigned slot = n % 256;
            free(held[slot]);
            held[slot] = site((int)(n * 7), 32 + n % 1024);
        }
        nanosleep(&tick, NULL);
    }
}
