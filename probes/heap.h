/* heap.h: the contract between heap.bpf.c and heapscope's Python side (agent/contract.py reads it).
 *
 * Only structs, enums and sizes live here. Settings arrive as -D defines at compile time
 * (see agent/kernel/probes.py: HS_* names); the defaults below are used when a define is missing.
 */
#ifndef HEAPSCOPE_HEAP_H
#define HEAPSCOPE_HEAP_H

#ifndef HS_MAX_DEPTH
#define HS_MAX_DEPTH 64          /* frames kept per stack, before Massif's trimming */
#endif
#ifndef HS_MAX_BLOCKS
#define HS_MAX_BLOCKS 524288     /* blocks: the overflow table for blocks whose bucket in block_slots is full */
#endif
#ifndef HS_BLOCK_SLOTS
#define HS_BLOCK_SLOTS 1048576   /* block_slots: a power of two (two slots a bucket) */
#endif
#ifndef HS_MAX_STACKS
#define HS_MAX_STACKS 65536      /* distinct allocation stacks (site ids); site 0 is the overflow site */
#endif
#ifndef HS_TARGET_BLOCKS
#define HS_TARGET_BLOCKS 1048576 /* live blocks one target may hold in the shared block tables (--max-blocks) */
#endif
#ifndef HS_TARGETS
#define HS_TARGETS 1             /* targets one loaded program serves at once (slots), each with its own maps */
#endif
#ifndef HS_MAX_THREADS
#define HS_MAX_THREADS 16384     /* overflow table: threads in an allocation call whose slot is taken */
#endif
#ifndef HS_PENDING_SLOTS
#define HS_PENDING_SLOTS 8192    /* per-thread call slots, indexed by tid mod this (a power of two) */
#endif
#ifndef HS_HEAP_ADMIN
#define HS_HEAP_ADMIN 8          /* Massif --heap-admin */
#endif
#ifndef HS_ALIGNMENT
#define HS_ALIGNMENT 16          /* Massif --alignment */
#endif
#ifndef HS_TARGET_TGID
#define HS_TARGET_TGID 0         /* the profiled process */
#endif
#ifndef HS_FREE_STACKS
#define HS_FREE_STACKS 0         /* 1: freed bytes are charged to the stack of the free call (xtree full) */
#endif
#ifndef HS_STOP_EVENTS
#define HS_STOP_EVENTS 0         /* 1 (run): stop the target at its exec, at each change of its loaded objects
                                  * and at exit(), until user space has read its mappings and loaded their
                                  * unwind tables; 0 (attach): only tell user space, never stop the target */
#endif
#ifndef HS_MALT
#define HS_MALT 0                /* 1: also keep MALT's statistics (implies free stacks) */
#endif
#ifndef HS_MAX_SIZES
#define HS_MAX_SIZES 65536       /* distinct request sizes in MALT's sizeMap */
#endif
#ifndef HS_MAX_JUMPS
#define HS_MAX_JUMPS HS_MAX_SIZES /* distinct (old size, new size) pairs of MALT's realloc jumps */
#endif
#ifndef HS_MAX_PENDING
#define HS_MAX_PENDING HS_MAX_THREADS /* pending: calls whose thread's slot another thread holds */
#endif
#define HS_LOG2_BINS 64          /* log2 bins of the scatter histograms */
#define HS_SMALL_SIZES 4096      /* MALT sizeMap: sizes below this are counted in an array */
#define HS_THREAD_SLOTS 1024     /* MALT per-thread statistics: array slots, by tid mod this */

#ifndef HS_PAGES
#define HS_PAGES 0               /* 1: trace mmap/munmap/mremap/brk and send one event per call (page_events) */
#endif
#ifndef HS_PAGE_RING_PAGES
#define HS_PAGE_RING_PAGES 1024  /* page_events ring buffer: pages of 4 KiB (a power of two) */
#endif
#ifndef HS_STACKS
#define HS_STACKS 0              /* 1: keep each thread's stack extent (--stacks=yes) */
#endif
#ifndef HS_IGNORE
#define HS_IGNORE 0              /* 1: --ignore-fn given: blocks of ignored sites, and reallocs of them, are not
                                  * counted, as Massif, by the sites' flags user space writes (site_flags) */
#endif
#define HS_FN_PAGES 15           /* hs_site.fn of a stack that made a page syscall (not an allocation function) */

