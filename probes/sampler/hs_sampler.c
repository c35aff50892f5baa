/* heapscope's in-process sampler: Poisson sampling by bytes, brought into a running process by dlopen.
 *
 * Once loaded it does nothing until heapscope arms it (hs_sampler.h: the control block). Armed, it points
 * the GOT/PLT slots of malloc and company, in every loaded object, at hooks that count bytes per thread and
 * call the probe functions hs_sample_alloc / hs_sample_free only when a sample is due, or when a sampled
 * block is freed. An eBPF uprobe on those functions takes the stack; unsampled calls never leave the process.
 *
 * Rules this file keeps:
 * - A hook never allocates, never takes a lock, and is re-entrant (a per-thread `busy` flag stops C++
 *   operators from counting the malloc they call; signal handlers only ever pass through).
 * - Only the control thread (created at load, all signals blocked) patches or restores slots, under
 *   patch_lock, inside dl_iterate_phdr (which keeps every listed object mapped). A slot is patched only
 *   when it holds exactly the function dlsym(RTLD_DEFAULT) gives, and restored only when it holds our hook,
 *   so an object bound to another allocator, a half-relocated object, or one loaded again at the same
 *   address is never redirected. A read-only slot is made writable only inside PT_GNU_RELRO, whose pages
 *   the loader has finished with once it made them read-only.
 * - dlopen is not hooked: glibc's dlopen resolves relative names through its caller's RUNPATH and
 *   namespace, which a hook in between would change. The control thread polls the loader's load counter
 *   instead (every 50 ms while armed) and patches new objects.
 * - The lease: heapscope holds the only write end of a pipe (taken with pidfd_getfd). When heapscope exits,
 *   even by SIGKILL, the read end reports POLLHUP and the control thread disarms within one poll period.
 * - A single-threaded process that heapscope injects it into, and a process that can start no thread
 *   (RLIMIT_NPROC, a cgroup's pids.max), run it threadless: heapscope makes
 *   each request by calling hs_sampler_call on one of the program's threads at a safe point (where the control
 *   thread would patch, so may it), and the hooks watch the lease at each sample: its loss makes them pass
 *   everything through (the slots are restored at the next disarm, by a heapscope that calls).
 * - The library is never unloaded (heapscope dlopens it RTLD_NODELETE); arming again reuses it.
 * - Every function that can be on the stack when a probe fires is named hs_*: a stack from hs_sample_alloc
 *   starts with hs_account_slow and an hs_hook_* function, which user space trims as allocation functions.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "hs_sampler.h"

/* The library loads into any glibc from 2.17 on (a test reads its dynamic symbol table): each glibc function it
 * calls is bound to the oldest version that has it, where the build machine's glibc would pick a newer default
 * (2.34 moved dl* and pthread_* into libc). The libraries that held them before 2.34 are linked (libdl,
 * libpthread; empty on newer glibc); getrandom and fstat are made as system calls; libm is not linked at all
 * (the arithmetic of sampling, below). */
#if defined(__GLIBC__)
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_attr_setstacksize,pthread_attr_setstacksize@GLIBC_2.2.5");
__asm__(".symver pthread_sigmask,pthread_sigmask@GLIBC_2.2.5");
#endif

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)
#define ADD(x, v) __atomic_fetch_add(&(x), (v), __ATOMIC_RELAXED)

EXPORT struct hs_sampler_control hs_control = {
    .magic = HS_CONTROL_MAGIC,
    .version = HS_CONTROL_VERSION,
    .state = HS_STATE_LOADING,
    .lease_fd = -1,
};

/* ---- the probe functions ------------------------------------------------------------------------------
 * Each starts with the 5-byte nop (0f 1f 44 00 00) on which Linux 6.18 runs a uprobe through a trampoline
 * instead of a trap. noipa keeps every call (the compiler may not reason about the body); these two have no
 * frame and the build uses -fcf-protection=none, so nothing comes before the nop (checked by a test). The
 * rest of the library keeps frame pointers, so that a frame-pointer walk from a probe reaches the program. */
EXPORT __attribute__((noipa, used, optimize("omit-frame-pointer"))) void hs_sample_alloc(void *ptr, size_t size, size_t weight,
                                                                                     uint64_t fn)
{
    __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" : : "r"(ptr), "r"(size), "r"(weight), "r"(fn) : "memory");
}

EXPORT __attribute__((noipa, used, optimize("omit-frame-pointer"))) void hs_sample_free(void *ptr)
{
    __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" : : "r"(ptr) : "memory");
}

/* ---- per-thread state (initial-exec TLS: one %fs-relative access, no __tls_get_addr) --------------------- */
struct thread_state {
    int64_t remaining;        /* bytes until the next sample; 0 until the thread is seeded */
    uint64_t drawn_at;        /* the rate in force when `remaining` was drawn: its samples' weights */
    uint64_t rng;             /* xorshift64* state, never 0 once seeded */
    struct hs_counts *counts; /* this thread's exact counts; NULL until its first call */
    uint8_t seeded;
    uint8_t busy;          /* inside a hook that calls another hooked function (C++ operators) */
    uint8_t counts_shared; /* counts is the shared last slot: atomic adds */
};
/* initial-exec: one load from %fs in every hook. musl's loader refuses it in a library loaded by dlopen, so its
 * build takes the general model (HS_TLS_MODEL="global-dynamic": a call to __tls_get_addr per hook). */
#ifndef HS_TLS_MODEL
#define HS_TLS_MODEL "initial-exec"
#endif
static __thread struct thread_state tls __attribute__((tls_model(HS_TLS_MODEL)));

#define HS_MAX_RATE ((uint64_t)1 << 40) /* the most bytes between samples: agent/process/sampler.py MAX_RATE */
static uint64_t sample_rate = 524288; /* the rate in force: asked_rate, or more under the budget */
static uint64_t asked_rate = 524288;  /* the profile's rate: the budget never takes the rate below it */
static uint64_t window_start_ns;      /* the budget's window: since when its samples are counted */
static uint64_t window_samples;
static int armed;
static int threadless; /* no control thread: requests come as calls (hs_sampler_call), the hooks watch the lease */
static uint64_t global_seed;
static uint64_t threadless_lease_lost(void);

/* ---- the real functions and their hooks ------------------------------------------------------------------ */
enum hook_id {
    H_MALLOC, H_FREE, H_CALLOC, H_REALLOC, H_REALLOCARRAY, H_POSIX_MEMALIGN, H_ALIGNED_ALLOC, H_MEMALIGN,
    H_VALLOC, H_PVALLOC,
    H_NEW, H_NEW_ARR, H_NEW_NT, H_NEW_ARR_NT, H_NEW_AL, H_NEW_ARR_AL, H_NEW_AL_NT, H_NEW_ARR_AL_NT,
    H_DEL, H_DEL_ARR, H_DEL_SZ, H_DEL_ARR_SZ, H_DEL_NT, H_DEL_ARR_NT, H_DEL_AL, H_DEL_ARR_AL, H_DEL_SZ_AL,
    H_DEL_ARR_SZ_AL, H_DEL_AL_NT, H_DEL_ARR_AL_NT,
    H_MALLOCX, H_RALLOCX, H_DALLOCX, H_SDALLOCX,
    H_COUNT
};

typedef void *(*alloc_fn)(size_t);
typedef void *(*alloc2_fn)(size_t, size_t);
typedef void *(*alloc_nt_fn)(size_t, const void *);
typedef void *(*alloc_al_nt_fn)(size_t, size_t, const void *);
typedef void (*free_fn)(void *);
typedef void (*free2_fn)(void *, size_t);
typedef void (*free3_fn)(void *, size_t, size_t);
typedef void (*free_nt_fn)(void *, const void *);
typedef void (*free_al_nt_fn)(void *, size_t, const void *);
typedef void *(*realloc_fn)(void *, size_t);
typedef void *(*reallocarray_fn)(void *, size_t, size_t);
typedef int (*posix_memalign_fn)(void **, size_t, size_t);
typedef void *(*mallocx_fn)(size_t, int);
typedef void *(*rallocx_fn)(void *, size_t, int);
typedef void (*dallocx_fn)(void *, int);
typedef void (*sdallocx_fn)(void *, size_t, int);

struct hook {
    const char *name;
    void *hook;
    void *real;
};
static struct hook hooks[H_COUNT];
#define REAL(id, type) ((type)hooks[id].real)

/* ---- the set of sampled addresses -------------------------------------------------------------------------
 * Buckets of 8 addresses (one cache line), two candidate buckets per address, claimed and released with one
 * compare-and-swap: lock-free and never allocating. A counting filter answers most frees without touching
 * the buckets: one byte per 4 KiB page of address, the page number modulo 2^16 (not a hash), so the frees
 * of a program's heap read a run of the filter as compact as the heap's pages, which stays in the cache;
 * a hashed index made every free a random read of 64 KiB, a cache miss under a program's own data. The
 * bytes count the live samples on their pages; a count of 255 sticks. live_samples == 0 skips both. */
