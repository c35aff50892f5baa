/* A busy multi-threaded program for attach/detach cycles: every thread checks its own results and counts
 * anything wrong. Nothing here may ever see EINTR (no signal handler is installed) or a wrong result.
 *
 *   sampler_stress PLUGIN
 *
 * Threads: 2 malloc storms (blocks filled with a pattern and checked before free; C++-free, plain C),
 * one each blocked in read(2) on a pipe, nanosleep(2), futex(2) wait, epoll_wait(2); one spinning with
 * the vector registers loaded (AVX2 ymm0-15 where the CPU has it, else SSE xmm0-15) and checking them after
 * every spin; one dlopen/dlclose churn of PLUGIN calling its allocation function.
 * stdin: "exit" ends it. stdout: "ready", then at the end one line of counters and "ok" or "FAILED".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static atomic_int stop;
static atomic_long errors_eintr, errors_other, wrong_heap, wrong_vector, storms, sleeps, spins, churns;
static int block_pipe[2], epoll_pipe[2];
static atomic_int futex_word;
static const char *plugin_path;

static void *storm(void *arg)
{
    uint64_t s = 0x1234567ULL + (uint64_t)(intptr_t)arg;
    enum { SLOTS = 512 };
    unsigned char *blocks[SLOTS] = {0};
    size_t sizes[SLOTS] = {0};
    while (!atomic_load(&stop)) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        unsigned i = (unsigned)(s % SLOTS);
        if (blocks[i]) {
            for (size_t k = 0; k < sizes[i]; k++)
                if (blocks[i][k] != (unsigned char)(i + k))
                    atomic_fetch_add(&wrong_heap, 1);
            free(blocks[i]);
        }
        sizes[i] = 1 + (size_t)((s >> 20) % ((s & 0xff) < 3 ? 200000 : 512));
        blocks[i] = (s & 1) ? malloc(sizes[i]) : calloc(1, sizes[i]);
        if (!blocks[i]) {
            atomic_fetch_add(&errors_other, 1);
            continue;
        }
        for (size_t k = 0; k < sizes[i]; k++)
            blocks[i][k] = (unsigned char)(i + k);
        if ((s & 0xfff) == 0) {
            unsigned char *r = realloc(blocks[i], sizes[i] * 2);
            if (r) {
                blocks[i] = r;
                for (size_t k = sizes[i]; k < sizes[i] * 2; k++)
                    blocks[i][k] = (unsigned char)(i + k);
                sizes[i] *= 2;
            }
        }
        atomic_fetch_add(&storms, 1);
    }
    for (unsigned i = 0; i < SLOTS; i++)
        free(blocks[i]);
    return NULL;
}

static void count_error(long r)
{
    if (r < 0 && errno == EINTR)
        atomic_fetch_add(&errors_eintr, 1);
    else if (r < 0)
        atomic_fetch_add(&errors_other, 1);
}

static void *reader(void *arg)
{
    (void)arg;
    char c;
    long r = read(block_pipe[0], &c, 1); /* one byte arrives only at exit */
    count_error(r);
    if (r == 1 && c != 'x')
        atomic_fetch_add(&errors_other, 1);
    return NULL;
}

static void *sleeper(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        count_error(nanosleep(&ts, NULL));
        atomic_fetch_add(&sleeps, 1);
    }
    return NULL;
}

static void *futex_waiter(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        long r = syscall(SYS_futex, &futex_word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        if (r < 0 && errno == EAGAIN) /* the word changed: the program is ending */
            continue;
        count_error(r);
    }
    return NULL;
}

static void *epoller(void *arg)
{
    (void)arg;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    epoll_ctl(ep, EPOLL_CTL_ADD, epoll_pipe[0], &ev);
    struct epoll_event got;
    long r = epoll_wait(ep, &got, 1, -1);
    count_error(r);
    close(ep);
    return NULL;
}

static int has_avx2;