#ifndef HS_ARM_ON_EXEC
#define HS_ARM_ON_EXEC 0         /* 1: `run` arms at the target's first exec; 0: `attach` is armed at load */
#endif

#ifndef HS_UNWIND
#define HS_UNWIND 1              /* 1: walk stacks with .eh_frame tables (agent/symbols/unwind.py); 0: frame pointers */
#endif
#ifndef HS_MAX_ROWS
#define HS_MAX_ROWS 2097152      /* unwind table rows, all objects together */
#endif
#define HS_MAX_UMAPS 512         /* executable mappings with unwind tables (twice: double-buffered) */
#define HS_UMAPS_HALF_SHIFT 10   /* control[HS_CTL_UMAPS]: the half's place, above the count (see enum hs_control) */
#define HS_UMAPS_ID_SHIFT 11     /* and the mapping set's identity's, above the half */
#define HS_STACK_OVERFLOW 0      /* site id of allocations whose stack was not stored (table full, walk overtaken) */

/* ---- the snapshot schedule: where Massif would take a snapshot, recorded at the event that reaches it ---- */
#ifndef HS_SCHED_NS
#define HS_SCHED_NS 0            /* 1: the schedule's time is bpf_ktime_get_ns (--time-unit=ms); 0: time_b (B) */
#endif
#ifndef HS_SCHED_RING_PAGES
#define HS_SCHED_RING_PAGES 16   /* sched_points ring buffer: pages of 4 KiB (a power of two) */
#endif
/* Sampled mode: at most this many points past HS_CTL_SCHED_CULL_AT before the kernel wakes user space (exact
 * mode: none). Its looks drain them, a second apart at most, and the guessed interval keeps them meanwhile to
 * about --max-snapshots for each doubling of the time so far. Since the last drain at most --max-snapshots points
 * reach the cull; the slack stops at HS_SCHED_WAKE_PENDING with them, as --max-snapshots=1000 (its most) does
 * in exact mode, which leaves a burst the ring's other 365 while user space wakes. */
#define HS_SCHED_SAMPLED_SLACK 256
#define HS_SCHED_WAKE_PENDING 1000
#ifndef HS_SNAP_RING_PAGES
#define HS_SNAP_RING_PAGES 64    /* snap_log ring buffer: pages of 4 KiB (a power of two) */
#endif

/* The kind of allocation call a pending call is: decides how its arguments are read (request_size in
 * heap.bpf.c). Each kind has an entry program <kind>_enter; agent/model/functions.py maps symbols to kinds. */
enum hs_fn {
    HS_MALLOC = 0,        /* size = arg0 */
    HS_CALLOC = 1,        /* size = arg0 * arg1 */
    HS_REALLOC = 2,       /* old = arg0, size = arg1 */
    HS_MEMALIGN = 3,      /* size = arg1 (aligned_alloc too) */
    HS_POSIX_MEMALIGN = 4,/* *arg0 = result, size = arg2, returns 0 on success */
    HS_VALLOC = 5,        /* size = arg0 */
    HS_PVALLOC = 6,       /* size = arg0 rounded up to a page */
    HS_REALLOCARRAY = 7,  /* old = arg0, size = arg1 * arg2 */
    HS_FREE = 8,          /* the site of a free call (MALT's free statistics) */
    HS_FN_COUNT = 9,
};


/* One live block, keyed by its address. Sizes follow Massif's accounting, not the allocator's. */
struct hs_block {
    __u64 size;   /* requested bytes */
    __u64 slop;   /* Massif's rounding slop; extra = slop + HS_HEAP_ADMIN */
    __u64 stack;  /* site id: index into sites */
    __u64 alloc_ns; /* when it was allocated (HS_MALT: lifetimes) */
};

/* Sampled mode (bpf/sampled.h): one live sampled block, keyed by its address, with what it was recorded at:
 * the bytes and blocks it stands for (its weight) and their Massif extra bytes, so its free takes back
 * exactly that. */
