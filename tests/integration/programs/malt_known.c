/* Known allocator calls for the MALT profile test: every number test_malt.py checks follows from this
 * source. Each function is its own call site (noinline); no stdio. */
#include <pthread.h>
#include <stdlib.h>

int big_table[100];                   /* .bss, 400 bytes */
int small_table[4] = {1, 2, 3, 4};    /* .data, 16 bytes */
__thread long per_thread_total = 5;   /* .tdata, 8 bytes, TLS */
void *volatile keep[16];

__attribute__((noinline)) void churn_100(void)
{
    for (int i = 0; i < 10; i++) {
        void *p = malloc(100);        /* ALLOC_100: 10 x 100 B */
        free(p);                      /* FREE_100: 10 frees of 100 B */
    }
}

__attribute__((noinline)) void zero_size(void)
{
    keep[0] = malloc(0);              /* ZERO: countZeros 1, leaked */
}

__attribute__((noinline)) void realloc_chain(void)
{
    void *r = malloc(10);             /* CHAIN_MALLOC: 10 B */
    r = realloc(r, 20);               /* CHAIN_GROW1: 10 -> 20 */
    r = realloc(r, 40);               /* CHAIN_GROW2: 20 -> 40, leaked */
    keep[1] = r;
}

__attribute__((noinline)) void leak_three(void)
{
    for (int i = 0; i < 3; i++)
        keep[2 + i] = malloc(1000);   /* LEAK: 3 x 1000 B, all leaked */
}

static void *worker(void *arg)
{
    (void)arg;
    for (int i = 0; i < 7; i++)
        free(malloc(64));             /* WORKER: 7 x 64 B on the second thread */
    return 0;
}

int main(void)
{
    churn_100();
    zero_size();
    realloc_chain();
    leak_three();
    pthread_t t;
    if (pthread_create(&t, 0, worker, 0) != 0)
        return 1;
    pthread_join(t, 0);
    per_thread_total += big_table[0] + small_table[3];
    return 0;
}
