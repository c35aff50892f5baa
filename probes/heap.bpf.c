/* heap.bpf.c: heapscope's in-kernel heap accounting, compiled by bcc at run time.
 *
 * Uprobes at the allocation functions of the target's allocator record each call's arguments and stack;
 * the return probe turns the call into Massif-model accounting in BPF maps. Nothing is sent to user space
 * per call: agent/kernel/probes.py reads the maps. Only the calls at which Massif would take a snapshot send a point
 * (time and totals) to a ring buffer (the snapshot schedule: schedule_check).
 *
 * Entry probes may sit a few instructions into a function (agent/symbols/placement.py picks the first instruction
 * the kernel emulates); they are always placed before the function touches %rsp, %rbp or the argument
 * registers they read, so [rsp] is still the caller's return address.
 */
#include <uapi/linux/ptrace.h>
#include "heap.h"

/* block_slots: the live blocks, by address: bucket block_bucket(addr), two slots. An array, so finding a
 * block is a few inlined instructions and one cache line, with no lock and no allocation (a hash map's
 * update and delete cost more than the rest of the accounting). Mmapable only for its page alignment,
 * which keeps each bucket in one cache line. */
BPF_F_TABLE("array", int, struct hs_block_slot, block_slots, HS_BLOCK_SLOTS, BPF_F_MMAPABLE);
/* blocks: block address -> struct hs_block, for the blocks whose bucket was full. Like every hash map here it
 * is not preallocated (BPF_F_NO_PREALLOC): its memory follows the target's use, not the worst case, so a
 * daemon watching many quiet targets does not hold their tables' full size each. */
BPF_F_TABLE("hash", u64, struct hs_block, blocks, HS_MAX_BLOCKS, BPF_F_NO_PREALLOC);
/* sites: site id -> struct hs_site (the counters of one allocation stack). An array, so the return and free
 * paths reach a block's site without hashing; mmapable, so user space reads every site's counters in place,
 * with no syscall and no copy, at each snapshot. */
BPF_F_TABLE("array", int, struct hs_site, sites, HS_MAX_STACKS, BPF_F_MMAPABLE);
/* site_stacks: site id -> struct hs_stack (its return addresses), written at the site's creation; apart from
 * the counters, so that a snapshot does not read them again (user space reads a site's stack once). A hash
 * map, not an array: it holds the stacks there are, not 512 bytes for every possible site. */
BPF_F_TABLE("hash", u32, struct hs_stack, site_stacks, HS_MAX_STACKS, BPF_F_NO_PREALLOC);
/* stack_ids: stack hash -> site id (u64), consulted only when a CPU meets a stack it did not store last */
BPF_F_TABLE("hash", u64, u64, stack_ids, HS_MAX_STACKS, BPF_F_NO_PREALLOC);
/* stack_cache: stack hash bits -> struct hs_last_stack, per CPU (stacks met recently skip stack_ids; with
 * free stacks, malloc and free alternate, so one entry would miss every time) */
BPF_PERCPU_ARRAY(stack_cache, struct hs_last_stack, HS_STACK_CACHE);
/* stack_copy: 0 -> struct hs_stack_copy, per CPU (the run of the user stack the walk reads from) */
BPF_PERCPU_ARRAY(stack_copy, struct hs_stack_copy, 1);
/* rule_cache: pc bits -> struct hs_rule_entry, per CPU (hot return addresses skip both binary searches) */
BPF_PERCPU_ARRAY(rule_cache, struct hs_rule_entry, HS_RULE_CACHE);
/* slots: tid mod HS_PENDING_SLOTS -> struct hs_pending (the thread's call between entry and return).
 * An array: its lookups are inlined and take no lock, unlike a hash map's. */
BPF_ARRAY(slots, struct hs_pending, HS_PENDING_SLOTS);
/* pending: thread id -> struct hs_pending, for a thread whose slot another thread holds */
BPF_F_TABLE("hash", u32, struct hs_pending, pending, HS_MAX_PENDING, BPF_F_NO_PREALLOC);
/* globals: 0 -> struct hs_global */
BPF_ARRAY(globals, struct hs_global, 1);
/* control: enum hs_control -> u64, written by user space (kept apart so its writes never race counters) */
BPF_ARRAY(control, u64, HS_CTL_COUNT);
#if HS_IGNORE
/* site_flags: site id -> enum hs_site_flag, written by user space as it symbolizes sites (--ignore-fn) */
BPF_ARRAY(site_flags, u8, HS_MAX_STACKS);
#endif
/* MALT (HS_MALT): size_map: request size -> count; realloc_jump: struct hs_jump -> count;
 * thread_stats: tid << 8 | enum hs_fn -> struct hs_thread_stat */