#define SET_BUCKET_BITS 16
#define SET_WAYS 8
#define FILTER_BITS 16
static uintptr_t (*set_buckets)[SET_WAYS];
static uint8_t *set_filter;
static uint64_t live_samples;

static inline uint64_t hash_ptr(uintptr_t p)
{
    return (uint64_t)(p >> 4) * 0x9E3779B97F4A7C15ULL;
}
static inline uint8_t *filter_of(uintptr_t p)
{
    return &set_filter[(p >> 12) & ((1u << FILTER_BITS) - 1)];
}
static inline uintptr_t *bucket(uint64_t h, int which)
{
    uint64_t b = which ? (h >> (64 - SET_BUCKET_BITS)) ^ ((h >> 24) & ((1u << SET_BUCKET_BITS) - 1))
                       : h >> (64 - SET_BUCKET_BITS);
    return set_buckets[b];
}

static void filter_inc(uint8_t *f)
{
    uint8_t c = LOAD(*f);
    while (c != 255 && !__atomic_compare_exchange_n(f, &c, (uint8_t)(c + 1), 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}
static void filter_dec(uint8_t *f)
{
    uint8_t c = LOAD(*f);
    while (c != 255 && c != 0 && !__atomic_compare_exchange_n(f, &c, (uint8_t)(c - 1), 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static int set_insert(uintptr_t p)
{
    uint64_t h = hash_ptr(p);
    for (int which = 0; which < 2; which++) {
        uintptr_t *b = bucket(h, which);
        for (int i = 0; i < SET_WAYS; i++) {
            uintptr_t expected = 0;
            if (LOAD(b[i]) == 0 &&
                __atomic_compare_exchange_n(&b[i], &expected, p, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                filter_inc(filter_of(p));
                ADD(live_samples, 1);
                return 1;
            }
        }
    }
    ADD(hs_control.set_full, 1);
    return 0;
}

/* The free path's test, inlined: a live sample may sit on p's page (then set_remove looks in the buckets). */
static inline int may_be_sampled(const void *p)
{
    return UNLIKELY(LOAD(live_samples) != 0) && p && UNLIKELY(LOAD(*filter_of((uintptr_t)p)) != 0);
}

/* 1 if p was a sampled address (now removed). Called through may_be_sampled, which reads the filter inline. */
static int set_remove(uintptr_t p)
{
    uint64_t h = hash_ptr(p);
    for (int which = 0; which < 2; which++) {
        uintptr_t *b = bucket(h, which);
        for (int i = 0; i < SET_WAYS; i++) {
            uintptr_t expected = p;
            if (LOAD(b[i]) == p &&
                __atomic_compare_exchange_n(&b[i], &expected, 0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                filter_dec(filter_of(p));
                __atomic_fetch_sub(&live_samples, 1, __ATOMIC_RELAXED);
                return 1;
            }
        }
    }
    return 0;
}

static size_t set_bytes(void)
{
    return ((size_t)1 << SET_BUCKET_BITS) * SET_WAYS * sizeof(uintptr_t);
}

/* Empty the set (at arming, when no hook is installed): fresh zero pages from the kernel. */
static void set_clear(void)
{
    madvise(set_buckets, set_bytes(), MADV_DONTNEED);
    madvise(set_filter, (size_t)1 << FILTER_BITS, MADV_DONTNEED);
    STORE(live_samples, 0);
}

/* ---- exact counts ------------------------------------------------------------------------------------------ */
static struct hs_counts *count_slots;
static uint64_t count_slots_used;

/* gettid as one instruction: syscall() would make claim_counts clobber the argument registers, and the hooks,
 * which know what their callees clobber, would then keep the TLS base in a saved register on the fast path. */
static inline uint64_t raw_gettid(void)
{
    long tid;
    __asm__ volatile("syscall" : "=a"(tid) : "0"((long)SYS_gettid) : "rcx", "r11", "memory");
    return (uint64_t)tid;
}

static __attribute__((noinline)) struct hs_counts *claim_counts(struct thread_state *t)
{
    uint64_t i = ADD(count_slots_used, 1);
    if (i >= HS_COUNT_SLOTS - 1) {
        i = HS_COUNT_SLOTS - 1;
        t->counts_shared = 1;
        STORE(count_slots_used, (uint64_t)HS_COUNT_SLOTS);
    } else {
        STORE(count_slots[i].tid, raw_gettid()); /* once per thread: heapscope's per-thread view */
    }
    STORE(hs_control.counts_used, LOAD(count_slots_used) < HS_COUNT_SLOTS ? LOAD(count_slots_used) : HS_COUNT_SLOTS);
    t->counts = &count_slots[i];
    return t->counts;
}

static inline void count(uint64_t *field, uint64_t n, struct thread_state *t)
{
    if (LIKELY(!t->counts_shared))
        *field += n; /* one writer: this thread */
    else
        ADD(*field, n);
}

/* The count of allocation function `fn` besides allocs; none for malloc (allocs minus the others). */
static inline __attribute__((always_inline)) uint64_t *fn_count(struct hs_counts *c, unsigned fn)
{
    switch (fn) {
    case HS_SAMPLE_CALLOC: return &c->callocs;
    case HS_SAMPLE_REALLOC:
    case HS_SAMPLE_REALLOCARRAY: return &c->reallocs;
    case HS_SAMPLE_MEMALIGN: return &c->memaligns;
    case HS_SAMPLE_POSIX_MEMALIGN: return &c->posix_memaligns;
    case HS_SAMPLE_VALLOC: return &c->vallocs;
    case HS_SAMPLE_PVALLOC: return &c->pvallocs;
    default: return NULL;
    }
}

/* `fn` is a constant in each hook (account is inlined): malloc's hook compiles to the two adds it always had. */
static inline __attribute__((always_inline)) void count_alloc(struct thread_state *t, size_t n, unsigned fn)
{
    struct hs_counts *c = t->counts;
    if (UNLIKELY(!c))
        c = claim_counts(t);
    count(&c->allocs, 1, t);
    count(&c->alloc_bytes, n, t);
    uint64_t *per_fn = fn_count(c, fn);
    if (per_fn)
        count(per_fn, 1, t);
}

static inline void count_free(struct thread_state *t)
{
    struct hs_counts *c = t->counts;
    if (UNLIKELY(!c))
        c = claim_counts(t);
    count(&c->frees, 1, t);
}

/* The old block of a realloc: a free, but not a call of free. */
static inline void count_realloc_free(struct thread_state *t)
{
    struct hs_counts *c = t->counts;
    if (UNLIKELY(!c))
        c = claim_counts(t);
    count(&c->frees, 1, t);
    count(&c->realloc_frees, 1, t);
}

/* Zero the counts at arming, keeping each slot's tid (the threads keep their slots from one arming to the
 * next). No hook counts allocations meanwhile: armed is 0. */
static void reset_counts(void)
{
    uint64_t used = LOAD(count_slots_used);
    if (used > HS_COUNT_SLOTS)
        used = HS_COUNT_SLOTS;
    for (uint64_t i = 0; i < used; i++) {
        struct hs_counts *c = &count_slots[i];
        uint64_t tid = LOAD(c->tid);
        memset(c, 0, sizeof *c);
        STORE(c->tid, i == HS_COUNT_SLOTS - 1 ? 0 : tid);
    }
}

/* ---- sampling ---------------------------------------------------------------------------------------------- */
static inline uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline uint64_t next_random(struct thread_state *t)
{
    uint64_t x = t->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    t->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* ---- the arithmetic of sampling, without libm ------------------------------------------------------------
 * The library links no libm: loading libm into a process changes where glibc's malloc puts later blocks, and a
 * prefork server's workers, forked from a master that had it loaded, then grew and trimmed their heap at every
 * request (apache2 with mod_deflate: 33 page faults a request instead of 3, 0.7x its throughput, even after
 * heapscope had gone). Both functions are exact to a few units in the last place, for arguments in (0, 1]. */

/* ln(u) for u in (0, 1]: u = m * 2^e with m in [sqrt(1/2), sqrt(2)), ln(m) = 2 atanh(s), s = (m - 1) / (m + 1),
 * |s| < 0.172: eleven terms of the series are below 2^-53. */
static double hs_log(double u)
{
    union { double d; uint64_t bits; } v = {.d = u};
    int e = (int)((v.bits >> 52) & 0x7ff) - 1023;
    if (e == -1023) /* subnormal: scale into the normal range first */
        return hs_log(u * 0x1.0p54) - 54 * 0x1.62e42fefa39efp-1;
    v.bits = (v.bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL; /* m in [1, 2) */
    if (v.d > 1.4142135623730951) {
        v.d *= 0.5;
        e++;
    }
    double s = (v.d - 1.0) / (v.d + 1.0), s2 = s * s, sum = 0.0;
    for (int k = 21; k >= 3; k -= 2)
        sum = (sum + 1.0 / k) * s2;
    return 2.0 * s * (1.0 + sum) + e * 0x1.62e42fefa39efp-1;
}

/* e^-x - 1 for x in (0, 1]: a short series at x / 2^12, then twelve doublings, e^2y - 1 = (e^y - 1)(e^y + 1),
 * which keep the relative precision (no 1 - e^-x cancellation for a small x). */
static double hs_expm1_neg(double x)
{
    double y = -x * 0x1.0p-12;
    double m = y * (1.0 + y * (1.0 / 2 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120)))));
    for (int i = 0; i < 12; i++)
        m = m * (m + 2.0);
    return m;
}

/* A distance drawn from an exponential distribution with mean T, rounded up to whole bytes: an allocation
 * of n bytes crosses ceil(X) exactly when it crosses X, so rounding keeps p(n) = 1 - e^(-n/T). */
static int64_t draw_distance(struct thread_state *t, uint64_t rate)
{
    double u = (double)((next_random(t) >> 11) + 1) * 0x1.0p-53; /* in (0, 1] */
    double x = -hs_log(u) * (double)rate;
    if (x >= 9.0e18)
        return INT64_MAX;
    int64_t whole = (int64_t)x; /* x >= 0: truncation is the floor */
    return whole + ((double)whole < x);
}

static void seed_thread(struct thread_state *t)
{
    uint64_t tsc_lo, tsc_hi;
    __asm__ volatile("rdtsc" : "=a"(tsc_lo), "=d"(tsc_hi));
    uint64_t s = splitmix64(global_seed ^ (uint64_t)(uintptr_t)t ^ splitmix64((tsc_hi << 32) | tsc_lo));
    t->rng = s ? s : 0x853C49E6748FEA9BULL;
    t->seeded = 1;
}

/* s / (1 - e^(-s/T)), rounded to whole bytes; s itself at or above T (agent/model/sampling.py: weight_hint). */
EXPORT uint64_t hs_weight(uint64_t size, uint64_t rate)
{
    if (size >= rate)
        return size;
    double p = -hs_expm1_neg((double)size / (double)rate);
    return (uint64_t)((double)size / p + 0.5); /* positive: truncation is the floor */
}

/* The weight of a sample whose countdown was drawn at rate `drawn`, for any size: p = 1 - e^(-n/drawn) still holds
 * (the exponential has no memory) when the rate in force has risen above the size since the draw. At n >= drawn,
 * e^-x is (e^-(x/2^k))^(2^k) with x/2^k in (1/2, 1]; 1 - e^-x >= 0.63 there, so no cancellation. */
EXPORT uint64_t hs_drawn_weight(uint64_t size, uint64_t drawn)
{
    if (size < drawn)
        return hs_weight(size, drawn);
    double x = (double)size / (double)drawn;
    int k = 0;
    while (x > 1.0 && k < 64) {
        x *= 0.5;
        k++;
    }
    double e = hs_expm1_neg(x) + 1.0; /* e^-x at the scaled x */
    for (int i = 0; i < k; i++)
        e *= e;
    return (uint64_t)((double)size / (1.0 - e) + 0.5);
}

/* The sampling budget (max_samples, a second): each sample counts in a window that closes after a second, or at
 * once when it holds a second's budget (a burst costs at most that before the rate follows). The thread that closes
 * a window sets the rate in force for the next: over budget, it rises so that the window's samples would have come
 * to three quarters of the budget; under half the budget it falls the same way (at most HS_BUDGET_MAX_FALL times in
 * one window: a quiet second says little), never below the asked rate, nor above HS_BUDGET_MAX_RISE times it: a
 * thread's countdown drawn at a raised rate runs out only after that many bytes, so after a burst the rate comes
 * back down within some 32 MiB of a thread's allocations (at the default rate), not gigabytes. Each sample keeps the
 * weight of the rate its thread's countdown was drawn at, and a thread draws at the new rate from its next sample
 * on: every estimate stays unbiased (JFR throttles its allocation samples so). */
#define HS_BUDGET_WINDOW_NS 1000000000ULL
#define HS_BUDGET_MAX_FALL 16
#define HS_BUDGET_MAX_RISE 64

static uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void budget_start(void)
{
    STORE(window_samples, 0);
    STORE(window_start_ns, monotonic_ns());
}

static void budget_sample(void)
{
    uint64_t cap = LOAD(hs_control.max_samples); /* read at each sample: a daemon moves it while armed */
    if (!cap)
        return;
    uint64_t taken = ADD(window_samples, 1) + 1;
    uint64_t start = LOAD(window_start_ns), now = monotonic_ns();
    if ((now - start < HS_BUDGET_WINDOW_NS && taken < cap) || now <= start ||
        !__atomic_compare_exchange_n(&window_start_ns, &start, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        return; /* the window is open, or another thread closes it */
    double seen = (double)__atomic_exchange_n(&window_samples, 0, __ATOMIC_RELAXED) * 1e9 / (double)(now - start);
    uint64_t rate = LOAD(sample_rate), asked = LOAD(asked_rate);
    if (seen <= (double)cap && (seen >= 0.5 * (double)cap || rate <= asked))
        return;
    double factor = seen / (0.75 * (double)cap);
    if (factor < 1.0 / HS_BUDGET_MAX_FALL)
        factor = 1.0 / HS_BUDGET_MAX_FALL;
    double next = (double)rate * factor, ceiling = (double)asked * HS_BUDGET_MAX_RISE;
    if (ceiling > (double)HS_MAX_RATE)
        ceiling = (double)HS_MAX_RATE;
    uint64_t moved = next >= ceiling ? (uint64_t)ceiling : next <= (double)asked ? asked : (uint64_t)next;
    if (moved == rate)
        return;
    STORE(sample_rate, moved);
    STORE(hs_control.rate_in_force, moved);
    ADD(hs_control.rate_changes, 1);
}

/* A sample, reported: its address into the set (its free is looked for), counted, to the probe, and to the budget. */
static void report_sample(void *p, size_t n, uint64_t weight, unsigned fn)
{
    set_insert((uintptr_t)p);
    ADD(hs_control.samples, 1);
    hs_sample_alloc(p, n, weight, fn);
    budget_sample();
}

static __attribute__((noinline)) void hs_account_slow(struct thread_state *t, void *p, size_t n, unsigned fn)
{
    /* Threadless, nobody else notices heapscope's end: a sample due looks at the lease (two system calls, once
     * per sample), and once it is gone every hook passes through. */
    if (UNLIKELY(LOAD(threadless)) && threadless_lease_lost())
        return;
    uint64_t rate = LOAD(sample_rate);
    if (UNLIKELY(!t->seeded)) {
        seed_thread(t);
        t->drawn_at = rate;
        t->remaining = draw_distance(t, rate);
    }
    /* A child forked while armed reports its samples only once heapscope has claimed it, after putting its own
     * probes on it: until then the probe functions' code may be the parent's, as the kernel's uprobe left it
     * (patched into a call that only the parent's probe set up), and a process the kernel does not trace must
     * not run it. Its countdown runs on meanwhile: the sampling stays as it would be. */
    int report = LIKELY(LOAD(hs_control.forked_armed) != HS_FORKED_ARMED);
    if (n >= rate) { /* always sampled, at its size; the countdown is left alone */
        if (p && report) {
            report_sample(p, n, n, fn);
        }
        return;
    }
    t->remaining -= (int64_t)n;
    if (t->remaining > 0)
        return;
    uint64_t drawn = t->drawn_at;
    t->drawn_at = rate;
    t->remaining = draw_distance(t, rate);
    if (p && n && report) {
        report_sample(p, n, hs_drawn_weight(n, drawn), fn);
    }
}

/* The fast path: one TLS subtraction and a compare for an allocation that is not sampled. `fn` (enum
 * hs_sample_fn) is a constant of the hook: it picks the count at compile time and reaches the probe only on
 * the slow path. */
static inline __attribute__((always_inline)) void account(void *p, size_t n, unsigned fn)
{
    struct thread_state *t = &tls;
    if (UNLIKELY(!LOAD(armed) || t->busy))
        return;
    if (p)
        count_alloc(t, n, fn);
    int64_t r = t->remaining - (int64_t)n;
    if (LIKELY(r > 0 && n < LOAD(sample_rate))) {
        t->remaining = r;
        return;
    }
    hs_account_slow(t, p, n, fn);
}

/* Report a free before the block goes back to the allocator: after it, another thread may get the same
 * address and report it first. */
static inline void forget(void *p)
{
    struct thread_state *t = &tls;
    if (!p || t->busy) /* busy: the outer hook (a delete calling free) counted it */
        return;
    count_free(t);
    if (may_be_sampled(p) && set_remove((uintptr_t)p)) {
        ADD(hs_control.sampled_frees, 1);
        hs_sample_free(p);
    }
}

/* Marks the thread busy for a scope; restored on return and on unwinding (built with -fexceptions), so a
 * std::bad_alloc thrown through an operator new hook leaves the thread sampling. */
struct busy_guard {
    struct thread_state *t;
    uint8_t was;
};
static inline void unbusy(struct busy_guard *g) { g->t->busy = g->was; }
/* Nested calls (new[] calling new, glibc's reallocarray calling realloc, each through its own patched PLT)
 * restore the outer state, so only the outermost hook counts the allocation. malloc and free, the fast
 * paths, do without: no allocator's malloc or free calls another allocation function through a PLT. */
#define BUSY_SCOPE                                                                                               \
    struct busy_guard busy_guard __attribute__((cleanup(unbusy))) = {&tls, tls.busy};                           \
    busy_guard.t->busy = 1

/* ---- the hooks ------------------------------------------------------------------------------------------------- */
static void *hs_hook_malloc(size_t n)
{
    void *p = REAL(H_MALLOC, alloc_fn)(n);
    account(p, n, HS_SAMPLE_MALLOC);
    return p;
}
static void hs_hook_free(void *p)
{
    forget(p);
    REAL(H_FREE, free_fn)(p);
}
static void *hs_hook_calloc(size_t nmemb, size_t size)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_CALLOC, alloc2_fn)(nmemb, size);
    }
    size_t n;
    if (!__builtin_mul_overflow(nmemb, size, &n))
        account(p, n, HS_SAMPLE_CALLOC);
    return p;
}
static void *hs_hook_realloc(void *p, size_t n)
{
    if (p && !tls.busy)
        count_realloc_free(&tls);
    int was_sampled = 0;
    if (may_be_sampled(p) && set_remove((uintptr_t)p)) {
        was_sampled = 1;
        ADD(hs_control.sampled_frees, 1);
        hs_sample_free(p);
    }
    void *q;
    {
        BUSY_SCOPE;
        q = REAL(H_REALLOC, realloc_fn)(p, n);
    }
    if (UNLIKELY(was_sampled && q == NULL && n != 0))
        ADD(hs_control.realloc_failed_sampled, 1); /* p lives on, no longer sampled */
    if (q)
        account(q, n, HS_SAMPLE_REALLOC);
    return q;
}
static void *hs_hook_reallocarray(void *p, size_t nmemb, size_t size)
{
    size_t n;
    if (__builtin_mul_overflow(nmemb, size, &n))
        return REAL(H_REALLOCARRAY, reallocarray_fn)(p, nmemb, size); /* fails with ENOMEM, p untouched */
    if (p && !tls.busy)
        count_realloc_free(&tls);
    int was_sampled = 0;
    if (may_be_sampled(p) && set_remove((uintptr_t)p)) {
        was_sampled = 1;
        ADD(hs_control.sampled_frees, 1);
        hs_sample_free(p);
    }
    void *q;
    {
        BUSY_SCOPE; /* glibc's reallocarray calls realloc through its own PLT: count it once */
        q = REAL(H_REALLOCARRAY, reallocarray_fn)(p, nmemb, size);
    }
    if (UNLIKELY(was_sampled && q == NULL && n != 0))
        ADD(hs_control.realloc_failed_sampled, 1);
    if (q)
        account(q, n, HS_SAMPLE_REALLOCARRAY);
    return q;
}
static int hs_hook_posix_memalign(void **out, size_t align, size_t n)
{
    int r;
    {
        BUSY_SCOPE;
        r = REAL(H_POSIX_MEMALIGN, posix_memalign_fn)(out, align, n);
    }
    if (r == 0)
        account(*out, n, HS_SAMPLE_POSIX_MEMALIGN);
    return r;
}
static void *hs_hook_aligned_alloc(size_t align, size_t n)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_ALIGNED_ALLOC, alloc2_fn)(align, n);
    }
    account(p, n, HS_SAMPLE_MEMALIGN);
    return p;
}
static void *hs_hook_memalign(size_t align, size_t n)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_MEMALIGN, alloc2_fn)(align, n);
    }
    account(p, n, HS_SAMPLE_MEMALIGN);
    return p;
}
static void *hs_hook_valloc(size_t n)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_VALLOC, alloc_fn)(n);
    }
    account(p, n, HS_SAMPLE_VALLOC);
    return p;
}
static void *hs_hook_pvalloc(size_t n)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_PVALLOC, alloc_fn)(n);
    }
    account(p, n, HS_SAMPLE_PVALLOC);
    return p;
}