#ifndef HS_TASK_MM
#define HS_TASK_MM 0        /* HS_SAMPLED: offsetof(struct task_struct, mm), from the running kernel's BTF */
#define HS_MM_TOTAL_VM 0    /* HS_SAMPLED: offsetof(struct mm_struct, total_vm) */
#endif
#ifndef HS_SAMPLE_RATE
#define HS_SAMPLE_RATE 524288    /* sampled mode: the sampler's mean bytes between samples */
#endif
#ifndef HS_SAMPLED
#define HS_SAMPLED 0             /* 1: sampled mode (heap.bpf.c includes bpf/sampled.h) */
#endif
#ifndef HS_MAX_SAMPLED_BLOCKS
#define HS_MAX_SAMPLED_BLOCKS 65536 /* sampled mode: live sampled blocks (sampled_blocks; --max-blocks) */
#endif
struct hs_sampled_block {
    __u64 bytes;  /* estimated bytes: blocks * size */
    __u64 blocks; /* estimated blocks: 1 / (1 - e^(-size/rate)), rounded at random to a whole number */
    __u64 extra;  /* blocks * (Massif's slop of size + HS_HEAP_ADMIN) */
    __u64 stack;  /* site id */
    __u64 size;   /* the sampled call's own size */
    __u64 alloc_ns; /* HS_MALT: lifetimes */
};

/* One live block in block_slots, the same as struct hs_block with its address (0: the slot is free). 32 bytes:
 * a bucket of two slots is one cache line. A block whose slop or site id needs more than 32 bits goes to the
 * overflow hash instead. */
struct hs_block_slot {
    __u64 addr;
    __u64 size;
    __u64 slop_site;  /* slop << 32 | site id */
    __u64 alloc_ns;
};

/* One allocation stack's counters, at its site id in `sites`. User space reads them at every snapshot (through
 * a read-only mapping of the array), so they are kept apart from the stack itself (struct hs_stack). */
struct hs_site {
    __u64 cur_bytes;
    __u64 cur_blocks;
    __u64 tot_bytes;
    __u64 tot_blocks;
    __u64 freed_bytes;
    __u64 freed_blocks;
    __u64 peak_bytes;  /* cur_bytes at the global peak numbered peak_gen */
    __u64 peak_gen;
    __u64 cur_extra;   /* Massif's extra bytes of the live blocks (--ignore-fn takes them off the total) */
    __u64 peak_extra;  /* cur_extra at the global peak numbered peak_gen */
    /* MALT's statistics (HS_MALT): sizes exclude zero-size requests, which only count in count_zeros. */
    __u64 fn;          /* enum hs_fn of the call that created the site */
    __u64 alloc_min;
    __u64 alloc_max;
    __u64 count_zeros;
    __u64 max_alive;   /* highest cur_bytes ever */
    __u64 free_count;  /* frees made from this stack */
    __u64 free_min;
    __u64 free_max;
    __u64 free_sum;
    __u64 life_count;  /* lifetimes (ns) of this stack's blocks, counted at their free; 0 is not counted */
    __u64 life_min;
    __u64 life_max;
    __u64 life_sum;
    __u64 realloc_count;
    __s64 realloc_delta; /* sum of new size - old size over this stack's reallocs */
    __u64 snap_epoch;  /* hs_global.sched_points at the site's last change (the snapshot log: site_touch) */
};

/* One allocation stack's return addresses (innermost first, zero-terminated when shorter than HS_MAX_DEPTH),
 * at its site id in `site_stacks`. Written once, when the site is created at a call's entry; read once by
 * user space, to symbolize a new site. */
struct hs_stack {
    __u64 ip[HS_MAX_DEPTH];
};

/* MALT: one thread's use of one allocation function, keyed by tid << 8 | enum hs_fn. */
struct hs_thread_stat {
    __u64 count;
    __u64 bytes;
    __u64 ns;     /* time inside the function, entry to return (free: not measured, it has no return probe) */
};

/* A thread's statistics for one function, in an array slot owned by the first thread that used it. */
struct hs_thread_slot {
    __u64 tid;
    struct hs_thread_stat stat;
};

/* MALT's reallocJump key. */
struct hs_jump {
    __u64 old_size;
    __u64 new_size;
};

/* MALT's memory timeline: the heap's highest point since user space last looked, and the site that set it.
 * User space resets it to the current heap at each sample. */
struct hs_window {
    __u64 max_heap;
    __u64 site;
};

/* Per-CPU caches of the stack walk. Their entries are validated by a sequence number: odd while an entry is
 * being written, so a program that preempted the writer on the same CPU never takes a half-written entry. */