BPF_F_TABLE("hash", u64, u64, size_map, HS_MAX_SIZES, BPF_F_NO_PREALLOC);
/* small_sizes: request size -> count, for sizes below HS_SMALL_SIZES (no hashing on the common sizes) */
BPF_ARRAY(small_sizes, u64, HS_SMALL_SIZES);
BPF_F_TABLE("hash", struct hs_jump, u64, realloc_jump, HS_MAX_JUMPS, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", u64, struct hs_thread_stat, thread_stats, HS_MAX_THREADS, BPF_F_NO_PREALLOC);
/* thread_slots: (tid mod HS_THREAD_SLOTS) * HS_FN_COUNT + fn -> the owning thread's statistics */
BPF_ARRAY(thread_slots, struct hs_thread_slot, HS_THREAD_SLOTS * HS_FN_COUNT);
/* size_hist: log2(size) -> allocations so far; life_hist: log2(size) * 64 + log2(lifetime ns) -> frees so
 * far. Cumulative: user space takes the difference between two samples, so nothing is ever reset. */
BPF_ARRAY(size_hist, u64, HS_LOG2_BINS);
BPF_ARRAY(life_hist, u64, HS_LOG2_BINS * HS_LOG2_BINS);
/* window: 0 -> struct hs_window (the timeline's maximum since the last sample) */
BPF_ARRAY(window, struct hs_window, 1);

/* alloc_walker: 0 -> alloc_enter, the entry program of the allocation functions other than malloc, tail-called
 * by theirs. Each inlined copy of the stack walk costs ~0.45 s of verification at load: malloc keeps its own
 * (no tail call on the hottest path), the others share one. walk_arg hands the walker its argument: per CPU,
 * since a tail call runs on its caller's CPU, in the same program run. */
BPF_PROG_ARRAY(alloc_walker, 1);
BPF_PERCPU_ARRAY(walk_arg, struct hs_page_call, 1);

/* events: enum hs_event, to wake user space at once */
BPF_PERF_OUTPUT(events);
/* sched_points: struct hs_sched_point, the snapshot schedule's points in time order; drained by user space */
BPF_RINGBUF_OUTPUT(sched_points, HS_SCHED_RING_PAGES);
/* snap_log: struct hs_snap_record, a site's value before its first change after a point (site_touch); drained
 * by user space, which rebuilds the tree at each detailed point from it */
BPF_RINGBUF_OUTPUT(snap_log, HS_SNAP_RING_PAGES);
/* scratch: 0 -> the stack being walked (too big for the BPF stack) */
BPF_PERCPU_ARRAY(scratch, struct hs_stack, 1);

/* unwind_rows: row index -> struct hs_row (the unwind tables of all objects, each a sorted run). One table for
 * every target of the daemon, declared by a holder program (agent/kernel/arrays.py SharedRows): an object's
 * rows are loaded once, whichever targets map it. */
BPF_TABLE("extern", int, struct hs_row, unwind_rows, HS_MAX_ROWS);
/* unwind_maps: index -> struct hs_umap, two halves of HS_MAX_UMAPS sorted by start; control[HS_CTL_UMAPS]
 * says which half and how many are published, so user space rewrites the other half and flips. */
BPF_ARRAY(unwind_maps, struct hs_umap, 2 * HS_MAX_UMAPS);

static __always_inline struct hs_global *get_globals(void)
{
    u32 zero = 0;
    return globals.lookup(&zero);
}

static __always_inline int is_armed(void)
{
    u32 idx = HS_CTL_ARMED;
    u64 *armed = control.lookup(&idx);
    return armed && *armed;
}

static __always_inline u64 mix(u64 h, u64 v)
{
    h ^= v;
    h *= 0x100000001b3ULL;
    h ^= h >> 29;
    return h;
}

/* Program order for the per-CPU caches' sequence numbers: only a program preempting this one on the same
 * CPU can interleave with it, so the compiler's order is the order that counts. */
#define hs_barrier() asm volatile("" ::: "memory")
#define HS_ONCE(x) (*(volatile typeof(x) *)&(x)) /* one load or store, in program order */

/* State of a stack walk: the registers of the frame being left, and the run of stack copied so far. */
struct walk {
    struct hs_stack *st;
    struct hs_global *g;
    struct hs_stack_copy *copy;
    u64 sp;     /* the caller's %rsp once the current frame returns */
    u64 bp;     /* the caller's %rbp */
    u64 ret;    /* the current frame's return address (ip[n - 1]) */
    u64 h;
    u64 umaps;  /* control[HS_CTL_UMAPS]: the published mappings the rules were found in */
    u64 stack_end; /* control[HS_CTL_STACK_END] */
    u32 n;
    u32 umap_first;
    u32 umap_count;
};

/* The word of the user stack at addr, from the copy. When the copy does not hold it, the copy is refilled
 * with a run from addr up: the walk climbs the stack, so one read serves the next frames too. A run fails
 * if any of its pages is missing (a read here cannot fault one in), so on the main thread's stack it stops
 * where exec left the stack pointer: above, the kernel's random gap may be untouched. Above a thread's
 * stack lies its thread control block, so a run rarely fails; when it does (a stack of unknown end, a
 * garbage frame pointer), it is read again up to the end of addr's page, which is there. */
static __always_inline int stack_word(struct walk *w, u64 addr, u64 *out)
{
    if (addr & 7) /* not where a frame keeps its words: read it alone */
        return bpf_probe_read_user(out, sizeof(*out), (void *)addr);
    struct hs_stack_copy *c = w->copy;
    u64 off = addr - c->base;
    if (off >= c->copied) {
        u64 len = HS_COPY_BYTES;
        if (addr < w->stack_end && w->stack_end - addr < len)
            len = w->stack_end - addr;
        if (len > HS_COPY_BYTES) /* cannot be: tells the verifier */
            len = HS_COPY_BYTES;
        if (bpf_probe_read_user(c->w, len, (void *)addr)) {
            __sync_fetch_and_add(&w->g->unwind_short_reads, 1);
            len = 4096 - (addr & 4095);
            if (len > HS_COPY_BYTES)
                len = HS_COPY_BYTES;
            if (bpf_probe_read_user(c->w, len, (void *)addr)) {
                c->copied = 0;
                return -1;
            }
        }
        c->base = addr;
        c->copied = len;
        off = 0;
    }
    *out = c->w[(off / 8) & (HS_COPY_BYTES / 8 - 1)]; /* off < copied <= HS_COPY_BYTES: the mask shows it */
    return 0;
}

#if HS_UNWIND
/* The published mapping holding pc, or 0. */
static __always_inline struct hs_umap *find_umap(struct walk *w, u64 pc)
{
    u32 lo = 0, hi = w->umap_count;
    if (hi > HS_MAX_UMAPS)
        return 0;
    for (int i = 0; i < 10 && lo < hi; i++) { /* 2^10 > HS_MAX_UMAPS */
        u32 mid = (lo + hi) / 2;
        u32 idx = w->umap_first + mid;
        struct hs_umap *m = unwind_maps.lookup(&idx);
        if (!m)
            return 0;
        if (pc < m->start)
            hi = mid;
        else if (pc >= m->end)
            lo = mid + 1;
        else
            return m;
    }
    return 0;
}

/* The last row of the mapping's table whose pc is <= vaddr, or 0. Written without an early exit and
 * with one row pointer at the end: fewer states for the verifier, for whom this runs once per frame. */
static __always_inline struct hs_row *find_row(struct hs_umap *m, u64 vaddr)
{
    u32 begin = m->row_begin;
    u32 lo = begin, hi = begin + m->row_count;
    for (int i = 0; i < 24 && lo < hi; i++) { /* 2^24 > HS_MAX_ROWS */
        u32 mid = lo + (hi - lo) / 2;
        struct hs_row *r = unwind_rows.lookup(&mid);
        u64 row_pc = r ? r->pc : (u64)-1;
        if (row_pc <= vaddr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == begin)
        return 0;
    u32 idx = lo - 1;
    return unwind_rows.lookup(&idx);
}

/* A rule, packed in a u64: cfa_type | flags << 8 | (u16)rbp_offset << 16 | (u32)cfa_offset << 32. */
static __always_inline u64 pack_rule(u64 type, u64 flags, s64 cfa_offset, s64 rbp_offset)
{
    return type | flags << 8 | (u64)(u16)rbp_offset << 16 | (u64)(u32)cfa_offset << 32;
}

/* The rule at pc from the tables. A .plt rule is turned into its rsp offset at this pc. */
static __always_inline u64 find_rule(struct walk *w, u64 pc)
{
    struct hs_umap *m = find_umap(w, pc);
    if (!m)
        return pack_rule(HS_CFA_NONE, 0, 0, 0);
    struct hs_row *r = find_row(m, pc - m->bias);
    if (!r)
        return pack_rule(HS_CFA_NONE, HS_RULE_MAPPED, 0, 0);
    u64 type = r->cfa_type;
    s64 cfa_offset = r->cfa_offset;
    if (type == HS_CFA_PLT) {
        type = HS_CFA_RSP;
        cfa_offset = 8 + (((pc - m->bias) & 15) >= 11 ? 8 : 0);
    }
    return pack_rule(type, r->flags | HS_RULE_MAPPED, cfa_offset, r->rbp_offset);
}

static __always_inline u32 rule_slot(u64 pc)
{
    return (pc ^ (pc >> 10) ^ (pc >> 20)) & (HS_RULE_CACHE - 1);
}

/* The rule this CPU cached for pc under the same published mappings, or 0 (no rule packs to 0). */
static __always_inline u64 cached_rule(struct walk *w, u64 pc)
{
    u32 idx = rule_slot(pc);
    struct hs_rule_entry *e = rule_cache.lookup(&idx);
    if (!e)
        return 0;
    u64 seq = HS_ONCE(e->seq);
    hs_barrier();
    if (!seq || (seq & 1) || e->pc != pc || e->umaps != w->umaps)
        return 0;
    u64 rule = e->rule;
    hs_barrier();
    return HS_ONCE(e->seq) == seq ? rule : 0;
}

static __always_inline void cache_rule(struct walk *w, u64 pc, u64 rule)
{
    u32 idx = rule_slot(pc);
    struct hs_rule_entry *e = rule_cache.lookup(&idx);
    if (!e)
        return;
    u64 seq = HS_ONCE(e->seq);
    if (seq & 1) /* a program this one preempted is writing it; leave it to that one */
        return;
    HS_ONCE(e->seq) = seq + 1;
    hs_barrier();
    e->pc = pc;
    e->umaps = w->umaps;
    e->rule = rule;
    hs_barrier();
    HS_ONCE(e->seq) = seq + 2;
}

/* One frame by the rule for the return address w->ret: find the caller's registers and return address. */
static __always_inline long walk_step(struct walk *w, u64 rule)
{
    u32 type = rule & 0xff, flags = (rule >> 8) & 0xff;
    u64 cfa, bp_at, ret = 0, bp = w->bp;
    if (type == HS_CFA_END)
        return 1;
    if (type == HS_CFA_NONE) {
        if (flags & HS_RULE_MAPPED)
            w->copy->no_rule++;
        else
            w->copy->fp++;
        /* No rule: trust a frame pointer if it looks like one (above the stack pointer, aligned). */
        if (bp < w->sp || (bp & 7))
            return 1;
        cfa = bp + 16;
        bp_at = bp;
        flags = HS_RBP_SAVED;
    } else {
        cfa = (type == HS_CFA_RBP ? w->bp : w->sp) + (s64)(s32)(rule >> 32);
        bp_at = cfa + (s64)(s16)(rule >> 16);
    }
    /* One place reads the stack for both kinds of frame: fewer paths for the verifier to walk. */
    if (stack_word(w, cfa - 8, &ret) || ((flags & HS_RBP_SAVED) && stack_word(w, bp_at, &bp))) {
        if (type != HS_CFA_NONE)
            __sync_fetch_and_add(&w->g->unwind_bad_read, 1);
        return 1;
    }
    if (type != HS_CFA_NONE)
        w->copy->frames++;
    if (ret == 0 || cfa <= w->sp - 8)
        return 1;
    u32 n = w->n;
    if (n >= HS_MAX_DEPTH) {
        __sync_fetch_and_add(&w->g->unwind_depth_cut, 1);
        return 1;
    }
    w->st->ip[n] = ret;
    w->n = n + 1;
    w->h = mix(w->h, ret);
    w->sp = cfa;
    w->bp = bp;
    w->ret = ret;
    return 0;
}
#endif

/* The site id of a stack this CPU stored recently, or -1. */
static __always_inline s64 cached_stack(struct hs_last_stack *c, u64 h)
{
    u64 seq = HS_ONCE(c->seq);
    hs_barrier();
    if (seq && !(seq & 1) && c->hash == h) {
        u64 id = c->id;
        hs_barrier();
        if (HS_ONCE(c->seq) == seq)
            return id;
    }
    return -1;
}

static __always_inline void cache_stack(struct hs_last_stack *c, u64 h, u64 id)
{
    u64 seq = HS_ONCE(c->seq);
    if (seq & 1) /* a program this one preempted is writing it */
        return;
    HS_ONCE(c->seq) = seq + 1;
    hs_barrier();
    c->hash = h;
    c->id = id;
    hs_barrier();
    HS_ONCE(c->seq) = seq + 2;
}

/* Walk the user stack and make sure its site exists; returns the site key. The walk starts from the code
 * address `ret` (stored as ip[0]; looked up as ret - 1, like a return address), the stack pointer `sp` of
 * the frame that address is in, and %rbp. At a function's entry (`at_entry`) no frame exists yet: ip[0]
 * is then the caller's return address at [sp] (a walk from %rbp alone would skip the immediate caller). */
static __always_inline u64 capture_stack_at(int at_entry, u64 ret, u64 sp, u64 bp, struct hs_global *g, u32 fn)
{
    u32 zero = 0;
    struct hs_stack *st = scratch.lookup(&zero);
    struct hs_stack_copy *copy = stack_copy.lookup(&zero);
    if (!st || !copy)
        return HS_STACK_OVERFLOW;

    u64 h = 0xcbf29ce484222325ULL;
    struct walk w = {.st = st, .g = g, .copy = copy, .bp = bp};
    u32 end_idx = HS_CTL_STACK_END;
    u64 *stack_end = control.lookup(&end_idx);
    if (stack_end)
        w.stack_end = *stack_end;
    copy->copied = 0;
    u64 walk_no = copy->walks + 1;
    copy->walks = walk_no;
    if (at_entry) {
        stack_word(&w, sp, &ret); /* the first run of the copy starts at [rsp] */
        sp += 8;
    }
    st->ip[0] = ret;
    h = mix(h, ret);

    int n = 1;
#if HS_UNWIND
    w.sp = sp;
    w.ret = ret;
    w.h = h;
    w.n = 1;
    u32 idx = HS_CTL_UMAPS;
    u64 *published = control.lookup(&idx);
    if (published) {
        w.umaps = *published;
        w.umap_first = (w.umaps >> 32) & 0x3ff;
        w.umap_count = (u32)w.umaps;
    }
    /* Hot return addresses have their rules in this CPU's cache. At the first that does not, the rest
     * of the stack is walked with the tables (caching what they give). Two loops, so the verifier walks
     * the binary searches once per frame, not once per frame and per cache outcome. One step more than
     * the depth allows, to count the stacks that are cut. */
    int missed = 0;
    for (int i = 0; i < HS_MAX_DEPTH && ret; i++) {
        /* pc inside the call instruction: the return address may start another function */
        u64 rule = cached_rule(&w, w.ret - 1);
        if (!rule) {
            missed = 1;
            break;
        }
        if (walk_step(&w, rule))
            break;
    }
    if (missed) {
        /* From the start again (a miss is rare once a stack is hot): so the verifier meets one state
         * here, not one per frame at which the first loop could have stopped. */
        w.sp = sp;
        w.bp = bp;
        w.ret = ret;
        w.h = h;
        w.n = 1;
        copy->frames = copy->fp = copy->no_rule = 0;
        for (int i = 0; i < HS_MAX_DEPTH; i++) {
            u64 pc = w.ret - 1;
            u64 rule = find_rule(&w, pc);
            cache_rule(&w, pc, rule);
            if (walk_step(&w, rule))
                break;
        }
    }
    h = w.h;
    n = w.n;
    /* Per-CPU counts, so not atomic: a walk that preempted this one adds its counts (and ours so far)
     * itself, which keeps the sums; only one between our read and our reset would be lost. */
    u64 counted = copy->frames;
    if (counted) {
        copy->frames = 0;
        __sync_fetch_and_add(&g->unwind_frames, counted);
    }
    counted = copy->fp;
    if (counted) {
        copy->fp = 0;
        __sync_fetch_and_add(&g->unwind_fp, counted);
    }
    counted = copy->no_rule;
    if (counted) {
        copy->no_rule = 0;
        __sync_fetch_and_add(&g->unwind_no_rule, counted);
    }
#else
    u64 lowest = sp; /* where the next frame may start: above the stack pointer, then above the last frame */
    for (int i = 1; i < HS_MAX_DEPTH && ret; i++) {
        u64 saved_bp = 0, fret = 0;
        if (bp < lowest || (bp & 7) || stack_word(&w, bp, &saved_bp) || stack_word(&w, bp + 8, &fret) || fret == 0)
            break;
        st->ip[i] = fret;
        h = mix(h, fret);
        lowest = bp + 16;
        bp = saved_bp;
        n = i + 1;
    }
#endif
    if (copy->walks != walk_no) {
        /* Another walk ran on this CPU meanwhile (a preemptible kernel): the copy and the scratch stack may
         * hold its words, so this stack is not trusted. */
        __sync_fetch_and_add(&g->walks_interrupted, 1);
        return HS_STACK_OVERFLOW;
    }
    u32 slot_idx = h & (HS_STACK_CACHE - 1);
    struct hs_last_stack *cached = stack_cache.lookup(&slot_idx);
    if (cached) {
        s64 known_id = cached_stack(cached, h);
        if (known_id >= 0)
            return known_id;
    }
    u64 id;
    u64 *known = stack_ids.lookup(&h);
    if (known) {
        id = *known;
    } else {
        /* A new stack: write its site first, then publish the id, so no CPU sees an id without a site.
         * Ids are never reused, so the site's counters are still the array's zeros. */
        id = __sync_fetch_and_add(&g->n_sites, 1) + 1; /* ids from 1: 0 is the overflow site */
        if (id >= HS_MAX_STACKS) {
            __sync_fetch_and_add(&g->dropped_stacks, 1);
            return HS_STACK_OVERFLOW;
        }
        for (int i = 1; i < HS_MAX_DEPTH; i++) /* a stored stack ends at its first zero */
            if (i >= n)
                st->ip[i] = 0;
        u32 slot = id;
        if (site_stacks.update(&slot, st)) { /* no memory for it: the call goes to the overflow site */
            __sync_fetch_and_add(&g->dropped_stacks, 1);
            return HS_STACK_OVERFLOW;
        }
        if (copy->walks != walk_no) { /* overtaken while storing it: the id stays an empty site */
            __sync_fetch_and_add(&g->walks_interrupted, 1);
            return HS_STACK_OVERFLOW;
        }
        struct hs_site *site = sites.lookup(&slot);
        if (site) {
            site->fn = fn;
            site->peak_gen = g->peak_gen;
        }
        if (stack_ids.insert(&h, &id)) {
            /* Another CPU published this stack first (its id wins; ours stays an empty site), or the
             * table is full (the site stays, reachable only through this CPU's cache). */
            known = stack_ids.lookup(&h);
            if (known)
                id = *known;
        }
    }
    if (cached)
        cache_stack(cached, h, id);
    return id;
}

/* The stack of an allocation call, at the function's entry: no frame exists yet, so ip[0] is the caller's
 * return address, read from [rsp] (a walk from %rbp alone would skip the immediate caller). */
static __always_inline u64 capture_stack(struct pt_regs *ctx, struct hs_global *g, u32 fn)
{
    return capture_stack_at(1, 0, PT_REGS_SP(ctx), PT_REGS_FP(ctx), g, fn);
}

/* capture_stack for the free probe, which charges the site in the same run: the id passes through memory, so the
 * verifier sees one unknown value whatever path of the walk found it. It keeps a constant map key precise (the
 * overflow site's 0, from the walk's early exits) and would otherwise verify the accounting after the walk once more
 * per kind of exit: with MALT's statistics and the snapshot schedule that took free_enter past its limit of 1M
 * instructions (0.73-0.77M with this). The sampled probes verify in fewer without it, so they keep capture_stack.
 * A walk that preempted this one between the store and the load (a preemptible kernel) moved copy->walks: then the
 * id in hand is kept, chosen without a branch for the same reason. */
static __always_inline u64 capture_site(struct pt_regs *ctx, struct hs_global *g, u32 fn)
{
    u64 id = capture_stack(ctx, g, fn);
    u32 zero = 0;
    struct hs_stack_copy *copy = stack_copy.lookup(&zero);
    if (!copy)
        return id;
    u64 walks = HS_ONCE(copy->walks);
    hs_barrier();
    HS_ONCE(copy->site) = id;
    hs_barrier();
    u64 loaded = HS_ONCE(copy->site);
    hs_barrier();
    u64 moved = HS_ONCE(copy->walks) ^ walks;
    moved = (moved | -moved) >> 63; /* 1 when another walk ran meanwhile */
    return loaded ^ ((loaded ^ id) & -moved);
}

#if HS_STACKS
/* thread_stacks: thread id -> struct hs_thread_stack (--stacks=yes) */
BPF_F_TABLE("hash", u32, struct hs_thread_stack, thread_stacks, HS_MAX_THREADS, BPF_F_NO_PREALLOC);

/* A probe hit on a thread: its stack pointer extends the thread's stack extent. `top` marks a thread's
 * initial stack pointer (exec, clone): the stack is measured from there (Massif: the main stack starts at 0). */
static __always_inline void note_stack(u32 tid, u64 sp, int top)
{
    u32 idx = HS_CTL_STACK_EPOCH;
    u64 *epoch_word = control.lookup(&idx);
    u64 epoch = epoch_word ? *epoch_word : 0;
    struct hs_thread_stack *t = thread_stacks.lookup(&tid);
    if (!t) {
        struct hs_thread_stack fresh = {.top = sp, .low = sp, .last = sp, .epoch = epoch};
        thread_stacks.update(&tid, &fresh);
        return;
    }
    if (top || sp > t->top)
        t->top = sp;
    if (t->epoch != epoch || sp < t->low) {
        t->low = sp;
        t->epoch = epoch;
    }
    t->last = sp;
}
#endif

static __always_inline struct hs_site *get_site(u64 id, struct hs_global *g)
{
    u32 slot = id;
    struct hs_site *s = sites.lookup(&slot);
    if (!s)
        __sync_fetch_and_add(&g->dropped_sites, 1);
    return s;
}

/* The snapshot log's record of site `id` (struct hs_snap_record), submitted before the change it precedes: user
 * space reads the sites first and the log after, so every change its read saw has its record in the ring. The
 * record that fills the ring to half (and to three quarters) wakes user space, as page_exit does. */
static __always_inline void snap_log_site(void *ctx, struct hs_global *g, struct hs_site *s, u64 id, u64 epoch)
{
    struct hs_snap_record *r = snap_log.ringbuf_reserve(sizeof(struct hs_snap_record));
    if (!r) {
        __sync_fetch_and_add(&g->snap_lost, 1);
        return;
    }
    r->site = id;
    r->epoch = epoch;
    r->bytes = HS_ONCE(s->cur_bytes);
    r->extra = HS_ONCE(s->cur_extra);
    r->allocs = HS_ONCE(s->tot_blocks);
    snap_log.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    u64 sent = __sync_fetch_and_add(&g->snap_records, 1) + 1;
    u32 idx = HS_CTL_SNAP_DRAINED;
    u64 *drained = control.lookup(&idx);
    u64 held = sent - (drained ? HS_ONCE(*drained) : 0);
    u64 room = (u64)HS_SNAP_RING_PAGES * 4096 / ((sizeof(struct hs_snap_record) + 8 + 7) & ~7ULL);
    if (held == room / 2 || held == room / 2 + room / 4) {
        u64 event = HS_EV_SNAP_LOG;
        events.perf_submit(ctx, &event, sizeof(event));
    }
}

/* Before the live bytes of site `id` change: keep its value at the last peak (a lazy copy, so the exact peak's
 * tree needs no copy of every site at the peak); and at its first change after a schedule point, log its value
 * (snap_log_site), so the tree at every point can be rebuilt, each detailed snapshot's at its own instant
 * (docs/usage.md: "Snapshots: Massif's schedule"). One compare each when the site was touched since. */
static __always_inline void site_touch(void *ctx, struct hs_site *s, u64 id, struct hs_global *g)
{
    u64 gen = g->peak_gen;
    if (s->peak_gen != gen) {
        s->peak_bytes = s->cur_bytes;
        s->peak_extra = s->cur_extra;
        s->peak_gen = gen;
    }
    u64 epoch = HS_ONCE(g->sched_points);
    if (s->snap_epoch != epoch) {
        s->snap_epoch = epoch;
        snap_log_site(ctx, g, s, id, epoch);
    }
}

/* Massif's slop: VG_(cli_malloc_usable_size) - size in Valgrind's arena (m_mallocfree.c). At its minimum
 * alignment (16) a block's payload is the size rounded up to 16. A larger alignment A (memalign and the
 * like, or --alignment) goes through VG_(arena_memalign): it takes a block of round16(size) + 32 + A and
 * returns the first A-aligned payload at least 32 bytes in, whose usable size is round16(size) + A - d,
 * with d in [0, A - 16] set by where the arena had put the larger block (its address modulo A), which
 * depends on the whole history of Valgrind's own arena. d is taken at the middle of that range: the slop
 * is then within (A - 16) / 2 of Massif's (see agent/model/options.py, massif_slop).
 * At alignment 16, a block that with its 64 bytes of headers (the superblock's and its own) needs more than
 * the client arena's 4 MiB superblock gets a superblock of its own, whole pages, all of it usable by the block:
 * its slop runs to the page end. One that fills a 4 MiB superblock but for 16 bytes gets those 16 too (too few
 * to split off). */
static __always_inline u64 massif_slop(u64 size, u64 align)
{
    u64 slop = ((size + 15) & ~15ULL) - size;
    if (align > 16)
        return slop + (align + 16) / 2;
    if (size + slop + 64 > 4194304)
        return ((size + 64 + 4095) & ~4095ULL) - 64 - size;
    if (size + slop + 64 == 4194304 - 16)
        slop += 16;
    return slop;
}

/* The alignment Valgrind's memalign replacement uses (vg_replace_malloc.c MEMALIGN): at least 16, rounded
 * up to a power of two. valloc is memalign(page size). */
static __always_inline u64 valgrind_alignment(u64 align)
{
    if (align <= 16)
        return 16;
    align--;
    align |= align >> 1;
    align |= align >> 2;
    align |= align >> 4;
    align |= align >> 8;
    align |= align >> 16;
    align |= align >> 32;
    return align + 1;
}

/* Massif's --time-unit=B clock moves by the change in heap + extra, whichever way. Returns the time after this
 * event's change (the atomic add hands back the time before it at no extra cost). */
static __always_inline u64 advance_time(struct hs_global *g, s64 delta)
{
    u64 step = delta < 0 ? -delta : delta;
    return __sync_fetch_and_add(&g->time_b, step) + step;
}

static __always_inline u64 control_word(u32 idx)
{
    u64 *w = control.lookup(&idx);
    return w ? *w : 0;
}

/* The time of a point in the snapshots' unit (B, or whole ms since HS_CTL_SCHED_ORIGIN), and the due time
 * `interval` of that unit after it (ms: the start of that millisecond, as Massif compares whole milliseconds). */
static __always_inline u64 schedule_next(u64 t, u64 interval, u64 *unit_time)
{
    if (!HS_SCHED_NS) {
        *unit_time = t;
        return t + interval;
    }
    u64 origin = control_word(HS_CTL_SCHED_ORIGIN);
    *unit_time = (t > origin ? t - origin : 0) / 1000000;
    return origin + (*unit_time + interval) * 1000000;
}

static __always_inline void send_point(struct hs_global *g, u64 t, u64 heap, u64 extra, u64 kind)
{
    struct hs_sched_point *p = sched_points.ringbuf_reserve(sizeof(struct hs_sched_point));
    if (!p) {
        __sync_fetch_and_add(&g->sched_lost, 1);
        return;
    }
    p->time = t;
    p->heap = heap;
    p->extra = extra;
    p->kind = kind;
    /* Numbered before it is submitted: a site changed from here on logs its value at this point (site_touch). */
    p->epoch = __sync_fetch_and_add(&g->sched_points, 1);
    sched_points.ringbuf_submit(p, BPF_RB_NO_WAKEUP);
}

/* (Inlined, as every function here: bcc loads each program alone, without BPF-to-BPF calls.)
 * The interval for the due time after a point. User space owns it (it culls the series) and sets the due time
 * from the series when it has read the points. When the series culls (the point count reached
 * HS_CTL_SCHED_CULL_AT) user space is woken once (schedule_signal). Until it answers, the interval is guessed
 * as the time so far divided by --max-snapshots (about half the spacing a culling leaves), which keeps the
 * points bounded however long user space takes. */
static __always_inline u64 schedule_interval(struct hs_global *g, u64 unit_time)
{
    u64 interval = control_word(HS_CTL_SCHED_INTERVAL);
    u64 cull_at = control_word(HS_CTL_SCHED_CULL_AT);
    if (!cull_at || HS_ONCE(g->sched_points) + 1 < cull_at)
        return interval;
    u64 max = control_word(HS_CTL_SCHED_MAX);
    u64 guess = max ? unit_time / max : 0;
    /* ms: at least one; an interval of 0 (snapshots in the same millisecond, which Massif's culling keeps while
     * Valgrind runs slowly enough to make few of them) would send every event of a native run meanwhile */
    if (HS_SCHED_NS && guess == 0)
        guess = 1;
    return guess > interval ? guess : interval;
}

/* After a point was sent (never before: user space, woken on the other CPU, must find the point that made the
 * series cull in the ring when it drains it): when the point count reached HS_CTL_SCHED_CULL_AT, wake user
 * space once; with HS_STOP_EVENTS and time in B (time stands still while the target does) also stop the target
 * until user space has set the new interval and due time, so the points are exactly Massif's. Never in sampled
 * mode: its points are estimates anyway, and production mode does not stop a target (the guessed interval
 * bridges the wait). */
static __always_inline void schedule_signal(void *ctx, struct hs_global *g)
{
    u64 cull_at = control_word(HS_CTL_SCHED_CULL_AT);
    if (!cull_at || HS_ONCE(g->sched_points) < cull_at || HS_ONCE(g->sched_signalled) == cull_at)
        return;
    g->sched_signalled = cull_at;
    u64 event = HS_EV_SCHEDULE;
    if (HS_STOP_EVENTS && !HS_SCHED_NS && !HS_SAMPLED) {
        u32 stop_idx = HS_CTL_STOPPED;
        control.update(&stop_idx, &event);
        bpf_send_signal(19 /* SIGSTOP */);
    }
    events.perf_submit(ctx, &event, sizeof(event));
}

/* HS_SCHED_NS: the clock costs ~50 ns a read here, jiffies (the tick count) a load. After setting the due
 * time `next` at `t`, say until which jiffy no event can reach it: jiffies move on once a jiffy, so while fewer
 * than the whole jiffies to `next`, less one, have passed, `next` is still ahead. */
static __always_inline void schedule_jiffies(u64 t, u64 next)
{
    u64 jiffy_ns = control_word(HS_CTL_SCHED_JIFFY_NS);
    u32 idx = HS_CTL_SCHED_DUE_JIFFIES;
    u64 *word = control.lookup(&idx);
    if (!HS_SCHED_NS || !word)
        return;
    u64 ahead = jiffy_ns && next > t ? (next - t) / jiffy_ns : 0;
    HS_ONCE(*word) = ahead > 1 ? bpf_jiffies64() + ahead - 1 : 0;
}

/* The event at time t reached the due time: a point with the totals after it, and the next due time as
 * Massif's maybe_take_snapshot sets it (this one's time plus the minimum interval). */
static __always_inline void schedule_point(void *ctx, struct hs_global *g, u64 t, u64 *due_word, u64 due)
{
    u64 unit_time;
    schedule_next(t, 0, &unit_time);
    u64 next = schedule_next(t, schedule_interval(g, unit_time), &unit_time);
    if (__sync_val_compare_and_swap(due_word, due, next) != due)
        return; /* another CPU's event took this point, or user space has just set the due time */
    schedule_jiffies(t, next);
    send_point(g, t, HS_ONCE(g->heap), HS_ONCE(g->extra), HS_SCHED_NORMAL);
    schedule_signal(ctx, g);
}

/* After an event's accounting: one compare, unless the event reached the schedule's due time. `time_b` is the
 * event's B time; `now` its bpf_ktime_get_ns when the caller has read it, else 0. The due time sits in the
 * control map's first cache line, which is_armed() has just read; in ms, so does the jiffy before which the
 * clock need not be read. */
static __always_inline void schedule_check(void *ctx, struct hs_global *g, u64 time_b, u64 now)
{
    if (HS_SCHED_NS && !now) {
        u32 jidx = HS_CTL_SCHED_DUE_JIFFIES;
        u64 *due_jiffies = control.lookup(&jidx);
        if (due_jiffies && bpf_jiffies64() < HS_ONCE(*due_jiffies))
            return;
    }
    u64 t = HS_SCHED_NS ? (now ? now : bpf_ktime_get_ns()) : time_b;
    u32 idx = HS_CTL_SCHED_DUE;
    u64 *due_word = control.lookup(&idx);
    if (!due_word)
        return;
    u64 due = HS_ONCE(*due_word);
    if (t >= due)
        schedule_point(ctx, g, t, due_word, due);
}

/* Before a free, or a realloc that shrinks a block: Massif takes a peak snapshot when the total is above its
 * last peak snapshot's by more than --peak-inaccuracy, whatever the interval, and the next snapshot is due an
 * interval after it. One compare unless so. `now`: as in schedule_check. */
static __always_inline void schedule_peak_check(void *ctx, struct hs_global *g, u64 now)
{
    u32 idx = HS_CTL_SCHED_PEAK_LEVEL;
    u64 *level = control.lookup(&idx);
    u64 heap = HS_ONCE(g->heap), extra = HS_ONCE(g->extra);
    u64 total = heap + extra;
    if (!level || total <= HS_ONCE(*level))
        return;
    u64 ppm = control_word(HS_CTL_SCHED_PEAK_PPM);
    HS_ONCE(*level) = total + total * ppm / 1000000;
    u64 t = HS_SCHED_NS ? (now ? now : bpf_ktime_get_ns()) : HS_ONCE(g->time_b);
    u64 unit_time;
    schedule_next(t, 0, &unit_time);
    u64 next = schedule_next(t, schedule_interval(g, unit_time), &unit_time);
    u32 due_idx = HS_CTL_SCHED_DUE;
    u64 *due_word = control.lookup(&due_idx);
    if (due_word)
        HS_ONCE(*due_word) = next;
    schedule_jiffies(t, next);
    send_point(g, t, heap, extra, HS_SCHED_PEAK);
    schedule_signal(ctx, g);
}

/* After the totals grew: a new global peak marks the touched sites with their state at the peak. */
static __always_inline void check_peak(struct hs_global *g, struct hs_site *a, struct hs_site *b)
{
    u64 heap = g->heap, extra = g->extra;
    u64 total = heap + extra;
    if (total <= g->peak_total)
        return;
    g->peak_total = total;
    g->peak_heap = heap;
    g->peak_extra = extra;
    g->peak_time_b = g->time_b;
    g->peak_ns = bpf_ktime_get_ns();
    u64 gen = g->peak_gen + 1;
    g->peak_gen = gen;
    if (a) {
        a->peak_bytes = a->cur_bytes;
        a->peak_extra = a->cur_extra;
        a->peak_gen = gen;
    }
    if (b) {
        b->peak_bytes = b->cur_bytes;
        b->peak_extra = b->cur_extra;
        b->peak_gen = gen;
    }
}

/* ---- MALT's statistics (HS_MALT) ------------------------------------------------------------------- */

static __always_inline u64 log2_bin(u64 v)
{
    /* floor(log2(v)) (0 for 0 and 1) in arithmetic, without a branch: (x + 0xffffffff) >> 32 is 1 when
     * 0 < x < 2^32, else 0. With branches every bin would be a constant of its own path, and the verifier,
     * which keeps a map key's constant precise, would walk the rest of the program once per bin. */
    u64 r = 0, s;
    s = (((v >> 32) + 0xffffffffULL) >> 32) << 5;
    v >>= s;
    r += s;
    s = (((v >> 16) + 0xffffffffULL) >> 32) << 4;
    v >>= s;
    r += s;
    s = (((v >> 8) + 0xffffffffULL) >> 32) << 3;
    v >>= s;
    r += s;
    s = (((v >> 4) + 0xffffffffULL) >> 32) << 2;
    v >>= s;
    r += s;
    s = (((v >> 2) + 0xffffffffULL) >> 32) << 1;
    v >>= s;
    r += s;
    return r + (((v >> 1) + 0xffffffffULL) >> 32);
}

static __always_inline void count_in(u64 *slot, u64 n)
{
    if (slot)
        __sync_fetch_and_add(slot, n);
}

/* Min/max are updated without atomics: two threads racing on one stack may keep a slightly wrong
 * extreme, never a wrong count or sum. */
static __always_inline void min_max(u64 *mn, u64 *mx, u64 v)
{
    if (*mn == 0 || v < *mn)
        *mn = v;
    if (v > *mx)
        *mx = v;
}

/* Only the thread itself writes its statistics (a slot has one owner, the hash is keyed by thread), and a
 * thread runs one program at a time: plain adds, no atomics. */
static __always_inline void thread_stat(u64 tid, u32 fn, u64 n, u64 bytes, u64 ns)
{
    u32 idx = (tid & (HS_THREAD_SLOTS - 1)) * HS_FN_COUNT + (fn < HS_FN_COUNT ? fn : 0);
    struct hs_thread_slot *slot = thread_slots.lookup(&idx);
    struct hs_thread_stat *t = 0;
    if (slot && (slot->tid == tid || (slot->tid == 0 && __sync_val_compare_and_swap(&slot->tid, 0, tid) == 0)))
        t = &slot->stat;
    u64 key = (tid << 8) | fn; /* else the slot belongs to another thread with the same low bits */
    if (!t)
        t = thread_stats.lookup(&key);
    if (!t) {
        struct hs_thread_stat fresh = {};
        thread_stats.insert(&key, &fresh);
        t = thread_stats.lookup(&key);
        if (!t) {
            struct hs_global *g = get_globals();
            if (g)
                __sync_fetch_and_add(&g->dropped_threads, 1);
            return;
        }
    }
    t->count += n;
    t->bytes += bytes;
    t->ns += ns;
}

/* n: the allocations this call stands for (1; in sampled mode the sample's weight in blocks). */
static __always_inline void malt_alloc(struct hs_global *g, struct hs_site *s, u64 site, u64 size, u64 n)
{
    if (size == 0) {
        __sync_fetch_and_add(&g->zero_allocs, n);
        if (s)
            __sync_fetch_and_add(&s->count_zeros, n);
    } else if (s) {
        min_max(&s->alloc_min, &s->alloc_max, size);
    }
    if (s && s->cur_bytes > s->max_alive)
        s->max_alive = s->cur_bytes;
    if (size < HS_SMALL_SIZES) {
        u32 idx = size;
        count_in(small_sizes.lookup(&idx), n);
    } else {
        u64 *c = size_map.lookup(&size);
        if (c) {
            __sync_fetch_and_add(c, n);
        } else {
            u64 first = n;
            if (size_map.insert(&size, &first) == -17 /* EEXIST: another CPU inserted it */)
                count_in(size_map.lookup(&size), n);
            else if (!size_map.lookup(&size))
                __sync_fetch_and_add(&g->dropped_sizes, 1);
        }
    }
    u32 bin = log2_bin(size);
    count_in(size_hist.lookup(&bin), n);
    u32 zero = 0;
    struct hs_window *w = window.lookup(&zero);
    if (w && g->heap > w->max_heap) {
        w->max_heap = g->heap;
        w->site = site;
    }
}

static __always_inline void malt_free(struct hs_site *alloc_site, struct hs_site *free_site, u64 size, u64 alloc_ns,
                                      u64 now, u64 n)
{
    if (free_site) {
        __sync_fetch_and_add(&free_site->free_count, n);
        __sync_fetch_and_add(&free_site->free_sum, size * n);
        min_max(&free_site->free_min, &free_site->free_max, size);
    }
    u64 life = now - alloc_ns;
    if (alloc_site && life) {
        __sync_fetch_and_add(&alloc_site->life_count, n);
        __sync_fetch_and_add(&alloc_site->life_sum, life * n);
        min_max(&alloc_site->life_min, &alloc_site->life_max, life);
    }
    u32 bin = log2_bin(size) * HS_LOG2_BINS + log2_bin(life);
    count_in(life_hist.lookup(&bin), n);
}

/* ---- the live blocks ------------------------------------------------------------------------------ */

/* The first slot of addr's bucket. Neighbouring blocks get neighbouring buckets, so the heap's locality
 * carries over to the table; the high address bits are folded in, so heaps far apart do not collide. */
static __always_inline u32 block_bucket(u64 addr)
{
    u64 x = addr >> 4; /* blocks are at least 16 bytes apart */
    x ^= (x >> 20) ^ (x >> 40);
    return (u32)x & (HS_BLOCK_SLOTS - 2);
}

static __always_inline struct hs_block_slot *block_slot(u32 idx)
{
    return block_slots.lookup(&idx);
}

/* Load addr's bucket ahead of its use: its cache line is often a miss (~90 ns here on a random free), and the
 * checks that come first run while it arrives. */
static __always_inline void block_prefetch(u64 addr)
{
    struct hs_block_slot *s = block_slot(block_bucket(addr));
    if (s)
        (void)HS_ONCE(s->addr);
}

/* Track a new block: in its bucket, else in the overflow hash; returns 0, or -1 when both are full (counted).
 * An address already tracked (its free went unseen) is overwritten in place. No other CPU can free addr
 * while this runs: the allocator has not returned it yet. */
static __always_inline int block_put(struct hs_global *g, u64 addr, struct hs_block *b)
{
    u32 idx = block_bucket(addr);
    struct hs_block_slot *s0 = block_slot(idx), *s1 = block_slot(idx + 1), *s = 0;
    if (s0 && s1 && !(b->slop >> 32) && !(b->stack >> 32)) {
        u64 a0 = HS_ONCE(s0->addr), a1 = HS_ONCE(s1->addr);
        if (a0 == addr)
            s = s0;
        else if (a1 == addr)
            s = s1;
        else if (a0 == 0 && __sync_val_compare_and_swap(&s0->addr, 0, addr) == 0)
            s = s0;
        else if (a1 == 0 && __sync_val_compare_and_swap(&s1->addr, 0, addr) == 0)
            s = s1;
        if (s) {
            s->size = b->size;
            s->slop_site = b->slop << 32 | b->stack;
            s->alloc_ns = b->alloc_ns;
            return 0;
        }
    }
    if (blocks.update(&addr, b)) {
        __sync_fetch_and_add(&g->dropped_blocks, 1);
        return -1;
    }
    __sync_fetch_and_add(&g->hashed_blocks, 1); /* a stale key replaced counts twice: only costs lookups */
    return 0;
}

/* Stop tracking the block at addr, copying it to *b; returns 0 when it was not tracked (or another CPU took
 * it first: a double free racing). */
static __always_inline int block_take(struct hs_global *g, u64 addr, struct hs_block *b)
{
    u32 idx = block_bucket(addr);
    struct hs_block_slot *s = block_slot(idx);
    if (s && HS_ONCE(s->addr) != addr)
        s = block_slot(idx + 1);
    if (s && HS_ONCE(s->addr) == addr) {
        u64 slop_site = s->slop_site;
        b->size = s->size;
        b->slop = slop_site >> 32;
        b->stack = (u32)slop_site;
        b->alloc_ns = s->alloc_ns;
        hs_barrier(); /* read it all before the slot is given up */
        return __sync_val_compare_and_swap(&s->addr, addr, 0) == addr;
    }
    if (HS_ONCE(g->hashed_blocks) == 0)
        return 0;
    struct hs_block *hb = blocks.lookup(&addr);
    if (!hb)
        return 0;
    *b = *hb;
    if (blocks.delete(&addr))
        return 0;
    __sync_fetch_and_add(&g->hashed_blocks, -1);
    return 1;
}

/* ---- Massif's accounting ----------------------------------------------------------------------------- */

/* HS_IGNORE: what user space says site `id` is (enum hs_site_flag); without --ignore-fn every site counts. */
static __always_inline u64 site_flag(u64 id)
{
#if HS_IGNORE
    if (id == HS_STACK_OVERFLOW) /* no stack: nothing to ignore it by */
        return HS_SITE_COUNTED;
    u32 idx = id;
    u8 *flag = site_flags.lookup(&idx);
    return flag ? *flag : HS_SITE_UNKNOWN;
#else
    return HS_SITE_COUNTED;
#endif
}

/* `now` (HS_MALT): bpf_ktime_get_ns() of the probe, read once per event and shared. */
static __always_inline void record_alloc(void *ctx, struct hs_global *g, u64 addr, u64 size, u64 align, u64 stack,
                                         u64 now)
{
    struct hs_block blk = {.size = size, .slop = massif_slop(size, align), .stack = stack, .alloc_ns = now};
    if (HS_IGNORE && site_flag(stack) == HS_SITE_IGNORED) {
        /* --ignore-fn: tracked, so that its free and reallocs are known as ignored, and counted nowhere: not
         * in the totals, the time, the peak or the schedule, as Massif (user space leaves its site out) */
        blk.stack |= HS_BLOCK_IGNORED;
        block_put(g, addr, &blk);
        return;
    }
    if (block_put(g, addr, &blk))
        return;
    u64 extra = blk.slop + HS_HEAP_ADMIN;
    struct hs_site *s = get_site(stack, g);
    if (s) {
        site_touch(ctx, s, stack, g);
        __sync_fetch_and_add(&s->cur_bytes, size);
        __sync_fetch_and_add(&s->cur_extra, extra);
        __sync_fetch_and_add(&s->cur_blocks, 1);
        __sync_fetch_and_add(&s->tot_bytes, size);
        __sync_fetch_and_add(&s->tot_blocks, 1);
    }
    __sync_fetch_and_add(&g->heap, size);
    __sync_fetch_and_add(&g->extra, extra);
    __sync_fetch_and_add(&g->blocks, 1);
    __sync_fetch_and_add(&g->n_allocs, 1);
    __sync_fetch_and_add(&g->alloc_bytes, size);
    u64 time_b = advance_time(g, size + extra);
    check_peak(g, s, 0);
    if (HS_MALT)
        malt_alloc(g, s, stack, size, 1);
    schedule_check(ctx, g, time_b, now);
}

/* Charge freed bytes to a site: the allocating one, or with HS_FREE_STACKS the freeing call's. */
static __always_inline void charge_freed(struct hs_global *g, struct hs_site *alloc_site, u64 free_stack, u64 size)
{
    struct hs_site *s = alloc_site;
    if (HS_FREE_STACKS && free_stack)
        s = get_site(free_stack, g);
    if (s) {
        __sync_fetch_and_add(&s->freed_bytes, size);
        __sync_fetch_and_add(&s->freed_blocks, 1);
    }
}

/* The accounting of the free of a block no longer tracked. */
static __always_inline void account_free(void *ctx, struct hs_global *g, struct hs_block *b, u64 free_stack, u64 now)
{
    schedule_peak_check(ctx, g, now);
    struct hs_block blk = *b;
    u64 extra = blk.slop + HS_HEAP_ADMIN;
    struct hs_site *s = get_site(blk.stack, g);
    if (s) {
        site_touch(ctx, s, blk.stack, g);
        __sync_fetch_and_add(&s->cur_bytes, -blk.size);
        __sync_fetch_and_add(&s->cur_extra, -extra);
        __sync_fetch_and_add(&s->cur_blocks, -1);
    }
    charge_freed(g, s, free_stack, blk.size);
    if (HS_MALT)
        malt_free(s, free_stack ? get_site(free_stack, g) : 0, blk.size, blk.alloc_ns, now, 1);
    __sync_fetch_and_add(&g->heap, -blk.size);
    __sync_fetch_and_add(&g->extra, -extra);
    __sync_fetch_and_add(&g->blocks, -1);
    __sync_fetch_and_add(&g->n_frees, 1);
    __sync_fetch_and_add(&g->freed_bytes, blk.size);
    schedule_check(ctx, g, advance_time(g, blk.size + extra), now);
}

/* Forget a block; returns its size (0 when it was not tracked). */
static __always_inline u64 record_free(void *ctx, struct hs_global *g, u64 addr, u64 free_stack, u64 now)
{
    struct hs_block blk;
    if (!block_take(g, addr, &blk)) {
        __sync_fetch_and_add(&g->untracked_frees, 1);
        return 0;
    }
    if (HS_IGNORE && (blk.stack & HS_BLOCK_IGNORED)) /* an ignored block: its free is ignored */
        return blk.size;
    account_free(ctx, g, &blk, free_stack, now);
    return blk.size;
}

/* realloc of a tracked block, as Massif 3.19 counts it: the block stays in place (and its slop grows) when
 * the new size fits in the old size plus slop; otherwise it is a new block. Either way the bytes move from
 * the old stack to realloc's stack. */
static __always_inline void record_realloc(void *ctx, struct hs_global *g, u64 old, u64 addr, u64 size, u64 stack,
                                           u64 now)
{
    struct hs_block ob;
    if (!block_take(g, old, &ob)) {
        __sync_fetch_and_add(&g->untracked_frees, 1);
        record_alloc(ctx, g, addr, size, HS_ALIGNMENT, stack, now);
        return;
    }
    /* --ignore-fn, as Massif 3.19's realloc_block: the realloc of an ignored block is ignored, and the block stays
     * ignored. So is a realloc made in an ignored function: the block becomes an ignored one, and its old bytes
     * stay counted at their site, for good (Massif never takes them back, not even at the block's free). */
    if (HS_IGNORE && ((ob.stack & HS_BLOCK_IGNORED) || site_flag(stack) == HS_SITE_IGNORED)) {
        struct hs_block ib = {.size = size, .stack = stack | HS_BLOCK_IGNORED, .alloc_ns = now};
        block_put(g, addr, &ib);
        return;
    }
    struct hs_block nb = {.size = size, .stack = stack, .alloc_ns = now};
    nb.slop = size <= ob.size + ob.slop ? ob.slop + ob.size - size : massif_slop(size, HS_ALIGNMENT);
    if (block_put(g, addr, &nb)) { /* the new block cannot be tracked (counted): the old one is gone */
        account_free(ctx, g, &ob, stack, now);
        return;
    }

    if (size < ob.size) /* Massif looks for a peak before a realloc that shrinks the block: before any change */
        schedule_peak_check(ctx, g, now);
    struct hs_site *os = get_site(ob.stack, g);
    if (os) {
        site_touch(ctx, os, ob.stack, g);
        __sync_fetch_and_add(&os->cur_bytes, -ob.size);
        __sync_fetch_and_add(&os->cur_extra, -(ob.slop + HS_HEAP_ADMIN));
        __sync_fetch_and_add(&os->cur_blocks, -1);
    }
    charge_freed(g, os, stack, ob.size);
    struct hs_site *ns = get_site(stack, g);
    if (ns) {
        site_touch(ctx, ns, stack, g);
        __sync_fetch_and_add(&ns->cur_bytes, size);
        __sync_fetch_and_add(&ns->cur_extra, nb.slop + HS_HEAP_ADMIN);
        __sync_fetch_and_add(&ns->cur_blocks, 1);
        __sync_fetch_and_add(&ns->tot_bytes, size);
        __sync_fetch_and_add(&ns->tot_blocks, 1);
    }
    s64 dheap = (s64)size - (s64)ob.size;
    s64 dextra = (s64)nb.slop - (s64)ob.slop;
    __sync_fetch_and_add(&g->heap, dheap);
    __sync_fetch_and_add(&g->extra, dextra);
    __sync_fetch_and_add(&g->n_reallocs, 1);
    __sync_fetch_and_add(&g->alloc_bytes, size);
    __sync_fetch_and_add(&g->freed_bytes, ob.size);
    u64 time_b = advance_time(g, dheap + dextra);
    if (dheap + dextra > 0)
        check_peak(g, ns, os);
    if (HS_MALT) {
        /* MALT: the old block's life ends here; the new one is an allocation of realloc's stack. */
        malt_free(os, 0, ob.size, ob.alloc_ns, now, 1);
        malt_alloc(g, ns, stack, size, 1);
        if (ns) {
            __sync_fetch_and_add(&ns->realloc_count, 1);
            __sync_fetch_and_add(&ns->realloc_delta, dheap);
        }
        struct hs_jump jump = {.old_size = ob.size, .new_size = size};
        u64 *n = realloc_jump.lookup(&jump);
        if (n) {
            __sync_fetch_and_add(n, 1);
        } else {
            u64 one = 1;
            if (realloc_jump.insert(&jump, &one) == -17)
                count_in(realloc_jump.lookup(&jump), 1);
            else if (!realloc_jump.lookup(&jump))
                __sync_fetch_and_add(&g->dropped_sizes, 1);
        }
    }
    schedule_check(ctx, g, time_b, now);
}

/* ---- the pending call of each thread ------------------------------------------------------------- */

/* The thread's call between entry and return: in its slot, or in the overflow table. */
static __always_inline struct hs_pending *find_pending(u32 tid, struct hs_global *g)
{
    u32 idx = tid & (HS_PENDING_SLOTS - 1);
    struct hs_pending *p = slots.lookup(&idx);
    if (p && p->tid == tid)
        return p;
    if (g->overflow_pending == 0) /* the common case: no hash lookup at all */
        return 0;
    return pending.lookup(&tid);
}

static __always_inline void store_pending(u32 tid, struct hs_pending *call, struct hs_global *g)
{
    u32 idx = tid & (HS_PENDING_SLOTS - 1);
    struct hs_pending *p = slots.lookup(&idx);
    call->tid = tid;
    if (p && __sync_val_compare_and_swap(&p->tid, 0, (u64)tid) == 0) {
        p->arg0 = call->arg0;
        p->arg1 = call->arg1;
        p->arg2 = call->arg2;
        p->stack = call->stack;
        p->sp = call->sp;
        p->entry_ns = call->entry_ns;
        p->ret0 = call->ret0;
        p->fn = call->fn;
        p->nested = 0;
        return;
    }
    if (pending.update(&tid, call) == 0)
        __sync_fetch_and_add(&g->overflow_pending, 1);
    else
        __sync_fetch_and_add(&g->dropped_pending, 1);
}

static __always_inline void release_pending(u32 tid, struct hs_pending *p, struct hs_global *g)
{
    u32 idx = tid & (HS_PENDING_SLOTS - 1);
    struct hs_pending *slot = slots.lookup(&idx);
    if (slot == p) {
        p->tid = 0;
        return;
    }
    if (pending.delete(&tid) == 0)
        __sync_fetch_and_add(&g->overflow_pending, -1);
}

/* ---- entry probes ---------------------------------------------------------------------------------- */

/* HS_IGNORE with HS_STOP_EVENTS (run): a call from a site with no flag yet stops the target before the call runs,
 * until user space has flagged the sites: its return needs to know (record_alloc, record_realloc). */
static __always_inline void wait_for_flags(void *ctx)
{
    u64 event = HS_EV_SITES;
    u32 stop_idx = HS_CTL_STOPPED;
    control.update(&stop_idx, &event);
    bpf_send_signal(19 /* SIGSTOP */);
    events.perf_submit(ctx, &event, sizeof(event));
}

static __always_inline int on_enter(struct pt_regs *ctx, u32 fn)
{
    struct hs_global *g = get_globals();
    if (!g || !is_armed())
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
#if HS_STACKS
    note_stack(tid, sp, 0);
#endif
    struct hs_pending *p = find_pending(tid, g);
    if (p) {
        /* A call nested in a pending one runs deeper in the stack, or at the same depth when the outer
         * function tail-calls it (reallocarray -> jmp realloc): then [rsp] holds the return probe's
         * trampoline, no longer the outer call's return address, and the outer call's record is the one
         * to keep. Otherwise the pending entry is stale (its return never came, e.g. a longjmp out of the
         * allocator) and this call replaces it. */
        u64 ret0 = 0;
        bpf_probe_read_user(&ret0, sizeof(ret0), (void *)sp);
        if (sp < p->sp || (sp == p->sp && ret0 != p->ret0)) {
            p->nested++;
            __sync_fetch_and_add(&g->nested_calls, 1);
            return 0;
        }
        __sync_fetch_and_add(&g->lost_returns, 1);
        release_pending(tid, p, g);
    }
    struct hs_pending call = {
        .arg0 = PT_REGS_PARM1(ctx),
        .arg1 = PT_REGS_PARM2(ctx),
        .arg2 = PT_REGS_PARM3(ctx),
        .sp = sp,
        .fn = fn,
    };
    call.stack = capture_stack(ctx, g, fn);
    u32 zero = 0;
    struct hs_stack *walked = scratch.lookup(&zero);
    if (walked)
        call.ret0 = walked->ip[0]; /* [rsp], read by the walk */
    if (HS_MALT)
        call.entry_ns = bpf_ktime_get_ns();
    store_pending(tid, &call, g);
    if (HS_IGNORE && HS_STOP_EVENTS && site_flag(call.stack) == HS_SITE_UNKNOWN)
        wait_for_flags(ctx);
    return 0;
}

int malloc_enter(struct pt_regs *ctx) { return on_enter(ctx, HS_MALLOC); }

/* Whether walk_arg holds this thread's argument. On a preemptible kernel another thread's program can run
 * on this CPU between a tail call's caller and callee (uprobe programs run with migration, not preemption,
 * disabled); then the argument is not ours, and that is counted. */
static __always_inline int walk_arg_is_ours(struct hs_page_call *arg)
{
    if (arg->tid == (u32)bpf_get_current_pid_tgid())
        return 1;
    struct hs_global *g = get_globals();
    if (g)
        __sync_fetch_and_add(&g->walks_interrupted, 1);
    return 0;
}

/* The shared entry program (alloc_walker): the function is in walk_arg. An argument that is not ours leaves
 * the call unseen, counted (dropped_pending): its kind is unknown. */
int alloc_enter(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (!arg)
        return 0;
    if (walk_arg_is_ours(arg))
        return on_enter(ctx, arg->kind);
    struct hs_global *g = get_globals();
    if (g)
        __sync_fetch_and_add(&g->dropped_pending, 1);
    return 0;
}

static __always_inline int enter_by_walker(struct pt_regs *ctx, u32 fn)
{
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (!arg)
        return 0;
    arg->tid = (u32)bpf_get_current_pid_tgid();
    arg->kind = fn;
    alloc_walker.call(ctx, 0);
    /* Only without the walker, which user space installs before it attaches any probe: the call is unseen. */
    struct hs_global *g = get_globals();
    if (g && is_armed())
        __sync_fetch_and_add(&g->dropped_pending, 1);
    return 0;
}

int calloc_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_CALLOC); }
int realloc_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_REALLOC); }
int memalign_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_MEMALIGN); }
int posix_memalign_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_POSIX_MEMALIGN); }
int valloc_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_VALLOC); }
int pvalloc_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_PVALLOC); }
int reallocarray_enter(struct pt_regs *ctx) { return enter_by_walker(ctx, HS_REALLOCARRAY); }