/* C++ operators: busy while the real operator runs, so the malloc it calls (through its own, patched, GOT)
 * is not counted twice. */
#define NEW_HOOK(fn, id, kind)                                                                                       \
    static void *fn(size_t n)                                                                                    \
    {                                                                                                            \
        void *p;                                                                                                 \
        {                                                                                                        \
            BUSY_SCOPE;                                                                                          \
            p = REAL(id, alloc_fn)(n);                                                                           \
        }                                                                                                        \
        account(p, n, kind);                                                                                     \
        return p;                                                                                                \
    }
#define NEW_NT_HOOK(fn, id, kind)                                                                                    \
    static void *fn(size_t n, const void *nt)                                                                    \
    {                                                                                                            \
        void *p;                                                                                                 \
        {                                                                                                        \
            BUSY_SCOPE;                                                                                          \
            p = REAL(id, alloc_nt_fn)(n, nt);                                                                    \
        }                                                                                                        \
        account(p, n, kind);                                                                                     \
        return p;                                                                                                \
    }
#define NEW_AL_HOOK(fn, id, kind)                                                                                    \
    static void *fn(size_t n, size_t al)                                                                         \
    {                                                                                                            \
        void *p;                                                                                                 \
        {                                                                                                        \
            BUSY_SCOPE;                                                                                          \
            p = REAL(id, alloc2_fn)(n, al);                                                                      \
        }                                                                                                        \
        account(p, n, kind);                                                                                     \
        return p;                                                                                                \
    }
