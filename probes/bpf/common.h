/* common.h: what every part of heap.bpf.c shares: the counters (globals), the control words user space writes,
 * the event channel that wakes user space, the sites' counters, and the small helpers around them.
 *
 * One loaded program serves every target of its shape (its settings): each target has a slot. A uprobe's
 * program finds its target's slot in its link's cookie (user space attaches a target's links with its slot), a
 * tracepoint's in `targets`, by the process. The per-target counters and control words are indexed by slot; every
 * other per-target map is an array of maps (NAME_of) holding the target's own map at its slot: user space makes a
 * target's maps (slot 0 has the ones bcc made, the templates) and removes them at its detach, so a target's
 * tables and rings are its own, and a detach leaves the others as they were. */

/* A per-target array, mmapable: user space empties a detached target's arrays in place for the slot's next target
 * (agent/kernel/emptying.py), where zeroing them by update calls cost more than new maps. */
#define BPF_TARGET_ARRAY(_name, _leaf_type, _size) BPF_F_TABLE("array", int, _leaf_type, _name, _size, BPF_F_MMAPABLE)

/* targets: tgid -> slot, for the tracepoints (exec, page calls, thread starts and exits) */
BPF_HASH(targets, u32, u32, HS_TARGETS);
/* globals: slot -> struct hs_global (mmapable, as control, page_counters: user space reads them in place) */
BPF_F_TABLE("array", int, struct hs_global, globals, HS_TARGETS, BPF_F_MMAPABLE);
/* control: slot * HS_CTL_COUNT + enum hs_control -> u64, written by user space (kept apart so its writes never
 * race counters) */
BPF_F_TABLE("array", int, u64, control, HS_TARGETS * HS_CTL_COUNT, BPF_F_MMAPABLE);
/* events: enum hs_event, to wake user space at once */
BPF_PERF_OUTPUT(events);
BPF_ARRAY_OF_MAPS(events_of, "events", HS_TARGETS);
/* sites: site id -> struct hs_site (the counters of one allocation stack). An array, so the return and free
 * paths reach a block's site without hashing; mmapable, so user space reads every site's counters in place,
 * with no syscall and no copy, at each snapshot. */
BPF_F_TABLE("array", int, struct hs_site, sites, HS_MAX_STACKS, BPF_F_MMAPABLE);
BPF_ARRAY_OF_MAPS(sites_of, "sites", HS_TARGETS);

/* The slot of a uprobe's target: its link's cookie (0 through a perf event, whose program serves one target). */
static __always_inline u32 uprobe_slot(struct pt_regs *ctx)
{
    u64 cookie = bpf_get_attach_cookie(ctx);
    return cookie < HS_TARGETS ? (u32)cookie : 0;
}

/* The slot of the current process, for a tracepoint; -1 when it is no target. */
static __always_inline s64 process_slot(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *slot = targets.lookup(&tgid);
    return slot && *slot < HS_TARGETS ? *slot : -1;
}

static __always_inline struct hs_global *get_globals(u32 slot)
{
    return globals.lookup(&slot);
}

/* The program of a uprobe: its target's counters. */
static __always_inline struct hs_global *uprobe_globals(struct pt_regs *ctx)
{
    return get_globals(uprobe_slot(ctx));
}

/* Operations on a per-target map, given its target's map (NAME_of.lookup(&g->slot)); a missing map (the target
 * is being removed) reads as empty and refuses writes. */
static __always_inline void *t_lookup(void *map, void *key)
{
    return map ? bpf_map_lookup_elem(map, key) : 0;
}

static __always_inline long t_update(void *map, void *key, void *value, u64 flags)
{
    return map ? bpf_map_update_elem(map, key, value, flags) : -1;
}

static __always_inline long t_delete(void *map, void *key)
{
    return map ? bpf_map_delete_elem(map, key) : -1;
}

static __always_inline void *t_reserve(void *map, u64 size)
{
    return map ? bpf_ringbuf_reserve(map, size, 0) : 0;
}

/* Tell the target's user space (its perf buffer) of an event. */
static __always_inline void send_event(void *ctx, struct hs_global *g, u64 event)
{
    void *map = events_of.lookup(&g->slot);
    if (map)
        bpf_perf_event_output(ctx, map, BPF_F_CURRENT_CPU, &event, sizeof(event));
}

static __always_inline u64 *control_ptr(struct hs_global *g, u32 idx)
{
    u32 at = g->slot * HS_CTL_COUNT + idx;
    return control.lookup(&at);
}

static __always_inline u64 control_word(struct hs_global *g, u32 idx)
{
    u64 *w = control_ptr(g, idx);
    return w ? *w : 0;
}

static __always_inline void set_control(struct hs_global *g, u32 idx, u64 value)
{
    u64 *w = control_ptr(g, idx);
    if (w)
        *w = value;
}

static __always_inline int is_armed(struct hs_global *g)
{
    return control_word(g, HS_CTL_ARMED) != 0;
}

/* Program order for the per-CPU caches' sequence numbers: only a program preempting this one on the same
 * CPU can interleave with it, so the compiler's order is the order that counts. */
#define hs_barrier() asm volatile("" ::: "memory")
#define HS_ONCE(x) (*(volatile typeof(x) *)&(x)) /* one load or store, in program order */

static __always_inline struct hs_site *get_site(u64 id, struct hs_global *g)
{
    u32 slot = id;
    struct hs_site *s = t_lookup(sites_of.lookup(&g->slot), &slot);
    if (!s)
        __sync_fetch_and_add(&g->dropped_sites, 1);
    return s;
}

static __always_inline void count_in(u64 *slot, u64 n)
{
    if (slot)
        __sync_fetch_and_add(slot, n);
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