/* free has no return probe: all it needs is its argument. */
int free_enter(struct pt_regs *ctx)
{
    struct hs_global *g = get_globals();
    if (!g || !is_armed())
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    if (!addr)
        return 0;
    block_prefetch(addr);
    u32 tid = bpf_get_current_pid_tgid();
    struct hs_pending *p = find_pending(tid, g);
    u64 sp = PT_REGS_SP(ctx), ret0 = 0;
#if HS_STACKS
    note_stack(tid, sp, 0);
#endif
    if (p)
        bpf_probe_read_user(&ret0, sizeof(ret0), (void *)sp);
    if (p && (sp < p->sp || (sp == p->sp && ret0 != p->ret0))) {
        /* realloc(p, 0) frees through free: the realloc's return accounts for it. */
        __sync_fetch_and_add(&g->nested_calls, 1);
        return 0;
    }
    u64 free_site = (HS_FREE_STACKS || HS_MALT) ? capture_site(ctx, g, HS_FREE) : 0;
    u64 size = record_free(ctx, g, addr, free_site, HS_MALT ? bpf_ktime_get_ns() : 0);
    if (HS_MALT)
        thread_stat(tid, HS_FREE, 1, size, 0);
    return 0;
}

/* ---- return probe, shared by all allocation functions ---------------------------------------------- */