/* Load 16 vector registers from `in`, spin, store them to `out`; any change is a corruption. */
static void vector_spin(const unsigned char *in, unsigned char *out, long n)
{
    if (has_avx2) {
        __asm__ volatile(
            "vmovdqu 0(%0), %%ymm0\n vmovdqu 32(%0), %%ymm1\n vmovdqu 64(%0), %%ymm2\n vmovdqu 96(%0), %%ymm3\n"
            "vmovdqu 128(%0), %%ymm4\n vmovdqu 160(%0), %%ymm5\n vmovdqu 192(%0), %%ymm6\n vmovdqu 224(%0), %%ymm7\n"
            "vmovdqu 256(%0), %%ymm8\n vmovdqu 288(%0), %%ymm9\n vmovdqu 320(%0), %%ymm10\n vmovdqu 352(%0), %%ymm11\n"
            "vmovdqu 384(%0), %%ymm12\n vmovdqu 416(%0), %%ymm13\n vmovdqu 448(%0), %%ymm14\n vmovdqu 480(%0), %%ymm15\n"
            "1: dec %2\n jnz 1b\n"
            "vmovdqu %%ymm0, 0(%1)\n vmovdqu %%ymm1, 32(%1)\n vmovdqu %%ymm2, 64(%1)\n vmovdqu %%ymm3, 96(%1)\n"
            "vmovdqu %%ymm4, 128(%1)\n vmovdqu %%ymm5, 160(%1)\n vmovdqu %%ymm6, 192(%1)\n vmovdqu %%ymm7, 224(%1)\n"
            "vmovdqu %%ymm8, 256(%1)\n vmovdqu %%ymm9, 288(%1)\n vmovdqu %%ymm10, 320(%1)\n vmovdqu %%ymm11, 352(%1)\n"
            "vmovdqu %%ymm12, 384(%1)\n vmovdqu %%ymm13, 416(%1)\n vmovdqu %%ymm14, 448(%1)\n vmovdqu %%ymm15, 480(%1)\n"
            "vzeroupper\n"
            : "+r"(in), "+r"(out), "+r"(n)
            :
            : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
              "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    } else {
        __asm__ volatile(
            "movdqu 0(%0), %%xmm0\n movdqu 16(%0), %%xmm1\n movdqu 32(%0), %%xmm2\n movdqu 48(%0), %%xmm3\n"
            "movdqu 64(%0), %%xmm4\n movdqu 80(%0), %%xmm5\n movdqu 96(%0), %%xmm6\n movdqu 112(%0), %%xmm7\n"
            "movdqu 128(%0), %%xmm8\n movdqu 144(%0), %%xmm9\n movdqu 160(%0), %%xmm10\n movdqu 176(%0), %%xmm11\n"
            "movdqu 192(%0), %%xmm12\n movdqu 208(%0), %%xmm13\n movdqu 224(%0), %%xmm14\n movdqu 240(%0), %%xmm15\n"
            "1: dec %2\n jnz 1b\n"
            "movdqu %%xmm0, 0(%1)\n movdqu %%xmm1, 16(%1)\n movdqu %%xmm2, 32(%1)\n movdqu %%xmm3, 48(%1)\n"
            "movdqu %%xmm4, 64(%1)\n movdqu %%xmm5, 80(%1)\n movdqu %%xmm6, 96(%1)\n movdqu %%xmm7, 112(%1)\n"
            "movdqu %%xmm8, 128(%1)\n movdqu %%xmm9, 144(%1)\n movdqu %%xmm10, 160(%1)\n movdqu %%xmm11, 176(%1)\n"
            "movdqu %%xmm12, 192(%1)\n movdqu %%xmm13, 208(%1)\n movdqu %%xmm14, 224(%1)\n movdqu %%xmm15, 240(%1)\n"
            : "+r"(in), "+r"(out), "+r"(n)
            :
            : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
              "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    }
}

static void *vectors(void *arg)
{
    (void)arg;
    unsigned char in[512], out[512];
    uint64_t s = 77;
    size_t len = has_avx2 ? 512 : 256;
    while (!atomic_load(&stop)) {
        for (size_t k = 0; k < len; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            in[k] = (unsigned char)s;
        }
        vector_spin(in, out, 2000000);
        if (memcmp(in, out, len) != 0)
            atomic_fetch_add(&wrong_vector, 1);
        atomic_fetch_add(&spins, 1);
    }
    return NULL;
}

static void *churn(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        void *h = dlopen(plugin_path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            atomic_fetch_add(&errors_other, 1);
            continue;
        }
        void *(*alloc)(size_t) = (void *(*)(size_t))dlsym(h, "plugin_alloc");
        if (alloc)
            free(alloc(100));
        dlclose(h);
        atomic_fetch_add(&churns, 1);
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    plugin_path = argv[1];
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
    if (pipe(block_pipe) || pipe(epoll_pipe))
        return 3;
    pthread_t th[9];
    int n = 0;
    pthread_create(&th[n++], NULL, storm, (void *)1);
    pthread_create(&th[n++], NULL, storm, (void *)2);
    pthread_create(&th[n++], NULL, reader, NULL);
    pthread_create(&th[n++], NULL, sleeper, NULL);
    pthread_create(&th[n++], NULL, futex_waiter, NULL);
    pthread_create(&th[n++], NULL, epoller, NULL);
    pthread_create(&th[n++], NULL, vectors, NULL);
    pthread_create(&th[n++], NULL, churn, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[64];
    while (fgets(line, sizeof line, stdin) && strncmp(line, "exit", 4) != 0) {
    }
    if (ferror(stdin))
        atomic_fetch_add(&errors_other, 1);
    atomic_store(&stop, 1);
    atomic_store(&futex_word, 1);
    syscall(SYS_futex, &futex_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    if (write(block_pipe[1], "x", 1) != 1 || write(epoll_pipe[1], "x", 1) != 1)
        atomic_fetch_add(&errors_other, 1);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    long bad = atomic_load(&errors_eintr) + atomic_load(&errors_other) + atomic_load(&wrong_heap) +
               atomic_load(&wrong_vector);
    printf("eintr=%ld other=%ld wrong_heap=%ld wrong_vector=%ld storms=%ld sleeps=%ld spins=%ld churns=%ld avx2=%d\n",
           atomic_load(&errors_eintr), atomic_load(&errors_other), atomic_load(&wrong_heap),
           atomic_load(&wrong_vector), atomic_load(&storms), atomic_load(&sleeps), atomic_load(&spins),
           atomic_load(&churns), has_avx2);
    printf(bad ? "FAILED\n" : "ok\n");
    return bad ? 1 : 0;
}
