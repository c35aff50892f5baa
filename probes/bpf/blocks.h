/* blocks.h: the table of live blocks, by address: each block's size, slop, site and allocation time, from its
 * allocation to its free.
 *
 * One table for every target of the program, sized for the node (HS_BLOCK_SLOTS, HS_MAX_BLOCKS), not one a target:
 * a block is keyed by its address tagged with its target's slot in the bits above any user address (block_key),
 * and each target may hold at most HS_TARGET_BLOCKS live blocks (beyond, its blocks are dropped, counted). */

/* block_slots: the live blocks, by address: bucket block_bucket(addr), two slots. An array, so finding a
 * block is a few inlined instructions and one cache line, with no lock and no allocation (a hash map's
 * update and delete cost more than the rest of the accounting). Mmapable only for its page alignment,
 * which keeps each bucket in one cache line. */
BPF_F_TABLE("array", int, struct hs_block_slot, block_slots, HS_BLOCK_SLOTS, BPF_F_MMAPABLE);
/* blocks: block address -> struct hs_block, for the blocks whose bucket was full. Like every hash map here it
 * is not preallocated (BPF_F_NO_PREALLOC): its memory follows the target's use, not the worst case, so a
 * daemon watching many quiet targets does not hold their tables' full size each. */
BPF_F_TABLE("hash", u64, struct hs_block, blocks, HS_MAX_BLOCKS, BPF_F_NO_PREALLOC);

/* A block's key: its address, with its target's slot above bit 56 (user addresses end below 2^56, even with
 * five-level page tables), so that two targets' blocks at one address are two keys. */
static __always_inline u64 block_key(struct hs_global *g, u64 addr)
{
    return addr | (u64)g->slot << 56;
}

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
static __always_inline void block_prefetch(struct hs_global *g, u64 addr)
{
    struct hs_block_slot *s = block_slot(block_bucket(block_key(g, addr)));
    if (s)
        (void)HS_ONCE(s->addr);
}

/* Track a new block: in its bucket, else in the overflow hash; returns 0, or -1 when both are full (counted).
 * An address already tracked (its free went unseen) is overwritten in place. No other CPU can free addr
 * while this runs: the allocator has not returned it yet. */
static __always_inline int block_put(struct hs_global *g, u64 addr, struct hs_block *b)
{
    if (HS_ONCE(g->blocks) >= HS_TARGET_BLOCKS) { /* this target's share of the node's table is full */
        __sync_fetch_and_add(&g->dropped_blocks, 1);
        return -1;
    }
    addr = block_key(g, addr);
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
    addr = block_key(g, addr);
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