/* The alignment Valgrind's replacement gives a call of this kind: memalign, posix_memalign and aligned_alloc
 * go through its memalign, valloc asks for a page; malloc, calloc and realloc use Massif's --alignment. */
static __always_inline u64 request_alignment(const struct hs_pending *call)
{
    switch (call->fn) {
    case HS_MEMALIGN:
        return valgrind_alignment(call->arg0);
    case HS_POSIX_MEMALIGN:
        return valgrind_alignment(call->arg1);
    case HS_VALLOC:
        return 4096;
    default:
        return HS_ALIGNMENT;
    }
}

/* The bytes an allocation call asks for, by its kind (enum hs_fn): one rule for the block and MALT's counts. */
static __always_inline u64 request_size(const struct hs_pending *call)
{
    switch (call->fn) {
    case HS_CALLOC:
        return call->arg0 * call->arg1;
    case HS_REALLOC:
    case HS_MEMALIGN:
        return call->arg1;
    case HS_POSIX_MEMALIGN:
        return call->arg2;
    case HS_REALLOCARRAY:
        return call->arg1 * call->arg2;
    case HS_PVALLOC:
        return (call->arg0 + 4095) & ~4095ULL;
    default:
        return call->arg0;
    }
}

int alloc_return(struct pt_regs *ctx)
{
    struct hs_global *g = get_globals();
    if (!g)
        return 0;
    block_prefetch(PT_REGS_RC(ctx));
    u32 tid = bpf_get_current_pid_tgid();
    struct hs_pending *p = find_pending(tid, g);
    if (!p) {
        if (is_armed())
            __sync_fetch_and_add(&g->lost_returns, 1);
        return 0;
    }
    if (p->nested) {
        p->nested--;
        return 0;
    }
    struct hs_pending call = *p;
    release_pending(tid, p, g);
    if (!is_armed())
        return 0;

    u64 ret = PT_REGS_RC(ctx);
    u64 size = request_size(&call);
    u64 now = HS_MALT ? bpf_ktime_get_ns() : 0;
    if (HS_MALT)
        thread_stat(tid, call.fn, 1, size, now - call.entry_ns);
    switch (call.fn) {
    case HS_POSIX_MEMALIGN:
        if (ret != 0) { /* an error number: nothing allocated */
            __sync_fetch_and_add(&g->failed_allocs, 1);
            return 0;
        }
        ret = 0;
        bpf_probe_read_user(&ret, sizeof(ret), (void *)call.arg0);
        break;
    case HS_REALLOC:
    case HS_REALLOCARRAY: {
        u64 old = call.arg0;
        if (old && size == 0) { /* glibc: realloc(p, 0) frees p */
            record_free(ctx, g, old, call.stack, now);
            return 0;
        }
        if (!ret) {
            __sync_fetch_and_add(&g->failed_allocs, 1);
            return 0;
        }
        if (old)
            record_realloc(ctx, g, old, ret, size, call.stack, now);
        else
            record_alloc(ctx, g, ret, size, HS_ALIGNMENT, call.stack, now);
        return 0;
    }
    default:
        break;
    }
    if (!ret) {
        __sync_fetch_and_add(&g->failed_allocs, 1);
        return 0;
    }
    record_alloc(ctx, g, ret, size, request_alignment(&call), call.stack, now);
    return 0;
}