#define HS_STACK_CACHE 64        /* stack hash -> site id, direct-mapped by hash bits */
#define HS_RULE_CACHE 1024       /* return address -> unwind rule, direct-mapped by address bits */
#ifndef HS_COPY_BYTES
#define HS_COPY_BYTES 2048       /* the stack walk reads the user stack in runs of up to this long: one read
                                  * costs ~0.1 us here whatever its length, and 2 KiB hold ~20 typical frames */
#endif

/* A stack stored recently from a CPU: hot stacks skip the stack_ids lookup. */
struct hs_last_stack {
    __u64 seq;
    __u64 hash;
    __u64 id;
};

/* The unwind rule found for one pc in the mapping set whose identity is `umaps` (control[HS_CTL_UMAPS] >>
 * HS_UMAPS_ID_SHIFT): good for every target that publishes the same set. */
struct hs_rule_entry {
    __u64 seq;
    __u64 pc;
    __u64 umaps;
    __u64 rule;   /* HS_RULE_* packed: cfa_offset << 32 | rbp_offset << 16 | flags << 8 | cfa_type */
};

/* A run of the user stack copied by one read, so one read serves all the frames it covers; and the walk's
 * unwind counters, added to struct hs_global once per walk. Kept in memory rather than in the walk's
 * variables: values the verifier can see would split its states by every count. */
struct hs_stack_copy {
    __u64 w[HS_COPY_BYTES / 8];
    __u64 base;   /* user address of w[0] */
    __u64 copied; /* bytes of w that hold the stack from base (0 at the start of each walk) */
    __u64 frames;
    __u64 fp;
    __u64 no_rule;
    __u64 searched;
    __u64 walks;  /* walks started on this CPU: one that sees it move was overtaken (see walks_interrupted) */
    __u64 site;   /* a walk's site id, passed through memory (bpf/unwind.h capture_site) */
};

/* Arguments of an allocation call between its entry and its return, per thread. */
struct hs_pending {
    __u64 arg0;
    __u64 arg1;
    __u64 arg2;
    __u64 stack;  /* site id of the call's stack */
    __u64 sp;     /* stack pointer at entry: a nested call runs below it */
    __u64 entry_ns; /* HS_MALT: time inside the allocator */
    __u64 ret0;   /* [rsp] at entry: the caller's return address */
    __u64 tid;    /* owner of a slot; 0 when the slot is free (64 bits: BPF's cmpxchg wants them) */
    __u32 fn;     /* enum hs_fn */
    __u32 nested; /* allocation calls made from inside this one (realloc -> malloc): not counted twice */
};

/* Global state: one entry. The peak fields describe the exact state at the highest total. */
/* Indexes of the control map: words user space writes while the probes run. */
enum hs_control {
    HS_CTL_ARMED = 0,     /* 0 before the target's exec (run), after a later exec, or at detach */
    HS_CTL_STOPPED = 1,   /* enum hs_event while the target is stopped for user space (HS_STOP_EVENTS) */
    HS_CTL_UMAPS = 2,     /* published unwind mappings: identity << 11 | half << 10 | count (in unwind_maps:
                           * the half's run of HS_MAX_UMAPS). The identity (never 0 for a set that has any)
                           * is a hash of the mappings (start, end, bias, object): targets that map the same
                           * objects at the same places, a prefork server's workers, share cached rules, and a
                           * rule cached under one set is never used for another. */
    HS_CTL_STACK_EPOCH = 3, /* HS_STACKS: bumped by user space at each sample; starts a new low-water mark */
    HS_CTL_STACK_END = 4, /* where the main thread's stack reads must stop: above argc, where exec left %rsp
                           * (frames lie below; above may be pages never touched) (0: unknown) */
    /* The snapshot schedule (see struct hs_sched_point). Written by both sides: */
    HS_CTL_SCHED_DUE = 5,      /* the time (unit of struct hs_sched_point) from which the next event is a point:
                                * the kernel moves it on at each point, user space sets it from the series */
    HS_CTL_SCHED_PEAK_LEVEL = 6, /* heap + extra above which a free makes a peak point (Massif's peak snapshot
                                  * total plus --peak-inaccuracy): the kernel raises it at each peak point */
    HS_CTL_SCHED_DUE_JIFFIES = 7, /* HS_SCHED_NS: jiffies before which no event can reach the due time, so it
                                   * need not read the clock (0: read it); user space zeroes it with the due */
    /* and by user space, in the unit of the snapshots' times (B or ms): */
    HS_CTL_SCHED_INTERVAL = 8, /* Massif's minimum time interval between snapshots, as the series has it */
    HS_CTL_SCHED_CULL_AT = 9,  /* the point count at which the series culls next: from there the kernel
                                * guesses the interval until user space says it (0: never guess) */
    HS_CTL_SCHED_ORIGIN = 10,  /* HS_SCHED_NS: bpf_ktime_get_ns of time 0 */
    HS_CTL_SCHED_MAX = 11,     /* --max-snapshots: the guess is the time so far divided by it */
    HS_CTL_SCHED_PEAK_PPM = 12, /* --peak-inaccuracy, in millionths */
    HS_CTL_SCHED_JIFFY_NS = 13, /* HS_SCHED_NS: nanoseconds a jiffy (0: unknown, the clock is read always) */
    HS_CTL_PAGES_DRAINED = 14, /* page events user space has taken from their ring so far (its wake-up) */
    HS_CTL_SNAP_DRAINED = 15,  /* snapshot log records user space has taken from their ring so far */
    /* HS_SAMPLED: the process's mapped bytes, folded in the kernel at every page call (see probes/bpf/pages.h) */
    HS_CTL_MAPPED_NOW = 16,  /* as the last page call left them */
    HS_CTL_MAPPED_HIGH = 17, /* the most since user space last zeroed it (0: no call since) */
    HS_CTL_COUNT = 18,
};

