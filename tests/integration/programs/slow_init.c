/* A shared object whose constructor takes 1.5 s: long enough to kill the process that is injecting it. */
#include <time.h>

volatile int slow_init_done;

__attribute__((constructor)) static void slow_init(void)
{
    struct timespec ts = {1, 500 * 1000 * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
    slow_init_done = 1;
}