/* The user registers of the current thread, as saved at its entry into the kernel (for tracepoints, which
 * see the kernel's context, not the user's). */
struct hs_user_regs {
    u64 ip;
    u64 sp;
    u64 bp;
};

static __always_inline struct hs_user_regs user_regs(void)
{
    struct hs_user_regs u = {};
    struct pt_regs *r = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    bpf_probe_read_kernel(&u.ip, sizeof(u.ip), &r->ip);
    bpf_probe_read_kernel(&u.sp, sizeof(u.sp), &r->sp);
    bpf_probe_read_kernel(&u.bp, sizeof(u.bp), &r->bp);
    return u;
}

/* ---- events: exec, loader changes and exit -------------------------------------------------------- */

/* Tell user space; with HS_STOP_EVENTS also stop the target until user space has caught up (it clears
 * control[HS_CTL_STOPPED] and sends SIGCONT). */
static __always_inline void signal_event(void *ctx, u64 event)
{
    if (HS_STOP_EVENTS) {
        u32 idx = HS_CTL_STOPPED;
        control.update(&idx, &event);
        bpf_send_signal(19 /* SIGSTOP */);
    }
    events.perf_submit(ctx, &event, sizeof(event));
}

/* The target's exec: `run` arms at the first one; any later one (or any, for `attach`) disarms. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    if ((bpf_get_current_pid_tgid() >> 32) != HS_TARGET_TGID)
        return 0;
    struct hs_global *g = get_globals();
    if (!g)
        return 0;
    u64 n = __sync_fetch_and_add(&g->execs, 1) + 1;
    u32 idx = HS_CTL_ARMED;
    u64 armed = (n == HS_ARM_ON_EXEC);
    control.update(&idx, &armed);
    if (armed) {
#if HS_STACKS
        /* The new image's initial stack pointer: the main stack is measured from here. */
        struct hs_user_regs u = user_regs();
        note_stack((u32)bpf_get_current_pid_tgid(), u.sp, 1);