#define NEW_AL_NT_HOOK(fn, id, kind)                                                                                 \
    static void *fn(size_t n, size_t al, const void *nt)                                                         \
    {                                                                                                            \
        void *p;                                                                                                 \
        {                                                                                                        \
            BUSY_SCOPE;                                                                                          \
            p = REAL(id, alloc_al_nt_fn)(n, al, nt);                                                             \
        }                                                                                                        \
        account(p, n, kind);                                                                                     \
        return p;                                                                                                \
    }
/* As exact mode sees them: libstdc++'s operator new calls malloc, its aligned operator new aligned_alloc. */
NEW_HOOK(hs_hook_new, H_NEW, HS_SAMPLE_MALLOC)
NEW_HOOK(hs_hook_new_arr, H_NEW_ARR, HS_SAMPLE_MALLOC)
NEW_NT_HOOK(hs_hook_new_nt, H_NEW_NT, HS_SAMPLE_MALLOC)
NEW_NT_HOOK(hs_hook_new_arr_nt, H_NEW_ARR_NT, HS_SAMPLE_MALLOC)
NEW_AL_HOOK(hs_hook_new_al, H_NEW_AL, HS_SAMPLE_MEMALIGN)
NEW_AL_HOOK(hs_hook_new_arr_al, H_NEW_ARR_AL, HS_SAMPLE_MEMALIGN)
NEW_AL_NT_HOOK(hs_hook_new_al_nt, H_NEW_AL_NT, HS_SAMPLE_MEMALIGN)
NEW_AL_NT_HOOK(hs_hook_new_arr_al_nt, H_NEW_ARR_AL_NT, HS_SAMPLE_MEMALIGN)

static void hs_hook_del(void *p)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL, free_fn)(p);
}
static void hs_hook_del_arr(void *p)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR, free_fn)(p);
}
static void hs_hook_del_sz(void *p, size_t n)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_SZ, free2_fn)(p, n);
}
static void hs_hook_del_arr_sz(void *p, size_t n)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR_SZ, free2_fn)(p, n);
}
static void hs_hook_del_nt(void *p, const void *nt)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_NT, free_nt_fn)(p, nt);
}
static void hs_hook_del_arr_nt(void *p, const void *nt)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR_NT, free_nt_fn)(p, nt);
}
static void hs_hook_del_al(void *p, size_t al)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_AL, free2_fn)(p, al);
}
static void hs_hook_del_arr_al(void *p, size_t al)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR_AL, free2_fn)(p, al);
}
static void hs_hook_del_sz_al(void *p, size_t n, size_t al)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_SZ_AL, free3_fn)(p, n, al);
}
static void hs_hook_del_arr_sz_al(void *p, size_t n, size_t al)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR_SZ_AL, free3_fn)(p, n, al);
}
static void hs_hook_del_al_nt(void *p, size_t al, const void *nt)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_AL_NT, free_al_nt_fn)(p, al, nt);
}
static void hs_hook_del_arr_al_nt(void *p, size_t al, const void *nt)
{
    forget(p);
    BUSY_SCOPE;
    REAL(H_DEL_ARR_AL_NT, free_al_nt_fn)(p, al, nt);
}

