/* sampled.h: sampled mode's programs (HS_SAMPLED: ProbeSettings.sampled), the last part heap.bpf.c includes, as
 * they use the parts before it.
 *
 * The in-process sampler (probes/sampler/hs_sampler.c) calls hs_sample_alloc(ptr, size, weight, fn) for each
 * sampled allocation (fn: the allocation function's enum hs_fn, as exact mode would record the call) and
 * hs_sample_free(ptr) when a sampled block is freed; unsampled calls never reach the
 * kernel. Both functions start with a 5-byte nop, so Linux 6.18 runs these probes through its uprobe
 * trampoline instead of a trap. No return probe is needed: the block's address is an argument.
 *
 * A sample of s bytes taken with probability p = 1 - e^(-s/T) stands for 1/p blocks of s bytes (the sampler
 * passes the byte weight s/p, rounded; exactly s at or above the rate T). Here it stands for N whole blocks
 * of s bytes, N being 1/p rounded at random (up with the probability of its fraction), so E[N] = 1/p and
 * every sum kept here (the sites' counters, the totals, the peak, the --time-unit=B clock, MALT's counts) is
 * an unbiased estimate, and each stays whole-block consistent: bytes = N * s, Massif's extra = N * (slop of s
 * + --heap-admin), MALT's sizes and counts fit each other (its checks hold). The rounding adds little
 * variance: 1/N of a block for s well below T, and at most a quarter of s^2 a sample near T, where N is 1
 * or 2 (the sampling's own variance there is about s^2).
 * Sampled blocks live in their own table (sampled_blocks), with what they were recorded at: a free takes
 * back exactly that. The stack starts inside the sampler (hs_account_slow, then an hs_hook_* function); user
 * space trims those frames (SiteReader.lead_trim) as it trims allocation functions.
 * The snapshot schedule (schedule.h schedule_check) runs at the sampled calls, as at every call in exact mode:
 * without it the session would take no snapshot after its first. Its points carry the estimated totals, and in
 * ms no point can come between two samples.
 */

/* sampled_blocks: block address -> struct hs_sampled_block (the live sampled blocks). Not preallocated: a
 * sampled target holds few blocks here (about its heap / HS_SAMPLE_RATE, fewer under a budget), so its memory
 * follows them; only the bucket array (16 bytes an entry) is sized from --max-blocks. In sampled mode the exact
 * mode's block tables (block_slots, blocks) are compiled at their smallest: no program here uses them. */