#endif
        signal_event(args, HS_EV_EXEC);
    }
    return 0;
}

/* _dl_debug_state: the loader's hook for debuggers, called after it maps or unmaps objects. */
int loader_enter(struct pt_regs *ctx)
{
    if ((bpf_get_current_pid_tgid() >> 32) != HS_TARGET_TGID || !is_armed())
        return 0;
    signal_event(ctx, HS_EV_LOADER);
    return 0;
}

int exit_enter(struct pt_regs *ctx)
{
    if ((bpf_get_current_pid_tgid() >> 32) != HS_TARGET_TGID || !is_armed())
        return 0;
    signal_event(ctx, HS_EV_EXIT);
    return 0;
}

/* ---- thread stacks (HS_STACKS) ---------------------------------------------------------------------- */

#if HS_STACKS
/* A new thread starts on the stack its creator gave clone: the child's first return to user space. */
static __always_inline int clone_exit(long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID || ret != 0 || !is_armed())
        return 0;
    struct hs_user_regs u = user_regs();
    note_stack((u32)id, u.sp, 1);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_clone) { return clone_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_clone3) { return clone_exit(args->ret); }

/* A thread that ends takes its stack with it. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID)
        return 0;
    u32 tid = id;
    thread_stacks.delete(&tid);
    return 0;
}
#endif

/* ---- page-level memory (HS_PAGES): mmap, munmap, mremap, brk ------------------------------------------ */