/* jemalloc's non-standard API (present only where jemalloc is loaded). xallocx resizes in place and is not
 * hooked: a sampled block it grows keeps its first size. */
static void *hs_hook_mallocx(size_t n, int flags)
{
    void *p;
    {
        BUSY_SCOPE;
        p = REAL(H_MALLOCX, mallocx_fn)(n, flags);
    }
    account(p, n, HS_SAMPLE_MALLOC);
    return p;
}
static void *hs_hook_rallocx(void *p, size_t n, int flags)
{
    if (p && !tls.busy)
        count_realloc_free(&tls);
    int was_sampled = 0;
    if (may_be_sampled(p) && set_remove((uintptr_t)p)) {
        was_sampled = 1;
        ADD(hs_control.sampled_frees, 1);
        hs_sample_free(p);
    }
    void *q;
    {
        BUSY_SCOPE;
        q = REAL(H_RALLOCX, rallocx_fn)(p, n, flags);
    }
    if (UNLIKELY(was_sampled && q == NULL))
        ADD(hs_control.realloc_failed_sampled, 1);
    account(q, n, HS_SAMPLE_REALLOC);
    return q;
}
static void hs_hook_dallocx(void *p, int flags) { forget(p); REAL(H_DALLOCX, dallocx_fn)(p, flags); }
static void hs_hook_sdallocx(void *p, size_t n, int flags) { forget(p); REAL(H_SDALLOCX, sdallocx_fn)(p, n, flags); }

static void define_hooks(void)
{
#define DEF(id, sym, fn) hooks[id] = (struct hook){sym, (void *)(fn), NULL}
    DEF(H_MALLOC, "malloc", hs_hook_malloc);
    DEF(H_FREE, "free", hs_hook_free);
    DEF(H_CALLOC, "calloc", hs_hook_calloc);
    DEF(H_REALLOC, "realloc", hs_hook_realloc);
    DEF(H_REALLOCARRAY, "reallocarray", hs_hook_reallocarray);
    DEF(H_POSIX_MEMALIGN, "posix_memalign", hs_hook_posix_memalign);
    DEF(H_ALIGNED_ALLOC, "aligned_alloc", hs_hook_aligned_alloc);
    DEF(H_MEMALIGN, "memalign", hs_hook_memalign);
    DEF(H_VALLOC, "valloc", hs_hook_valloc);
    DEF(H_PVALLOC, "pvalloc", hs_hook_pvalloc);
    DEF(H_NEW, "_Znwm", hs_hook_new);
    DEF(H_NEW_ARR, "_Znam", hs_hook_new_arr);
    DEF(H_NEW_NT, "_ZnwmRKSt9nothrow_t", hs_hook_new_nt);
    DEF(H_NEW_ARR_NT, "_ZnamRKSt9nothrow_t", hs_hook_new_arr_nt);
    DEF(H_NEW_AL, "_ZnwmSt11align_val_t", hs_hook_new_al);
    DEF(H_NEW_ARR_AL, "_ZnamSt11align_val_t", hs_hook_new_arr_al);
    DEF(H_NEW_AL_NT, "_ZnwmSt11align_val_tRKSt9nothrow_t", hs_hook_new_al_nt);
    DEF(H_NEW_ARR_AL_NT, "_ZnamSt11align_val_tRKSt9nothrow_t", hs_hook_new_arr_al_nt);
    DEF(H_DEL, "_ZdlPv", hs_hook_del);
    DEF(H_DEL_ARR, "_ZdaPv", hs_hook_del_arr);
    DEF(H_DEL_SZ, "_ZdlPvm", hs_hook_del_sz);
    DEF(H_DEL_ARR_SZ, "_ZdaPvm", hs_hook_del_arr_sz);
    DEF(H_DEL_NT, "_ZdlPvRKSt9nothrow_t", hs_hook_del_nt);
    DEF(H_DEL_ARR_NT, "_ZdaPvRKSt9nothrow_t", hs_hook_del_arr_nt);
    DEF(H_DEL_AL, "_ZdlPvSt11align_val_t", hs_hook_del_al);
    DEF(H_DEL_ARR_AL, "_ZdaPvSt11align_val_t", hs_hook_del_arr_al);
    DEF(H_DEL_SZ_AL, "_ZdlPvmSt11align_val_t", hs_hook_del_sz_al);
    DEF(H_DEL_ARR_SZ_AL, "_ZdaPvmSt11align_val_t", hs_hook_del_arr_sz_al);
    DEF(H_DEL_AL_NT, "_ZdlPvSt11align_val_tRKSt9nothrow_t", hs_hook_del_al_nt);
    DEF(H_DEL_ARR_AL_NT, "_ZdaPvSt11align_val_tRKSt9nothrow_t", hs_hook_del_arr_al_nt);
    DEF(H_MALLOCX, "mallocx", hs_hook_mallocx);
    DEF(H_RALLOCX, "rallocx", hs_hook_rallocx);
    DEF(H_DALLOCX, "dallocx", hs_hook_dallocx);
    DEF(H_SDALLOCX, "sdallocx", hs_hook_sdallocx);
#undef DEF
}

/* ---- patching GOT slots ----------------------------------------------------------------------------------------- */
static pthread_mutex_t patch_lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t own_base;
static long page_size;

struct scan {
    int restore;
    uint8_t unique[H_COUNT]; /* exactly one loaded object defines the name: the one dlsym found */
    uint64_t patched_delta;
    uint64_t unwritable;
    uint64_t objects;
    uint64_t lazy_skipped;
};

static int hook_of_name(const char *name)
{
    /* Every hooked name starts with one of these; most relocations are rejected on the first byte. */
    switch (name[0]) {
    case 'm': case 'f': case 'c': case 'r': case 'p': case 'a': case 'v': case '_': case 'd': case 's':
        break;
    default:
        return -1;
    }
    for (int i = 0; i < H_COUNT; i++)
        if (hooks[i].real && strcmp(name, hooks[i].name) == 0)
            return i;
    return -1;
}

/* Whether the 8 bytes at slot can be written as they are: writes back the value just read (a failed write
 * to a read-only page changes nothing, and a torn write of identical bytes is the same value). */
static int slot_writable(uintptr_t *slot, uintptr_t current)
{
    struct iovec local = {&current, sizeof current};
    struct iovec remote = {slot, sizeof current};
    return syscall(SYS_process_vm_writev, getpid(), &local, 1UL, &remote, 1UL, 0UL) == (long)sizeof current;
}

static void write_slot(uintptr_t *slot, uintptr_t expect, uintptr_t value, uintptr_t relro_start, uintptr_t relro_end,
                       struct scan *s)
{
    if (slot_writable(slot, expect)) {
        __atomic_store_n(slot, value, __ATOMIC_RELEASE);
    } else if ((uintptr_t)slot >= relro_start && (uintptr_t)slot + sizeof *slot <= relro_end) {
        /* RELRO the loader already sealed (it seals only after relocating the object): open the one page,
         * write, seal it again with the loader's own protection. */
        void *page = (void *)((uintptr_t)slot & ~(uintptr_t)(page_size - 1));
        if (mprotect(page, (size_t)page_size, PROT_READ | PROT_WRITE) != 0) {
            s->unwritable++;
            return;
        }
        __atomic_store_n(slot, value, __ATOMIC_RELEASE);
        mprotect(page, (size_t)page_size, PROT_READ);
    } else {
        s->unwritable++;
        return;
    }
    if (s->restore)
        s->patched_delta--;
    else
        s->patched_delta++;
}

static uintptr_t dyn_addr(uintptr_t v, uintptr_t base)
{
    /* glibc relocates an object's dynamic entries in place (absolute addresses); other loaders and the vDSO
     * leave offsets. An offset is below the load base. */
    return v < base ? v + base : v;
}

/* An object's dynamic tables, as scan_object and count_definers need them. */
struct dyn_info {
    const Elf64_Sym *symtab;
    const char *strtab;
    size_t strsz, relasz, pltrelsz;
    const Elf64_Rela *rela, *jmprel;
    int64_t pltrel;
    const uint32_t *gnu_hash;
    uintptr_t lo, hi; /* the object's mapped range, from its PT_LOAD segments */
    uintptr_t relro_start, relro_end;
};