/* Events sent to user space (perf buffer `events`), and the reasons the target is stopped. */
enum hs_event {
    HS_EV_EXEC = 1,       /* the target exec'ed: the new image's executable and loader are mapped */
    HS_EV_LOADER = 2,     /* the dynamic loader changed the list of loaded objects (_dl_debug_state) */
    HS_EV_EXIT = 3,       /* the target called exit(): its mappings are about to go */
    HS_EV_SCHEDULE = 4,   /* the point count reached HS_CTL_SCHED_CULL_AT: user space should drain the points
                           * and say the interval after its culling (stops the target only with time in B; in
                           * sampled mode, which drains at its looks, only HS_SCHED_SAMPLED_SLACK points later) */
    HS_EV_PAGES = 5,      /* the page events' ring is a quarter full: user space should drain it (with
                           * HS_STOP_EVENTS the target stops from three quarters on, until it has) */
    HS_EV_SNAP_LOG = 6,   /* the snapshot log's ring is half full: user space should drain it (never stops) */
    HS_EV_SITES = 7,      /* HS_IGNORE: an allocation call from a site user space has not flagged yet: flag the
                           * sites (stops the target with HS_STOP_EVENTS, before the call runs) */
};

/* HS_IGNORE: site_flags[site id], written by user space once it has symbolized the site. A block allocated at an
 * ignored site, or made ignored by a realloc, carries HS_BLOCK_IGNORED in its site id (ids stay below it). */
#define HS_BLOCK_IGNORED (1ULL << 31)
enum hs_site_flag {
    HS_SITE_UNKNOWN = 0,
    HS_SITE_COUNTED = 1,
    HS_SITE_IGNORED = 2,  /* its trimmed stack starts in an --ignore-fn function */
};

/* One point of the snapshot schedule (ring buffer sched_points): the first allocator event at or after the
 * due time, with the totals right after it; or, as Massif's peak snapshots, a free (or a shrinking realloc)
 * that comes down from above HS_CTL_SCHED_PEAK_LEVEL, with the totals right before it. */
enum hs_sched_kind {
    HS_SCHED_NORMAL = 0,
    HS_SCHED_PEAK = 1,
};
struct hs_sched_point {
    __u64 time;   /* time_b, or bpf_ktime_get_ns (HS_SCHED_NS) */
    __u64 heap;
    __u64 extra;
    __u64 kind;   /* enum hs_sched_kind */
    __u64 epoch;  /* the point's number: hs_global.sched_points before it (the snapshot log's epochs) */
};

/* One record of the snapshot log (ring buffer snap_log): a site's live bytes right before its first change after
 * the points numbered below `epoch`, so the tree at any point can be rebuilt (bpf/schedule.h site_touch). */
