/* common.h: what every part of heap.bpf.c shares: the counters (globals), the control words user space writes,
 * the event channel that wakes user space, the sites' counters, and the small helpers around them. */

/* globals: 0 -> struct hs_global */
BPF_ARRAY(globals, struct hs_global, 1);
/* control: enum hs_control -> u64, written by user space (kept apart so its writes never race counters) */
BPF_ARRAY(control, u64, HS_CTL_COUNT);
/* events: enum hs_event, to wake user space at once */
BPF_PERF_OUTPUT(events);
/* sites: site id -> struct hs_site (the counters of one allocation stack). An array, so the return and free
 * paths reach a block's site without hashing; mmapable, so user space reads every site's counters in place,
 * with no syscall and no copy, at each snapshot. */
BPF_F_TABLE("array", int, struct hs_site, sites, HS_MAX_STACKS, BPF_F_MMAPABLE);

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

/* Program order for the per-CPU caches' sequence numbers: only a program preempting this one on the same
 * CPU can interleave with it, so the compiler's order is the order that counts. */
#define hs_barrier() asm volatile("" ::: "memory")
#define HS_ONCE(x) (*(volatile typeof(x) *)&(x)) /* one load or store, in program order */

static __always_inline u64 control_word(u32 idx)
{
    u64 *w = control.lookup(&idx);
    return w ? *w : 0;
}

static __always_inline struct hs_site *get_site(u64 id, struct hs_global *g)
{
    u32 slot = id;
    struct hs_site *s = sites.lookup(&slot);
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