static int read_dyn(struct dl_phdr_info *info, struct dyn_info *d)
{
    memset(d, 0, sizeof *d);
    d->pltrel = DT_RELA;
    d->lo = UINTPTR_MAX;
    uintptr_t base = info->dlpi_addr;
    const Elf64_Dyn *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const Elf64_Phdr *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC) {
            dyn = (const Elf64_Dyn *)(base + ph->p_vaddr);
        } else if (ph->p_type == PT_LOAD) {
            if (base + ph->p_vaddr < d->lo)
                d->lo = base + ph->p_vaddr;
            if (base + ph->p_vaddr + ph->p_memsz > d->hi)
                d->hi = base + ph->p_vaddr + ph->p_memsz;
        } else if (ph->p_type == PT_GNU_RELRO) {
            /* the pages glibc seals: [start rounded down, end rounded down) */
            d->relro_start = (base + ph->p_vaddr) & ~(uintptr_t)(page_size - 1);
            d->relro_end = (base + ph->p_vaddr + ph->p_memsz) & ~(uintptr_t)(page_size - 1);
        }
    }
    if (!dyn)
        return 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: d->symtab = (const Elf64_Sym *)dyn_addr(dyn->d_un.d_ptr, base); break;
        case DT_STRTAB: d->strtab = (const char *)dyn_addr(dyn->d_un.d_ptr, base); break;
        case DT_STRSZ: d->strsz = dyn->d_un.d_val; break;
        case DT_RELA: d->rela = (const Elf64_Rela *)dyn_addr(dyn->d_un.d_ptr, base); break;
        case DT_RELASZ: d->relasz = dyn->d_un.d_val; break;
        case DT_JMPREL: d->jmprel = (const Elf64_Rela *)dyn_addr(dyn->d_un.d_ptr, base); break;
        case DT_PLTRELSZ: d->pltrelsz = dyn->d_un.d_val; break;
        case DT_PLTREL: d->pltrel = (int64_t)dyn->d_un.d_val; break;
        case DT_GNU_HASH: d->gnu_hash = (const uint32_t *)dyn_addr(dyn->d_un.d_ptr, base); break;
        default: break;
        }
    }
    return d->symtab && d->strtab;
}

/* Whether the object defines `name` (GNU hash lookup). -1: it cannot tell (no DT_GNU_HASH). */
static int defines(const struct dyn_info *d, const char *name)
{
    if (!d->gnu_hash)
        return -1;
    uint32_t h = 5381;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++)
        h = h * 33 + *c;
    uint32_t nbuckets = d->gnu_hash[0], symoffset = d->gnu_hash[1], bloom_size = d->gnu_hash[2];
    uint32_t shift = d->gnu_hash[3];
    if (nbuckets == 0 || bloom_size == 0)
        return 0;
    const uint64_t *bloom = (const uint64_t *)&d->gnu_hash[4];
    const uint32_t *buckets = (const uint32_t *)&bloom[bloom_size];
    const uint32_t *chain = &buckets[nbuckets];
    uint64_t word = bloom[(h / 64) % bloom_size];
    uint64_t mask = (1ULL << (h % 64)) | (1ULL << ((h >> shift) % 64));
    if ((word & mask) != mask)
        return 0;
    uint32_t i = buckets[h % nbuckets];
    if (i < symoffset)
        return 0;
    for (;; i++) {
        uint32_t h2 = chain[i - symoffset];
        const Elf64_Sym *sym = &d->symtab[i];
        if ((h | 1) == (h2 | 1) && sym->st_name < d->strsz && strcmp(name, d->strtab + sym->st_name) == 0 &&
            sym->st_shndx != SHN_UNDEF)
            return 1;
        if (h2 & 1)
            return 0;
    }
}

struct definers {
    int count[H_COUNT]; /* objects defining each name; a large number when some object cannot tell */
};

static int count_definers(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct definers *defs = data;
    struct dyn_info d;
    /* glibc's loader before 2.32 exports a minimal malloc of its own (weak, for its use before libc is
     * relocated). It comes after libc in every lookup, so it never is what a lazy slot binds to: not a definer. */
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    if (base && strncmp(base + 1, "ld-linux", 8) == 0)
        return 0;
    if (!read_dyn(info, &d))
        return 0;
    for (int i = 0; i < H_COUNT; i++) {
        if (!hooks[i].real)
            continue;
        int r = defines(&d, hooks[i].name);
        defs->count[i] += r < 0 ? 1000 : r;
    }
    return 0;
}

static void scan_relocs(const Elf64_Rela *rel, size_t bytes, const struct dyn_info *d, uintptr_t base,
                        struct scan *s)
{
    const Elf64_Sym *symtab = d->symtab;
    const char *strtab = d->strtab;
    size_t strsz = d->strsz;
    if (!rel)
        return;
    for (size_t i = 0; i < bytes / sizeof *rel; i++) {
        uint32_t type = ELF64_R_TYPE(rel[i].r_info);
        if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT)
            continue;
        uint32_t sym = ELF64_R_SYM(rel[i].r_info);
        if (sym == 0 || symtab[sym].st_name >= strsz)
            continue;
        int id = hook_of_name(strtab + symtab[sym].st_name);
        if (id < 0)
            continue;
        uintptr_t *slot = (uintptr_t *)(base + rel[i].r_offset);
        uintptr_t cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        uintptr_t from = s->restore ? (uintptr_t)hooks[id].hook : (uintptr_t)hooks[id].real;
        uintptr_t to = s->restore ? (uintptr_t)hooks[id].real : (uintptr_t)hooks[id].hook;
        if (cur == from) {
            write_slot(slot, cur, to, d->relro_start, d->relro_end, s);
        } else if (!s->restore && type == R_X86_64_JUMP_SLOT && s->unique[id] && cur >= d->lo && cur < d->hi) {
            /* A lazy slot not bound yet (it points at the object's own PLT): the loader would bind it to the
             * one object that defines the name, the function dlsym gave us, so the hook is what it would
             * get. With several definers (another allocator, another namespace) it is left alone. */
            write_slot(slot, cur, to, d->relro_start, d->relro_end, s);
        } else if (!s->restore && type == R_X86_64_JUMP_SLOT && cur >= d->lo && cur < d->hi) {
            s->lazy_skipped++; /* bound at its first call, to the allocator: a later rescan patches it */
        }
    }
}

static int scan_object(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct scan *s = data;
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    uintptr_t base = info->dlpi_addr;
    if (base == own_base && own_base != 0)
        return 0;
    /* The loader's own slots are left alone (its malloc is its own until libc is up), and so is the vDSO. */
    if (strstr(name, "/ld-linux") || strncmp(name, "linux-vdso", 10) == 0 || strncmp(name, "linux-gate", 10) == 0)
        return 0;
    struct dyn_info d;
    if (!read_dyn(info, &d))
        return 0;
    s->objects++;
    scan_relocs(d.rela, d.relasz, &d, base, s);
    if (d.pltrel == DT_RELA)
        scan_relocs(d.jmprel, d.pltrelsz, &d, base, s);
    return 0;
}

/* Patch (restore = 0) or restore (1) every slot of every loaded object. Caller holds patch_lock. */
static void scan_all(int restore)
{
    struct scan s = {.restore = restore};
    if (!restore) {
        struct definers defs = {{0}};
        dl_iterate_phdr(count_definers, &defs);
        for (int i = 0; i < H_COUNT; i++)
            s.unique[i] = defs.count[i] == 1;
    }
    dl_iterate_phdr(scan_object, &s);
    ADD(hs_control.slots_patched, s.patched_delta);
    STORE(hs_control.slots_unwritable, s.unwritable);
    STORE(hs_control.objects_scanned, s.objects);
    if (!restore)
        STORE(hs_control.lazy_skipped, s.lazy_skipped);
    ADD(hs_control.scans, 1);
}

static int read_adds(struct dl_phdr_info *info, size_t size, void *data)
{
    *(unsigned long long *)data = size >= offsetof(struct dl_phdr_info, dlpi_subs) ? info->dlpi_adds : 0;
    return 1; /* the counters are the same in every entry: one is enough */
}

static unsigned long long loader_adds(void)
{
    unsigned long long adds = 0;
    dl_iterate_phdr(read_adds, &adds);
    return adds;
}

/* ---- the lease and the control thread ----------------------------------------------------------------------- */
static int lease_read_fd = -1;
static int lease_write_fd = -1;
static uint64_t lease_ino;

static uint64_t fd_ino(int fd)
{
    struct stat st;
    return fd >= 0 && syscall(SYS_fstat, fd, &st) == 0 && S_ISFIFO(st.st_mode) ? (uint64_t)st.st_ino : 0;
}

/* Close our ends of the lease, but only descriptors that are still our pipe: the program may have closed one
 * and got the number back for something of its own. */
static void close_lease(void)
{
    if (lease_read_fd >= 0 && fd_ino(lease_read_fd) == lease_ino)
        close(lease_read_fd);
    if (lease_write_fd >= 0 && fd_ino(lease_write_fd) == lease_ino)
        close(lease_write_fd);
    lease_read_fd = lease_write_fd = -1;
}

/* A fresh lease: a pipe whose write end heapscope takes (pidfd_getfd) before it asks to arm. */
static int new_lease(void)
{
    int fds[2];
    close_lease();
    if (pipe2(fds, O_CLOEXEC) != 0)
        return -errno;
    lease_read_fd = fds[0];
    lease_write_fd = fds[1];
    lease_ino = fd_ino(fds[0]);
    STORE(hs_control.lease_ino, lease_ino);
    STORE(hs_control.lease_fd, (int64_t)lease_write_fd);
    return 0;
}