BPF_F_TABLE("hash", u64, struct hs_sampled_block, sampled_blocks, HS_MAX_SAMPLED_BLOCKS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(sampled_blocks_of, "sampled_blocks", HS_TARGETS);

/* N: 1/p from the weight (weight / size in 16.16 fixed point), its fraction rounded at random. From the weight
 * alone, not the rate: under a sampling budget the rate in force is above the asked one (HS_SAMPLE_RATE), and a
 * block of more than the asked rate may have been sampled with p < 1. */
static __always_inline u64 sample_blocks(u64 size, u64 weight)
{
    if (weight <= size)
        return 1;
    u64 fixed = (weight << 16) / size;
    u64 blocks = fixed >> 16;
    if ((bpf_get_prandom_u32() & 0xffff) < (fixed & 0xffff))
        blocks++;
    return blocks;
}

/* A sample's accounting runs in a program of its own, tail-called once the stack is walked: the verifier then
 * checks it once, not once for every way the walk can end (with MALT at the deepest walks that took
 * sample_alloc_enter past its limit). sample_arg hands it the sample: per CPU, as walk_arg. */
struct hs_sample_arg {
    u64 tid;
    u64 slot;
    u64 addr;
    u64 size;
    u64 weight;
    u64 stack;
    u64 fn;
};
BPF_PERCPU_ARRAY(sample_arg, struct hs_sample_arg, 1);
/* sample_accounting: 0 -> sample_alloc_account */
BPF_PROG_ARRAY(sample_accounting, 1);

int sample_alloc_enter(struct pt_regs *ctx)
{
    struct hs_global *g = uprobe_globals(ctx);
    if (!g || !is_armed(g))
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    u64 size = PT_REGS_PARM2(ctx);
    u64 weight = PT_REGS_PARM3(ctx);
    if (!addr || !size || !weight)
        return 0;
#if HS_STACKS
    note_stack(g, (u32)bpf_get_current_pid_tgid(), PT_REGS_SP(ctx), 0);
#endif
    u64 stack = capture_stack(ctx, g, HS_MALLOC);
    u32 zero = 0;
    struct hs_sample_arg *arg = sample_arg.lookup(&zero);
    if (!arg)
        return 0;
    arg->tid = (u32)bpf_get_current_pid_tgid();
    arg->slot = g->slot;
    arg->addr = addr;
    arg->size = size;
    arg->weight = weight;
    arg->stack = stack;
    /* The allocation function, read after the walk: a value the verifier tracks through the walk would split
     * its states. An allocation function only: HS_FREE and beyond are malloc. */
    u64 arg_fn = PT_REGS_PARM4(ctx);
    arg->fn = arg_fn < HS_FREE ? (u32)arg_fn : HS_MALLOC;
    sample_accounting.call(ctx, 0);
    /* Only without the accounting program, which user space installs before it attaches any probe. */
    __sync_fetch_and_add(&g->dropped_blocks, 1);
    return 0;
}

int sample_alloc_account(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct hs_sample_arg *arg = sample_arg.lookup(&zero);
    if (!arg)
        return 0;
    struct hs_global *g = get_globals(arg->slot);
    if (!g)
        return 0;
    if (arg->tid != (u32)bpf_get_current_pid_tgid()) { /* another thread's run came in between (preemption) */
        __sync_fetch_and_add(&g->walks_interrupted, 1);
        return 0;
    }
    u64 addr = arg->addr, size = arg->size, weight = arg->weight, stack = arg->stack;
    u32 fn = arg->fn;
    /* The site is filed under its function below (a stack starts with its hook: one stack, one function). */
    u64 now = HS_MALT ? bpf_ktime_get_ns() : 0;
    struct hs_sampled_block b = {
        .blocks = sample_blocks(size, weight),
        .stack = stack,
        .size = size,
        .alloc_ns = now,
    };
    b.bytes = b.blocks * size;
    b.extra = b.blocks * (massif_slop(size, HS_ALIGNMENT) + HS_HEAP_ADMIN);
    if (t_update(sampled_blocks_of.lookup(&g->slot), &addr, &b, BPF_ANY)) {
        __sync_fetch_and_add(&g->dropped_blocks, 1);
        return 0;
    }
    struct hs_site *s = get_site(stack, g);
    if (s) {
        if (s->fn != fn && stack != HS_STACK_OVERFLOW)
            s->fn = fn;
        site_touch(ctx, s, stack, g);
        __sync_fetch_and_add(&s->cur_bytes, b.bytes);
        __sync_fetch_and_add(&s->cur_extra, b.extra);
        __sync_fetch_and_add(&s->cur_blocks, b.blocks);
        __sync_fetch_and_add(&s->tot_bytes, b.bytes);
        __sync_fetch_and_add(&s->tot_blocks, b.blocks);
    }
    __sync_fetch_and_add(&g->heap, b.bytes);
    __sync_fetch_and_add(&g->extra, b.extra);
    __sync_fetch_and_add(&g->blocks, b.blocks);
    __sync_fetch_and_add(&g->n_allocs, b.blocks); /* user space shows the sampler's exact count instead */
    __sync_fetch_and_add(&g->alloc_bytes, b.bytes);
    u64 time_b = advance_time(g, b.bytes + b.extra);
    check_peak(g, s, 0);
    if (HS_MALT) {
        malt_alloc(g, s, stack, size, b.blocks);
        thread_stat(g, (u32)bpf_get_current_pid_tgid(), fn, b.blocks, b.bytes, 0);
    }
    schedule_check(ctx, g, time_b, now);
    return 0;
}

int sample_free_enter(struct pt_regs *ctx)
{
    struct hs_global *g = uprobe_globals(ctx);
    if (!g || !is_armed(g))
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    if (!addr)
        return 0;
    void *sampled = sampled_blocks_of.lookup(&g->slot);
    struct hs_sampled_block *found = t_lookup(sampled, &addr);
    if (!found) {
        __sync_fetch_and_add(&g->untracked_frees, 1);
        return 0;
    }
    struct hs_sampled_block b = *found;
    if (t_delete(sampled, &addr)) /* another CPU took it first (a double free racing) */
        return 0;
    u64 free_site = (HS_FREE_STACKS || HS_MALT) ? capture_stack(ctx, g, HS_FREE) : 0;
    u64 now = HS_MALT ? bpf_ktime_get_ns() : 0;
    schedule_peak_check(ctx, g, now);
    struct hs_site *s = get_site(b.stack, g);
    if (s) {
        site_touch(ctx, s, b.stack, g);
        __sync_fetch_and_add(&s->cur_bytes, -b.bytes);
        __sync_fetch_and_add(&s->cur_extra, -b.extra);
        __sync_fetch_and_add(&s->cur_blocks, -b.blocks);
    }
    struct hs_site *charged = (HS_FREE_STACKS && free_site) ? get_site(free_site, g) : s;
    if (charged) {
        __sync_fetch_and_add(&charged->freed_bytes, b.bytes);
        __sync_fetch_and_add(&charged->freed_blocks, b.blocks);
    }
    if (HS_MALT) {
        malt_free(g, s, free_site ? get_site(free_site, g) : 0, b.size, b.alloc_ns, now, b.blocks);
        thread_stat(g, (u32)bpf_get_current_pid_tgid(), HS_FREE, b.blocks, b.bytes, 0);
    }
    __sync_fetch_and_add(&g->heap, -b.bytes);
    __sync_fetch_and_add(&g->extra, -b.extra);
    __sync_fetch_and_add(&g->blocks, -b.blocks);
    __sync_fetch_and_add(&g->n_frees, b.blocks);
    __sync_fetch_and_add(&g->freed_bytes, b.bytes);
    schedule_check(ctx, g, advance_time(g, b.bytes + b.extra), now);
    return 0;
}