struct hs_snap_record {
    __u64 site;
    __u64 epoch;  /* hs_global.sched_points at the change: the record holds the site at points epoch-1 and before */
    __s64 bytes;  /* cur_bytes before the change */
    __s64 extra;  /* cur_extra before the change */
    __u64 allocs; /* tot_blocks before the change: 0 while the site has not allocated (not in Massif's tree yet) */
};

/* One row of an unwind table: agent/symbols/unwind.py's ROW ("<IBBhhH"). It covers [pc, next row's pc). */
enum hs_cfa_type {
    HS_CFA_RSP = 0,       /* CFA = rsp + cfa_offset */
    HS_CFA_RBP = 1,       /* CFA = rbp + cfa_offset */
    HS_CFA_PLT = 2,       /* CFA = rsp + 8, plus 8 when (pc & 15) >= 11 (the standard .plt rule) */
    HS_CFA_NONE = 3,      /* no rule: fall back to frame pointers */
    HS_CFA_END = 4,       /* outermost frame */
};
#define HS_RBP_SAVED 1       /* rbp is saved at CFA + rbp_offset */
#define HS_RULE_MAPPED 2     /* (rule cache only) a table covers the pc, though it may have no rule there */
#define HS_RBP_UNKNOWN 4     /* (rows only, for the reader) rbp's rule cannot be expressed: the walk keeps rbp */
struct hs_row {
    __u32 pc;             /* ELF virtual address in the object */
    __u8 cfa_type;        /* enum hs_cfa_type (unsigned: bcc cannot describe a signed char field) */
    __u8 flags;
    __s16 cfa_offset;
    __s16 rbp_offset;
    __u16 pad;
};

/* An executable mapping with a table: runtime address = ELF vaddr + bias. */
struct hs_umap {
    __u64 start;
    __u64 end;
    __u64 bias;
    __u32 row_begin;      /* first row in unwind_rows */
    __u32 row_count;
};

/* ---- page-level memory (HS_PAGES) and thread stacks (HS_STACKS) ---- */

/* The system calls that map memory, as page events name them. */
enum hs_page_kind {
    HS_PG_MMAP = 1,
    HS_PG_MUNMAP = 2,
    HS_PG_MREMAP = 3,
    HS_PG_BRK = 4,
};

/* A page syscall between its entry and its exit, per thread: the arguments and the caller's site. */
struct hs_page_call {
    __u64 tid;    /* walk_arg: the thread that filled it (a preemptible kernel may run another in between) */
    __u64 arg0;
    __u64 arg1;
    __u64 arg2;
    __u64 arg3;
    __u64 arg4;
    __u64 site;
    __u64 kind;   /* enum hs_page_kind */
    __u64 slot;   /* the target's slot (probes/bpf/common.h) */
};

/* One page syscall, sent at its exit (agent/model/pages.py PageEvent: the same fields). */
struct hs_page_event {
    __u64 time_ns;
    __u64 site;
    __u64 addr;       /* mmap: the result; munmap: addr; mremap: old address; brk: the requested break */
    __u64 length;     /* mmap/munmap: len; mremap: old size */
    __u64 new_addr;   /* mremap: the result; brk: the result (the new break) */
    __u64 new_length; /* mremap: new size */
    __u64 flags;      /* mmap/mremap flags */
    __u64 prot;
    __s64 ret;        /* the syscall's return value (negative: an error number) */
    __u32 tid;
    __u32 kind;       /* enum hs_page_kind */
};

/* Counters of the page side (page_counters), kept apart from hs_global. */
enum hs_page_counter {
    HS_PGC_EVENTS = 0,      /* events sent */
    HS_PGC_LOST = 1,        /* the ring buffer was full: event not sent (the page map is then inexact) */
    HS_PGC_CALLS_FULL = 2,  /* the per-thread call table was full at a syscall's entry: event not sent */
    HS_PGC_UNPAIRED = 3,    /* an exit without its entry (the call began before the probes were armed) */
    HS_PGC_BRK_FOLDED = 4,  /* HS_SAMPLED: brk calls folded into HS_CTL_MAPPED_NOW/HIGH instead of sent */
    HS_PGC_CODE_MAPS = 5,   /* mmap calls with PROT_EXEC and mremap calls: what can bring new code (user space reads
                             * the mappings again only when this moves, not at every page call) */
    HS_PGC_UNSAMPLED = 6,   /* HS_SAMPLED: mmap, munmap and mremap calls not sampled (folded, not sent) */
    HS_PGC_COUNT = 7,
};