static void disarm(uint64_t reason)
{
    pthread_mutex_lock(&patch_lock);
    STORE(armed, 0);
    scan_all(1);
    /* Every slot of every loaded object is restored now; the slots of an object dlclose'd while armed went
     * with it, so the running count (which still holds them) is set to what is true: none. */
    STORE(hs_control.slots_patched, 0);
    pthread_mutex_unlock(&patch_lock);
    STORE(hs_control.disarm_reason, reason);
    STORE(hs_control.forked_armed, 0);
    new_lease(); /* before the state says idle: whoever sees idle can take the new lease */
    __atomic_store_n(&hs_control.state, LOAD(threadless) ? HS_STATE_THREADLESS : HS_STATE_IDLE, __ATOMIC_RELEASE);
}

/* Threadless and armed: whether heapscope's lease is gone (its write end closed, or the descriptor the program's
 * now), and if so the hooks stop (armed 0; the slots stay patched, passing through). Called from a hook: no lock,
 * no allocation, nothing that blocks, errno as it was. The first thread to see the loss says why. */
static uint64_t threadless_lease_lost(void)
{
    int saved = errno;
    uint64_t reason = HS_DISARM_NONE;
    if (fd_ino(lease_read_fd) != lease_ino) {
        reason = HS_DISARM_PIPE_LOST;
    } else {
        struct pollfd pfd = {.fd = lease_read_fd, .events = 0};
        if (syscall(SYS_poll, &pfd, 1, 0) > 0 && (pfd.revents & (POLLHUP | POLLERR | POLLNVAL)))
            reason = HS_DISARM_CONTROLLER_GONE;
    }
    errno = saved;
    int was_armed = 1;
    if (reason != HS_DISARM_NONE && __atomic_compare_exchange_n(&armed, &was_armed, 0, 0, __ATOMIC_RELAXED,
                                                                __ATOMIC_RELAXED)) {
        STORE(hs_control.disarm_reason, reason);
        __atomic_store_n(&hs_control.state, HS_STATE_THREADLESS, __ATOMIC_RELEASE);
    }
    return reason;
}

static int64_t arm(uint64_t rate)
{
    if (LOAD(armed))
        return -EBUSY;
    if (rate == 0 || rate > HS_MAX_RATE)
        return -EINVAL;
    if (lease_write_fd < 0 || lease_read_fd < 0)
        return -EBADF;
    /* From now on heapscope holds the only write end: its exit, however it happens, closes the lease. */
    close(lease_write_fd);
    lease_write_fd = -1;
    STORE(hs_control.lease_fd, (int64_t)-1);
    set_clear();
    reset_counts(); /* counts start at arming */
    /* and so do the statistics: a profile that re-arms a loaded sampler reads its own samples */
    STORE(hs_control.samples, 0);
    STORE(hs_control.sampled_frees, 0);
    STORE(hs_control.set_full, 0);
    STORE(hs_control.realloc_failed_sampled, 0);
    STORE(asked_rate, rate);
    STORE(sample_rate, rate);
    STORE(hs_control.sample_rate, rate); /* the rate asked, also when armed by a call (a forked child reads it) */
    STORE(hs_control.rate_in_force, rate);
    STORE(hs_control.rate_changes, 0);
    budget_start();
    pthread_mutex_lock(&patch_lock);
    STORE(armed, 1);
    scan_all(0);
    pthread_mutex_unlock(&patch_lock);
    STORE(hs_control.disarm_reason, HS_DISARM_NONE);
    ADD(hs_control.arm_count, 1);
    STORE(hs_control.state, HS_STATE_ARMED);
    return HS_OK;
}

static void handle_request(void)
{
    uint64_t seq = __atomic_load_n(&hs_control.request_seq, __ATOMIC_ACQUIRE);
    if (seq == LOAD(hs_control.ack_seq))
        return;
    uint64_t req = LOAD(hs_control.request);
    int64_t result = -EINVAL;
    if (req == HS_REQ_ARM) {
        result = arm(LOAD(hs_control.sample_rate));
    } else if (req == HS_REQ_DISARM) {
        if (LOAD(armed))
            disarm(HS_DISARM_REQUEST);
        result = HS_OK;
    }
    STORE(hs_control.result, result);
    __atomic_store_n(&hs_control.ack_seq, seq, __ATOMIC_RELEASE);
}

/* A threadless sampler's requests, each a call heapscope makes on one of the program's threads at a safe point
 * (outside the allocator, the loader, fork and signal handlers: where the control thread patches, as it would).
 * LEASE gives a fresh lease's write end for heapscope to take (after a heapscope that ended while armed, whose
 * loss no sample has seen yet: -EBUSY while another still holds it); ARM and DISARM as the control thread does
 * them; RESCAN patches objects loaded since (the control thread's poll of the loader). */
EXPORT int64_t hs_sampler_call(uint64_t request, uint64_t rate)
{
    if (!LOAD(threadless))
        return -EPERM; /* a control thread answers requests in this process */
    if (request == HS_REQ_LEASE) {
        /* Armed since its fork on its parent's lease, and profiled by no heapscope (none claimed it): this one
         * takes it over. */
        if (LOAD(armed) && LOAD(hs_control.forked_armed) == HS_FORKED_ARMED)
            disarm(HS_DISARM_REQUEST);
        if (LOAD(armed) && threadless_lease_lost() == HS_DISARM_NONE)
            return -EBUSY;
        if (lease_write_fd < 0 || fd_ino(lease_write_fd) != lease_ino) {
            int rc = new_lease();
            if (rc != 0)
                return rc;
        }
        return lease_write_fd;
    }
    if (request == HS_REQ_ARM)
        return arm(rate);
    if (request == HS_REQ_DISARM) {
        if (LOAD(armed) || LOAD(hs_control.slots_patched))
            disarm(HS_DISARM_REQUEST); /* also restores the slots of hooks that stopped at a lost lease */
        return HS_OK;
    }
    if (request == HS_REQ_RESCAN) {
        pthread_mutex_lock(&patch_lock);
        if (LOAD(armed))
            scan_all(0);
        pthread_mutex_unlock(&patch_lock);
        return HS_OK;
    }
    return -EINVAL;
}

static int holding; /* the program waits in hold_for_arming (run --mode=sampled) */

static void *control_thread(void *arg)
{
    (void)arg;
    prctl(PR_SET_NAME, "hs-sampler", 0, 0, 0);
    STORE(hs_control.control_tid, (uint64_t)syscall(SYS_gettid));
    unsigned long long adds_seen = 0;
    unsigned ticks = 0;
    for (;;) {
        int is_armed = LOAD(armed);
        /* Idle, the thread also wakes for a byte heapscope writes into the lease after a request, so that an
         * arm is answered at once rather than at the next tick. The pipe is the sampler's own while idle (its
         * inode is checked), and the byte is read here: none is left to wake it again. */
        int wakeable = !is_armed && lease_read_fd >= 0 && fd_ino(lease_read_fd) == lease_ino;
        /* Armed, events = 0: a pipe's read end still reports POLLHUP (no writer left), POLLERR and POLLNVAL,
         * and nothing is ever read from it, so a descriptor the program reused is never consumed. */
        struct pollfd pfd = {.fd = lease_read_fd, .events = wakeable ? POLLIN : 0};
        /* Every 50 ms armed (the watchdog's period), 500 ms idle, 2 ms while a preloaded program waits in
         * hold_for_arming for heapscope's first request. */
        int watched = is_armed || wakeable;
        int n = poll(watched ? &pfd : NULL, watched ? 1 : 0, is_armed ? 50 : LOAD(holding) ? 2 : 500);
        if (wakeable && n > 0 && (pfd.revents & POLLIN)) {
            char wake[64];
            (void)!read(lease_read_fd, wake, sizeof wake);
        } else if (wakeable && n > 0) {
            new_lease(); /* its write end was closed under it (a program closing every descriptor): no spin */
        }
        if (is_armed) {
            if (fd_ino(lease_read_fd) != lease_ino)
                disarm(HS_DISARM_PIPE_LOST);
            else if (n > 0 && (pfd.revents & (POLLHUP | POLLERR | POLLNVAL)))
                disarm(HS_DISARM_CONTROLLER_GONE);
        }
        handle_request();
        if (LOAD(armed)) {
            unsigned long long adds = loader_adds();
            /* New objects at once; lazy slots left alone are looked at again every second (20 polls), as
             * they get bound at their first call. */
            int lazy_due = LOAD(hs_control.lazy_skipped) != 0 && ++ticks % 20 == 0;
            if (adds != adds_seen || lazy_due) {
                pthread_mutex_lock(&patch_lock);
                if (LOAD(armed))
                    scan_all(0);
                pthread_mutex_unlock(&patch_lock);
                adds_seen = adds;
            }
        } else {
            adds_seen = 0;
        }
    }
    return NULL;
}

