/* unwind.h: a call's user stack and its site id. The walk follows the .eh_frame rules user space loads into
 * unwind_rows (HS_UNWIND), or frame pointers; each stack is stored once, under the site id it gets. */

/* site_stacks: site id -> struct hs_stack (its return addresses), written at the site's creation; apart from
 * the counters, so that a snapshot does not read them again (user space reads a site's stack once). A hash
 * map, not an array: it holds the stacks there are, not 512 bytes for every possible site. */
BPF_F_TABLE("hash", u32, struct hs_stack, site_stacks, HS_MAX_STACKS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(site_stacks_of, "site_stacks", HS_TARGETS);
/* stack_ids: stack hash -> site id (u64), consulted only when a CPU meets a stack it did not store last */
BPF_F_TABLE("hash", u64, u64, stack_ids, HS_MAX_STACKS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(stack_ids_of, "stack_ids", HS_TARGETS);
/* stack_cache: stack hash bits -> struct hs_last_stack, per CPU (stacks met recently skip stack_ids; with
 * free stacks, malloc and free alternate, so one entry would miss every time) */
BPF_PERCPU_ARRAY(stack_cache, struct hs_last_stack, HS_STACK_CACHE);
BPF_ARRAY_OF_MAPS(stack_cache_of, "stack_cache", HS_TARGETS);
/* stack_copy: 0 -> struct hs_stack_copy, per CPU (the run of the user stack the walk reads from) */
BPF_PERCPU_ARRAY(stack_copy, struct hs_stack_copy, 1);
/* rule_cache: pc and mapping set bits -> struct hs_rule_entry, per CPU (hot return addresses skip both binary
 * searches). One cache for every target, its entries keyed by the mapping set's identity rather than the target:
 * a prefork server's workers, the same objects at the same places, walk the same return addresses, and with a
 * key of their own each evicted the others' rules at every switch between them (apache2: every sampled walk
 * searched the tables). The walk reaches it without a map of maps, which kept the deepest sampled walks within
 * the verifier's limit. */
BPF_PERCPU_ARRAY(rule_cache, struct hs_rule_entry, HS_RULE_CACHE);
/* scratch: 0 -> the stack being walked (too big for the BPF stack) */
BPF_PERCPU_ARRAY(scratch, struct hs_stack, 1);

/* unwind_rows: row index -> struct hs_row (the unwind tables of all objects, each a sorted run). One table for
 * every target of the daemon, declared by a holder program (agent/kernel/arrays.py SharedRows): an object's
 * rows are loaded once, whichever targets map it. */
BPF_TABLE("extern", int, struct hs_row, unwind_rows, HS_MAX_ROWS);
/* unwind_maps: slot * 2 * HS_MAX_UMAPS + index -> struct hs_umap: each target's two halves of HS_MAX_UMAPS sorted
 * by start; its control[HS_CTL_UMAPS] says which half and how many are published, so user space rewrites the other
 * half and flips. */
BPF_ARRAY(unwind_maps, struct hs_umap, HS_TARGETS * 2 * HS_MAX_UMAPS);

static __always_inline u64 mix(u64 h, u64 v)
{
    h ^= v;
    h *= 0x100000001b3ULL;
    h ^= h >> 29;
    return h;
}

/* State of a stack walk: the registers of the frame being left, and the run of stack copied so far. */
struct walk {
    struct hs_stack *st;
    struct hs_global *g;
    struct hs_stack_copy *copy;
    u64 sp;     /* the caller's %rsp once the current frame returns */
    u64 bp;     /* the caller's %rbp */
    u64 ret;    /* the current frame's return address (ip[n - 1]) */
    u64 h;
    u64 umaps;    /* control[HS_CTL_UMAPS] as the walk began: the published mappings it searches */
    u64 rules_id; /* their set's identity (umaps >> HS_UMAPS_ID_SHIFT): its entries in rule_cache */
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

static __always_inline u32 rule_slot(struct walk *w, u64 pc)
{
    return (pc ^ (pc >> 10) ^ (pc >> 20) ^ w->rules_id) & (HS_RULE_CACHE - 1);
}

/* The rule this CPU cached for pc in the same mapping set, or 0 (no rule packs to 0). */
static __always_inline u64 cached_rule(struct walk *w, u64 pc)
{
    u32 idx = rule_slot(w, pc);
    struct hs_rule_entry *e = rule_cache.lookup(&idx);
    if (!e)
        return 0;
    u64 seq = HS_ONCE(e->seq);
    hs_barrier();
    if (!seq || (seq & 1) || e->pc != pc || e->umaps != w->rules_id)
        return 0;
    u64 rule = e->rule;
    hs_barrier();
    return HS_ONCE(e->seq) == seq ? rule : 0;
}

static __always_inline void cache_rule(struct walk *w, u64 pc, u64 rule)
{
    /* Published again since the walk began: the half it read from may be rewritten under it, and another target
     * with the walk's set would take what it found. Not cached then. (A publication between this check and the
     * write below still could: two publications within one walk's few microseconds.) */
    if (control_word(w->g, HS_CTL_UMAPS) != w->umaps)
        return;
    u32 idx = rule_slot(w, pc);
    struct hs_rule_entry *e = rule_cache.lookup(&idx);
    if (!e)
        return;
    u64 seq = HS_ONCE(e->seq);
    if (seq & 1) /* a program this one preempted is writing it; leave it to that one */
        return;
    HS_ONCE(e->seq) = seq + 1;
    hs_barrier();
    e->pc = pc;
    e->umaps = w->rules_id;
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
    /* The target's own maps, found and checked before the walk: after it the verifier knows them in every state
     * the walk can end in (a check after the walk would be verified once per way it ends). */
    void *cache_map = stack_cache_of.lookup(&g->slot);
    void *ids = stack_ids_of.lookup(&g->slot);
    void *stacks = site_stacks_of.lookup(&g->slot);
    void *site_map = sites_of.lookup(&g->slot);
    if (!st || !copy || !cache_map || !ids || !stacks || !site_map)
        return HS_STACK_OVERFLOW;

    u64 h = 0xcbf29ce484222325ULL;
    struct walk w = {.st = st, .g = g, .copy = copy, .bp = bp};
    w.stack_end = control_word(g, HS_CTL_STACK_END);
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
    u64 umaps = control_word(g, HS_CTL_UMAPS);
    w.umaps = umaps;
    w.rules_id = umaps >> HS_UMAPS_ID_SHIFT;
    w.umap_first = (g->slot * 2 + ((umaps >> HS_UMAPS_HALF_SHIFT) & 1)) * HS_MAX_UMAPS;
    w.umap_count = umaps & ((1 << HS_UMAPS_HALF_SHIFT) - 1);
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
            copy->searched++;
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
    counted = copy->searched;
    if (counted) {
        copy->searched = 0;
        __sync_fetch_and_add(&g->unwind_searched, counted);
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
    struct hs_last_stack *cached = bpf_map_lookup_elem(cache_map, &slot_idx);
    if (cached) {
        s64 known_id = cached_stack(cached, h);
        if (known_id >= 0)
            return known_id;
    }
    u64 id;
    u64 *known = bpf_map_lookup_elem(ids, &h);
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
        if (bpf_map_update_elem(stacks, &slot, st, BPF_ANY)) { /* no memory for it: the call goes to the overflow site */
            __sync_fetch_and_add(&g->dropped_stacks, 1);
            return HS_STACK_OVERFLOW;
        }
        if (copy->walks != walk_no) { /* overtaken while storing it: the id stays an empty site */
            __sync_fetch_and_add(&g->walks_interrupted, 1);
            return HS_STACK_OVERFLOW;
        }
        struct hs_site *site = bpf_map_lookup_elem(site_map, &slot);
        if (site) {
            site->fn = fn;
            site->peak_gen = g->peak_gen;
        }
        if (bpf_map_update_elem(ids, &h, &id, BPF_NOEXIST)) {
            /* Another CPU published this stack first (its id wins; ours stays an empty site), or the
             * table is full (the site stays, reachable only through this CPU's cache). */
            known = bpf_map_lookup_elem(ids, &h);
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