#if HS_PAGES
/* page_calls: thread id -> the page syscall it is in (arguments and site), from entry to exit */
BPF_F_TABLE("hash", u32, struct hs_page_call, page_calls, HS_MAX_THREADS, BPF_F_NO_PREALLOC);
/* page_events: struct hs_page_event, one per completed page syscall, in the order they completed */
BPF_RINGBUF_OUTPUT(page_events, HS_PAGE_RING_PAGES);
/* page_counters: enum hs_page_counter -> count */
BPF_ARRAY(page_counters, u64, HS_PGC_COUNT);
/* page_walker: 0 -> page_enter_walk, the one copy of the stack walk of the four entry tracepoints (a
 * program array holds programs of one type, so not alloc_walker) */
BPF_PROG_ARRAY(page_walker, 1);

static __always_inline void page_count(u32 which)
{
    count_in(page_counters.lookup(&which), 1);
}

/* At a page syscall's entry: keep its arguments and charge it to the user stack that made it. The walk
 * starts at the user's instruction pointer (just past the syscall instruction, in the libc wrapper). */
static __always_inline int page_enter(void *ctx, u32 kind, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID || !is_armed())
        return 0;
    struct hs_global *g = get_globals();
    if (!g)
        return 0;
    struct hs_user_regs u = user_regs();
    u32 tid = id;
