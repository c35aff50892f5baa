/* stacks.c: known stack depths at allocator calls, for --stacks=yes (tests/integration/test_pages.py).
 *
 * A thread goes THREAD_DEEP bytes down its stack and calls malloc there; then main goes MAIN_DEEP bytes
 * down its own and calls malloc there; both stay deep for HOLD_US while heapscope samples. Then both come
 * back up, the thread ends, and main calls malloc from main() and holds again. The stacks are measured
 * from each thread's first stack pointer (Massif: the main stack starts at zero), so the deep phase shows
 * about MAIN_DEEP + THREAD_DEEP and the end about nothing.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAIN_DEEP (256 * 1024)
#define THREAD_DEEP (128 * 1024)
#define HOLD_US 600000

static pthread_barrier_t both_deep, both_done;
static volatile char sink;

/* Uses `depth` bytes of stack, calls malloc from there and waits there. */
__attribute__((noinline)) static void go_deep(size_t depth, pthread_barrier_t *deep)
{
    char *frame = __builtin_alloca(depth);
    memset(frame, 1, depth); /* touch it: the stack really is this deep */
    free(malloc(16));
    pthread_barrier_wait(deep);
    usleep(HOLD_US);
    sink = frame[depth / 2];
}

static void *thread_main(void *arg)
{
    (void)arg;
    go_deep(THREAD_DEEP, &both_deep);
    pthread_barrier_wait(&both_done);
    return NULL;
}

int main(void)
{
    pthread_t t;
    free(malloc(16)); /* shallow */
    usleep(HOLD_US);
    pthread_barrier_init(&both_deep, NULL, 2);
    pthread_barrier_init(&both_done, NULL, 2);
    pthread_create(&t, NULL, thread_main, NULL);
    go_deep(MAIN_DEEP, &both_deep);
    pthread_barrier_wait(&both_done);
    pthread_join(t, NULL);
    free(malloc(16)); /* shallow again, the thread gone */
    usleep(HOLD_US);
    return 0;
}
