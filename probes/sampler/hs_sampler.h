/* The contract between the in-process sampler (hs_sampler.c) and heapscope (agent/process/sampler.py).
 *
 * heapscope reads and writes `hs_sampler_control` in the target through /proc/PID/mem; the layout is fixed
 * (every field 8 bytes, in this order) and checked by tests/integration/test_sampler.py against the Python
 * mirror. Bump HS_CONTROL_VERSION on any change.
 */
#ifndef HS_SAMPLER_H
#define HS_SAMPLER_H

#include <stdint.h>

#define HS_CONTROL_MAGIC 0x4853534d504c5231ULL /* "HSSMPLR1" */
#define HS_CONTROL_VERSION 7

/* request: what heapscope asks for; it writes the request fields, then request_seq (last). A sampler with no
 * control thread (HS_STATE_THREADLESS) is asked by a call instead: hs_sampler_call(request, rate), which heapscope
 * makes on one of the program's threads at a safe point; LEASE and RESCAN are asked only that way. */
enum hs_request { HS_REQ_NONE = 0, HS_REQ_ARM = 1, HS_REQ_DISARM = 2, HS_REQ_LEASE = 3, HS_REQ_RESCAN = 4 };

/* state, as the sampler last left it. THREADLESS: loaded and idle, but the process could start no control thread
 * (its RLIMIT_NPROC, a cgroup's pids.max): heapscope arms it, rescans and disarms it by calls, and armed without a
 * thread (state ARMED, control_tid 0) its hooks watch the lease themselves, at each sample. */
enum hs_state {
    HS_STATE_LOADING = 0, HS_STATE_IDLE = 1, HS_STATE_ARMED = 2, HS_STATE_BROKEN = 3, HS_STATE_THREADLESS = 4
};

/* Why the sampler last disarmed. */
enum hs_disarm_reason {
    HS_DISARM_NONE = 0,
    HS_DISARM_REQUEST = 1,         /* heapscope asked */
    HS_DISARM_CONTROLLER_GONE = 2, /* the last write end of the lease pipe closed: heapscope exited or died */
    HS_DISARM_PIPE_LOST = 3,       /* the program closed or reused the lease pipe's descriptor */
};

/* Results of a request (negative errno values are also used). */
#define HS_OK 0

struct hs_sampler_control {
    uint64_t magic;
    uint64_t version;
    /* written by heapscope */
    uint64_t request_seq;
    uint64_t request;     /* enum hs_request */
    uint64_t sample_rate; /* mean bytes between samples asked for (the rate in force is at most this low) */
    /* written by the sampler */
    uint64_t ack_seq; /* request_seq of the last request handled */
    int64_t result;   /* of that request: HS_OK or -errno */
    uint64_t state;   /* enum hs_state */
    int64_t lease_fd; /* write end of the lease pipe, for pidfd_getfd; -1 while a controller holds the lease */
    uint64_t lease_ino;
    uint64_t disarm_reason; /* enum hs_disarm_reason */
    uint64_t arm_count;
    /* statistics (relaxed, approximate while armed) */
    uint64_t slots_patched;    /* GOT slots now pointing at a hook */
    uint64_t slots_unwritable; /* slots left alone: read-only and not RELRO */
    uint64_t objects_scanned;
    uint64_t scans;
    uint64_t samples;
    uint64_t sampled_frees;
    uint64_t set_full; /* samples whose address did not fit the set: their free is not reported */
    uint64_t realloc_failed_sampled;
    uint64_t control_tid;
    uint64_t hooks_resolved; /* bit i: hook i found its real function */
    uint64_t lazy_skipped;   /* lazy slots not bound yet, left alone (several objects define the name) */
    uint64_t counts_address; /* struct hs_counts[counts_used]: exact per-thread counts since arming */
    uint64_t counts_used;
    uint64_t forked_armed; /* enum hs_forked: a child forked while armed, armed since its fork */
    /* the sampling budget: written by heapscope before an arm, and by a daemon that shares its total among its
     * targets while armed; read at each sample */
    uint64_t max_samples; /* samples a second the process may take (0: no cap); the rate in force rises to keep it */
    /* written by the sampler */
    uint64_t rate_in_force; /* mean bytes between samples now: sample_rate, or more while the budget holds it up */
    uint64_t rate_changes;  /* times the budget moved the rate in force since arming */
};

/* forked_armed: a child forked while its parent was armed samples from its fork on, threadless, on its parent's
 * lease (HS_FORKED_ARMED); the heapscope that holds that lease writes HS_FORKED_CLAIMED when it profiles the
 * child. A LEASE call takes over an unclaimed one (another heapscope than the parent's). Any disarm sets 0. */
enum hs_forked {
    HS_FORKED_ARMED = 1,
    HS_FORKED_CLAIMED = 2,
};

/* The allocation function a sample came from: the fourth argument of hs_sample_alloc, with the values of
 * `enum hs_fn` in probes/heap.h (exact mode's kinds; a test checks they agree). Each hook passes the kind
 * exact mode records for the same call: the C++ operators and mallocx are malloc (libstdc++'s operator new
 * calls malloc), the aligned operators memalign (they call aligned_alloc), rallocx realloc. */
enum hs_sample_fn {
    HS_SAMPLE_MALLOC = 0,
    HS_SAMPLE_CALLOC = 1,
    HS_SAMPLE_REALLOC = 2,
    HS_SAMPLE_MEMALIGN = 3, /* memalign, aligned_alloc, aligned operator new */
    HS_SAMPLE_POSIX_MEMALIGN = 4,
    HS_SAMPLE_VALLOC = 5,
    HS_SAMPLE_PVALLOC = 6,
    HS_SAMPLE_REALLOCARRAY = 7,
};

/* Exact counts of one thread (two cache lines, written only by its thread; the last slot is shared by the
 * threads beyond HS_COUNT_SLOTS - 1, with atomic adds). malloc's and free's hooks touch only allocs,
 * alloc_bytes and frees; every other hook also adds one to its function's count, in the same line. So the
 * calls of malloc (operator new and mallocx included) are allocs minus the other functions' counts, and
 * those of free (delete, dallocx and sdallocx included) frees minus realloc_frees. */
#define HS_COUNT_SLOTS 16384
struct hs_counts {
    uint64_t allocs;         /* allocation calls that returned a block (reallocs included) */
    uint64_t frees;          /* free calls (and deletes) with a non-null pointer, and reallocs of one */
    uint64_t alloc_bytes;    /* bytes those allocations asked for */
    uint64_t callocs;        /* of allocs: calloc */
    uint64_t reallocs;       /* of allocs: realloc, reallocarray, rallocx */
    uint64_t memaligns;      /* of allocs: memalign, aligned_alloc, aligned operator new */
    uint64_t posix_memaligns;/* of allocs: posix_memalign */
    uint64_t vallocs;        /* of allocs: valloc */
    /* second line: rarely written */
    uint64_t pvallocs;       /* of allocs: pvalloc */
    uint64_t realloc_frees;  /* of frees: the old blocks of reallocs */
    uint64_t tid;            /* the thread that claimed the slot (0: the shared last slot) */
    uint64_t pad[5];
};

#endif
