/* A thread that allocates; its stack passes through start_thread and clone (libc, no frame pointers). */
#include <pthread.h>
#include <stdlib.h>

void *volatile keep[8];

__attribute__((noinline)) void thread_alloc(void)
{
    keep[0] = malloc(3333);
    keep[1] = malloc(4444);
    free(keep[1]);
}

void *worker(void *arg)
{
    (void)arg;
    thread_alloc();
    return 0;
}

int main(void)
{
    pthread_t t;
    keep[2] = malloc(1111);
    if (pthread_create(&t, 0, worker, 0) != 0)
        return 1;
    pthread_join(t, 0);
    keep[3] = malloc(2222);
    return 0;
}