/* A thread's stack extent (HS_STACKS): its top and the lowest stack pointer seen in the current epoch. */
struct hs_thread_stack {
    __u64 top;    /* the initial stack pointer (exec, clone) or the highest one seen */
    __u64 low;    /* the lowest stack pointer seen since `epoch` began */
    __u64 last;   /* the stack pointer at the latest probe hit */
    __u64 epoch;  /* control[HS_CTL_STACK_EPOCH] when `low` was last reset */
};

struct hs_global {
    __u64 execs;          /* exec calls seen in the target */
    __u64 n_sites;        /* site ids handed out: sites 1..n_sites are in use (0 is the overflow site) */
    __u64 heap;           /* useful bytes live */
    __u64 extra;          /* Massif's extra bytes live (slop + admin) */
    __u64 blocks;         /* live blocks */
    __u64 time_b;         /* Massif --time-unit=B clock */
    __u64 peak_total;     /* heap + extra at the peak */
    __u64 peak_heap;
    __u64 peak_extra;
    __u64 peak_time_b;
    __u64 peak_ns;        /* bpf_ktime_get_ns at the peak */
    __u64 peak_gen;       /* bumped at every new peak */
    __u64 n_allocs;
    __u64 n_frees;
    __u64 n_reallocs;
    __u64 alloc_bytes;    /* bytes ever allocated */
    __u64 freed_bytes;
    __u64 untracked_frees;   /* free/realloc of a block we never saw (allocated before attach) */
    __u64 failed_allocs;     /* the allocator returned NULL */
    __u64 nested_calls;      /* allocation calls inside allocation calls, folded into the outer one */
    __u64 dropped_blocks;    /* block_slots bucket and overflow hash both full: block not tracked */
    __u64 dropped_stacks;    /* site ids used up at a new stack: charged to the overflow site 0 */
    __u64 dropped_sites;     /* a site id without its site (cannot happen with an array; kept for the ABI) */
    __u64 dropped_pending;   /* pending tables full: a call went unseen */
    __u64 overflow_pending;  /* calls now held in the overflow table (their slot was taken) */
    __u64 lost_returns;      /* a return with no pending entry */
    __u64 unwind_frames;     /* frames unwound with a table rule */
    __u64 unwind_fp;         /* frames unwound by frame pointer: no table covers the code */
    __u64 unwind_no_rule;    /* a table covers the code but has no rule there (falls back to frame pointers) */
    __u64 unwind_searched;   /* frames whose rule was searched in the tables: not in the CPU's rule cache */
    __u64 unwind_bad_read;   /* a stack read failed: the stack ends there */
    __u64 unwind_depth_cut;  /* stacks cut at HS_MAX_DEPTH */
    __u64 dropped_sizes;     /* MALT sizeMap or reallocJump full: those entries not counted */
    __u64 dropped_threads;   /* MALT per-thread table full */
    __u64 zero_allocs;       /* zero-size requests (MALT's countZeros, all stacks) */
    __u64 hashed_blocks;     /* live blocks in the overflow hash (their bucket was full); 0: frees skip it */
    __u64 unwind_short_reads; /* a run of stack reached past an unknown stack's end: read again to its page end */
    __u64 walks_interrupted;  /* a walk another program run overtook on its CPU (a preemptible kernel): its
                               * per-CPU buffers may hold the other's stack, so its call goes to site 0 */
    /* the snapshot schedule */
    __u64 sched_points;       /* points sent to sched_points (each numbered before it is submitted) */
    __u64 sched_lost;         /* points the ring buffer could not take (user space did not drain it in time) */
    __u64 sched_signalled;    /* the HS_CTL_SCHED_CULL_AT for which HS_EV_SCHEDULE was sent */
    __u64 sched_wakes;        /* HS_EV_SCHEDULE sent (sampled mode: fewer than its cullings) */
    __u64 snap_records;       /* records sent to snap_log */
    __u64 snap_lost;          /* records snap_log could not take: the trees of the points before them are inexact */
    /* The target's slot in the program of its shape (written by user space before it attaches): the index of
     * its own maps in each per-target map's array of maps (probes/bpf/common.h). */
    __u32 slot;
    __u32 slot_pad;
};

#endif