/* A forked child has no control thread. Forked while armed under heapscope's lease (a prefork server's new
 * worker, a database's new backend), it stays armed, threadless: its hooks sample from the fork on and watch the
 * lease it inherited (heapscope holds the only write end, the child a copy of the read end), so that heapscope
 * profiles it with no stop at all and its end lets the child go at its next sample, as in any threadless process.
 * Its counts, statistics and set of sampled blocks start empty (the parent's blocks are not the child's samples),
 * and the forking thread draws a fresh countdown from a fresh seed (no two children sample alike). Forked while
 * not armed, the hooks pass everything through (restoring slots needs the loader's lock, which another thread may
 * have held at the fork), the child drops its copies of the lease, so that it never keeps a dead heapscope's
 * lease open, and heapscope's revive starts it again. A child made by a raw clone() without glibc's fork keeps
 * them until it execs (they are close-on-exec). */
static int forked; /* this process is a forked child of the one the library was loaded in */

static void after_fork_in_child(void)
{
    /* The parent's control thread may have held it at the fork: nobody here would ever unlock it. */
    pthread_mutex_init(&patch_lock, NULL);
    STORE(hs_control.control_tid, 0);
    if (LOAD(armed) && lease_write_fd < 0 && lease_read_fd >= 0) {
        set_clear();
        reset_counts();
        struct thread_state *t = &tls;
        if (t->counts && !t->counts_shared)
            STORE(t->counts->tid, raw_gettid()); /* the forking thread's slot is the child's own thread's now */
        if (syscall(SYS_getrandom, &global_seed, sizeof global_seed, GRND_NONBLOCK) != sizeof global_seed)
            global_seed = splitmix64(global_seed ^ raw_gettid());
        t->seeded = 0;
        STORE(hs_control.samples, 0);
        STORE(hs_control.sampled_frees, 0);
        STORE(hs_control.set_full, 0);
        STORE(hs_control.realloc_failed_sampled, 0);
        STORE(threadless, 1);
        STORE(hs_control.forked_armed, HS_FORKED_ARMED);
        return; /* state ARMED with no control thread's id: threadless */
    }
    STORE(armed, 0);
    STORE(live_samples, 0);
    close_lease();
    STORE(hs_control.lease_fd, (int64_t)-1);
    STORE(threadless, 0); /* heapscope's revive decides again */
    STORE(hs_control.forked_armed, 0);
    forked = 1;
    STORE(hs_control.state, HS_STATE_BROKEN);
}

static int start_control_thread(void);

/* The process's threads, its 20th field in /proc/self/stat, read with no allocation; 0 when it cannot be read. */
static long thread_count(void)
{
    char buf[1024];
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the end of the command's name, which may hold spaces */
    if (!p)
        return 0;
    for (int field = 2; *p && field < 20; p++)
        if (*p == ' ')
            field++;
    return strtol(p, NULL, 10);
}

/* A single-threaded program keeps its libc's single-threaded fast paths (glibc's malloc without its arena lock
 * and atomics, system calls without the cancellation wrappers: some 3% of a prefork worker's requests, and its
 * forked workers inherit the mode) only while it never gets a second thread: loaded into one by heapscope's
 * injection (on a thread of its own, which it joins after), the sampler starts no control thread, and heapscope
 * makes its requests by calls. A program that loads the library itself keeps the control thread. */
#define HS_LOAD_THREAD "hs-load" /* the name of the thread heapscope's injection loads the library on */

static int single_threaded_program(void)
{
    char name[16] = {0};
    prctl(PR_GET_NAME, name, 0, 0, 0);
    return strcmp(name, HS_LOAD_THREAD) == 0 && thread_count() == 2; /* the program's one thread, and this */
}

/* Set when the library kept a single-threaded program so: heapscope's injection stub reads it after joining the
 * thread that loaded it, and only then puts glibc's single-threaded flags back. */
EXPORT int hs_kept_single_threaded;

/* Idle with no control thread: the process may start none, or is single-threaded and stays so. */
static void become_threadless(void)
{
    STORE(threadless, 1);
    STORE(hs_control.state, HS_STATE_THREADLESS);
}

/* Threadless, for a single-threaded process kept so (marked for the injection stub and heapscope's log). */
static void stay_single_threaded(void)
{
    hs_kept_single_threaded = 1;
    become_threadless();
}

/* A forked child (a prefork server's worker, a database's backend) has the library but no control thread.
 * heapscope brings it back by calling this through its injection, at a safe point of one of the child's
 * threads: a new lease, a new control thread (or, where the child may start none, threadless), idle until
 * heapscope arms it. The hooks the child inherited pass everything through meanwhile. Returns 0 (1:
 * threadless), or -ENOTSUP where the library failed to start in its own process (that is not mended by starting
 * again), -EALREADY where it runs already. */
EXPORT int64_t hs_sampler_revive(void)
{
    if (!forked)
        return LOAD(hs_control.state) == HS_STATE_BROKEN ? -ENOTSUP : -EALREADY;
    if (LOAD(hs_control.state) != HS_STATE_BROKEN)
        return -EALREADY;
    if (new_lease() != 0)
        return -EAGAIN;
    forked = 0; /* it runs as in a process of its own now; a fork of this one is a child again */
    if (thread_count() == 1) { /* a call of heapscope's on the child's one thread */
        stay_single_threaded();
        return 1;
    }
    if (start_control_thread() != 0) {
        become_threadless();
        return 1;
    }
    STORE(hs_control.state, HS_STATE_IDLE);
    return 0;
}

static void broken(void)
{
    STORE(hs_control.state, HS_STATE_BROKEN);
}

/* `heapscope run --mode=sampled` preloads the library (LD_PRELOAD) instead of injecting it, with
 * HEAPSCOPE_SAMPLER_HOLD=<ms>: the constructor then waits, up to that long, for heapscope to arm the sampler,
 * so the program's own allocations from main() on are sampled. It first puts the environment back as it
 * was (LD_PRELOAD as given to heapscope, in HEAPSCOPE_SAMPLER_LD_PRELOAD), so that the program's children
 * neither load the sampler nor wait. Runs before main(): single-threaded but for the control thread. */
static void hold_for_arming(void)
{
    const char *hold = getenv("HEAPSCOPE_SAMPLER_HOLD");
    if (!hold || LOAD(threadless)) /* threadless, heapscope arms by a call, which waits for main() anyway */
        return;
    long ms = strtol(hold, NULL, 10);
    const char *preload = getenv("HEAPSCOPE_SAMPLER_LD_PRELOAD");
    if (preload)
        setenv("LD_PRELOAD", preload, 1);
    else
        unsetenv("LD_PRELOAD");
    unsetenv("HEAPSCOPE_SAMPLER_LD_PRELOAD");
    unsetenv("HEAPSCOPE_SAMPLER_HOLD");
    struct timespec tick = {.tv_sec = 0, .tv_nsec = 1000000};
    STORE(holding, 1);
    for (long waited = 0; waited < ms && LOAD(hs_control.state) != HS_STATE_ARMED; waited++)
        nanosleep(&tick, NULL);
    STORE(holding, 0);
}

__attribute__((constructor)) static void hs_sampler_init(void)
{
    page_size = sysconf(_SC_PAGESIZE);
    Dl_info self;
    if (dladdr((void *)&hs_control, &self))
        own_base = (uintptr_t)self.dli_fbase;
    define_hooks();
    uint64_t resolved = 0;
    for (int i = 0; i < H_COUNT; i++) {
        hooks[i].real = dlsym(RTLD_DEFAULT, hooks[i].name);
        if (hooks[i].real)
            resolved |= 1ULL << i;
    }
    STORE(hs_control.hooks_resolved, resolved);
    if (!hooks[H_MALLOC].real || !hooks[H_FREE].real)
        { broken(); return; }
    if (syscall(SYS_getrandom, &global_seed, sizeof global_seed, GRND_NONBLOCK) != sizeof global_seed)
        global_seed = splitmix64((uint64_t)time(NULL) ^ (uint64_t)getpid());
    set_buckets = mmap(NULL, set_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    set_filter = mmap(NULL, (size_t)1 << FILTER_BITS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    count_slots = mmap(NULL, sizeof(struct hs_counts) * HS_COUNT_SLOTS, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (set_buckets == MAP_FAILED || set_filter == MAP_FAILED || count_slots == MAP_FAILED)
        { broken(); return; }
    STORE(hs_control.counts_address, (uint64_t)(uintptr_t)count_slots);
    if (new_lease() != 0)
        { broken(); return; }
    pthread_atfork(NULL, NULL, after_fork_in_child);
    if (single_threaded_program())
        stay_single_threaded();
    else if (start_control_thread() != 0)
        become_threadless();
    else
        STORE(hs_control.state, HS_STATE_IDLE);
    hold_for_arming();
}

static int start_control_thread(void)
{
    /* The control thread takes no signal meant for the process. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    pthread_t tid;
    int rc = pthread_create(&tid, &attr, control_thread, NULL);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}
