/* accounting.h: Massif's accounting of the heap calls: a block's slop as Valgrind's arena gives it, the sites'
 * and the totals' counters at each allocation, free and realloc, and --ignore-fn's site flags. */

#if HS_IGNORE
/* site_flags: site id -> enum hs_site_flag, written by user space as it symbolizes sites (--ignore-fn) */
BPF_TARGET_ARRAY(site_flags, u8, HS_MAX_STACKS);
BPF_ARRAY_OF_MAPS(site_flags_of, "site_flags", HS_TARGETS);
#endif

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

/* HS_IGNORE: what user space says site `id` is (enum hs_site_flag); without --ignore-fn every site counts. */
static __always_inline u64 site_flag(struct hs_global *g, u64 id)
{
#if HS_IGNORE
    if (id == HS_STACK_OVERFLOW) /* no stack: nothing to ignore it by */
        return HS_SITE_COUNTED;
    u32 idx = id;
    u8 *flag = t_lookup(site_flags_of.lookup(&g->slot), &idx);
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
    if (HS_IGNORE && site_flag(g, stack) == HS_SITE_IGNORED) {
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
        malt_free(g, s, free_stack ? get_site(free_stack, g) : 0, blk.size, blk.alloc_ns, now, 1);
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
    if (HS_IGNORE && ((ob.stack & HS_BLOCK_IGNORED) || site_flag(g, stack) == HS_SITE_IGNORED)) {
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
        malt_free(g, os, 0, ob.size, ob.alloc_ns, now, 1);
        malt_alloc(g, ns, stack, size, 1);
        if (ns) {
            __sync_fetch_and_add(&ns->realloc_count, 1);
            __sync_fetch_and_add(&ns->realloc_delta, dheap);
        }
        struct hs_jump jump = {.old_size = ob.size, .new_size = size};
        void *jumps = realloc_jump_of.lookup(&g->slot);
        u64 *n = t_lookup(jumps, &jump);
        if (n) {
            __sync_fetch_and_add(n, 1);
        } else {
            u64 one = 1;
            if (t_update(jumps, &jump, &one, BPF_NOEXIST) == -17)
                count_in(t_lookup(jumps, &jump), 1);
            else if (!t_lookup(jumps, &jump))
                __sync_fetch_and_add(&g->dropped_sizes, 1);
        }
    }
    schedule_check(ctx, g, time_b, now);
}
