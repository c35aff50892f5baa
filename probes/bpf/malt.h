/* malt.h: MALT's statistics (HS_MALT): request sizes, realloc jumps, per-thread counts, the sites' min/max and
 * lifetimes, and the size and lifetime histograms. */

/* MALT (HS_MALT): size_map: request size -> count; realloc_jump: struct hs_jump -> count;
 * thread_stats: tid << 8 | enum hs_fn -> struct hs_thread_stat */
BPF_F_TABLE("hash", u64, u64, size_map, HS_MAX_SIZES, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(size_map_of, "size_map", HS_TARGETS);
/* small_sizes: request size -> count, for sizes below HS_SMALL_SIZES (no hashing on the common sizes) */
BPF_TARGET_ARRAY(small_sizes, u64, HS_SMALL_SIZES);
BPF_ARRAY_OF_MAPS(small_sizes_of, "small_sizes", HS_TARGETS);
BPF_F_TABLE("hash", struct hs_jump, u64, realloc_jump, HS_MAX_JUMPS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(realloc_jump_of, "realloc_jump", HS_TARGETS);
BPF_F_TABLE("hash", u64, struct hs_thread_stat, thread_stats, HS_MAX_THREADS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(thread_stats_of, "thread_stats", HS_TARGETS);
/* thread_slots: (tid mod HS_THREAD_SLOTS) * HS_FN_COUNT + fn -> the owning thread's statistics */
BPF_TARGET_ARRAY(thread_slots, struct hs_thread_slot, HS_THREAD_SLOTS * HS_FN_COUNT);
BPF_ARRAY_OF_MAPS(thread_slots_of, "thread_slots", HS_TARGETS);
/* size_hist: log2(size) -> allocations so far; life_hist: log2(size) * 64 + log2(lifetime ns) -> frees so
 * far. Cumulative: user space takes the difference between two samples, so nothing is ever reset. */
BPF_TARGET_ARRAY(size_hist, u64, HS_LOG2_BINS);
BPF_ARRAY_OF_MAPS(size_hist_of, "size_hist", HS_TARGETS);
BPF_TARGET_ARRAY(life_hist, u64, HS_LOG2_BINS * HS_LOG2_BINS);
BPF_ARRAY_OF_MAPS(life_hist_of, "life_hist", HS_TARGETS);
/* window: 0 -> struct hs_window (the timeline's maximum since the last sample) */
BPF_TARGET_ARRAY(window, struct hs_window, 1);
BPF_ARRAY_OF_MAPS(window_of, "window", HS_TARGETS);

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
static __always_inline void thread_stat(struct hs_global *g, u64 tid, u32 fn, u64 n, u64 bytes, u64 ns)
{
    u32 idx = (tid & (HS_THREAD_SLOTS - 1)) * HS_FN_COUNT + (fn < HS_FN_COUNT ? fn : 0);
    struct hs_thread_slot *slot = t_lookup(thread_slots_of.lookup(&g->slot), &idx);
    struct hs_thread_stat *t = 0;
    if (slot && (slot->tid == tid || (slot->tid == 0 && __sync_val_compare_and_swap(&slot->tid, 0, tid) == 0)))
        t = &slot->stat;
    u64 key = (tid << 8) | fn; /* else the slot belongs to another thread with the same low bits */
    void *hashed = thread_stats_of.lookup(&g->slot);
    if (!t)
        t = t_lookup(hashed, &key);
    if (!t) {
        struct hs_thread_stat fresh = {};
        t_update(hashed, &key, &fresh, BPF_NOEXIST);
        t = t_lookup(hashed, &key);
        if (!t) {
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
        count_in(t_lookup(small_sizes_of.lookup(&g->slot), &idx), n);
    } else {
        void *sizes = size_map_of.lookup(&g->slot);
        u64 *c = t_lookup(sizes, &size);
        if (c) {
            __sync_fetch_and_add(c, n);
        } else {
            u64 first = n;
            if (t_update(sizes, &size, &first, BPF_NOEXIST) == -17 /* EEXIST: another CPU inserted it */)
                count_in(t_lookup(sizes, &size), n);
            else if (!t_lookup(sizes, &size))
                __sync_fetch_and_add(&g->dropped_sizes, 1);
        }
    }
    u32 bin = log2_bin(size);
    count_in(t_lookup(size_hist_of.lookup(&g->slot), &bin), n);
    u32 zero = 0;
    struct hs_window *w = t_lookup(window_of.lookup(&g->slot), &zero);
    if (w && g->heap > w->max_heap) {
        w->max_heap = g->heap;
        w->site = site;
    }
}

static __always_inline void malt_free(struct hs_global *g, struct hs_site *alloc_site, struct hs_site *free_site, u64 size, u64 alloc_ns,
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
    count_in(t_lookup(life_hist_of.lookup(&g->slot), &bin), n);
}