#if HS_STACKS
    note_stack(tid, u.sp, 0);
#endif
    struct hs_page_call call = {.tid = tid, .arg0 = a0, .arg1 = a1, .arg2 = a2, .arg3 = a3, .arg4 = a4, .kind = kind};
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (arg) {
        *arg = call;
        page_walker.call(ctx, 0);
    }
    /* Only without the walker (installed before the probes are armed): the call, charged to no stack. */
    call.site = HS_STACK_OVERFLOW;
    if (page_calls.update(&tid, &call))
        page_count(HS_PGC_CALLS_FULL);
    return 0;
}

/* page_walker's program: the stack of the page syscall in walk_arg, and the call kept until its exit (an
 * argument that is not ours leaves the call out: its exit counts it unpaired). */
int page_enter_walk(void *ctx)
{
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    struct hs_global *g = get_globals();
    if (!arg || !g || !walk_arg_is_ours(arg))
        return 0;
    struct hs_page_call call = *arg;
    struct hs_user_regs u = user_regs();
    u32 tid = bpf_get_current_pid_tgid();
    call.site = capture_stack_at(0, u.ip, u.sp, u.bp, g, HS_FN_PAGES);
    if (page_calls.update(&tid, &call))
        page_count(HS_PGC_CALLS_FULL);
    return 0;
}

/* At its exit: one event with the arguments and the result, for agent/model/pages.py to apply in order. */
static __always_inline int page_exit(void *ctx, u32 kind, long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID)
        return 0;
    u32 tid = id;
    struct hs_page_call *c = page_calls.lookup(&tid);
    if (!c) {
        if (is_armed())
            page_count(HS_PGC_UNPAIRED);
        return 0;
    }
    struct hs_page_call call = *c;
    page_calls.delete(&tid);
    if (call.kind != kind) { /* cannot happen: a thread is in one syscall at a time */
        page_count(HS_PGC_UNPAIRED);
        return 0;
    }
    struct hs_page_event *e = page_events.ringbuf_reserve(sizeof(struct hs_page_event));
    /* Linux 6.15+ takes the ring's lock with a resilient spinlock, which can fail while the ring has room: try
     * again, twice */
    if (!e)
        e = page_events.ringbuf_reserve(sizeof(struct hs_page_event));
    if (!e)
        e = page_events.ringbuf_reserve(sizeof(struct hs_page_event));
    if (!e) {
        page_count(HS_PGC_LOST);
        return 0;
    }
    e->time_ns = bpf_ktime_get_ns();
    e->site = call.site;
    e->tid = tid;
    e->kind = kind;
    e->ret = ret;
    e->prot = 0;
    e->flags = 0;
    e->new_addr = 0;
    e->new_length = 0;
    switch (kind) {
    case HS_PG_MMAP: /* addr, len, prot, flags */
        e->addr = ret;
        e->length = call.arg1;
        e->prot = call.arg2;
        e->flags = call.arg3;
        break;
    case HS_PG_MUNMAP: /* addr, len */
        e->addr = call.arg0;
        e->length = call.arg1;
        break;
    case HS_PG_MREMAP: /* addr, old_len, new_len, flags, new_addr */
        e->addr = call.arg0;
        e->length = call.arg1;
        e->new_length = call.arg2;
        e->flags = call.arg3;
        e->new_addr = ret;
        break;
    default: /* brk */
        e->addr = call.arg0;
        e->length = 0;
        e->new_addr = ret;
        break;
    }
    /* No wakeup: user space drains the buffer when it samples, and a wakeup per call costs an IPI. */
    page_events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    page_count(HS_PGC_EVENTS);
    /* But the event that fills the ring to half (and to three quarters, should that wake-up be missed) wakes
     * user space once: a daemon looking at a quiet target once a second drains a burst before the ring
     * overflows, so the ring can stay small. Its fill is the events sent less those user space took. */
    u32 sent_idx = HS_PGC_EVENTS;
    u64 *sent = page_counters.lookup(&sent_idx);
    if (sent) {
        u64 held = HS_ONCE(*sent) - control_word(HS_CTL_PAGES_DRAINED);
        u64 room = (u64)HS_PAGE_RING_PAGES * 4096 / ((sizeof(struct hs_page_event) + 8 + 7) & ~7ULL);
        if (held == room / 2 || held == room / 2 + room / 4) {
            u64 event = HS_EV_PAGES;
            events.perf_submit(ctx, &event, sizeof(event));
        }
        /* `run`: from three quarters full on, the target waits until user space has drained the ring, so no
         * call is lost however fast it makes them (sampled mode never stops a target). */
        if (HS_STOP_EVENTS && !HS_SAMPLED && held >= room / 2 + room / 4) {
            u64 event = HS_EV_PAGES;
            u32 stop_idx = HS_CTL_STOPPED;
            control.update(&stop_idx, &event);
            bpf_send_signal(19 /* SIGSTOP */);
        }
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    return page_enter(args, HS_PG_MMAP, args->addr, args->len, args->prot, args->flags, args->fd);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return page_exit(args, HS_PG_MMAP, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_munmap) { return page_enter(args, HS_PG_MUNMAP, args->addr, args->len, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_munmap) { return page_exit(args, HS_PG_MUNMAP, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_mremap)
{
    return page_enter(args, HS_PG_MREMAP, args->addr, args->old_len, args->new_len, args->flags, args->new_addr);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mremap) { return page_exit(args, HS_PG_MREMAP, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_brk) { return page_enter(args, HS_PG_BRK, args->brk, 0, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_brk) { return page_exit(args, HS_PG_BRK, args->ret); }
#endif
