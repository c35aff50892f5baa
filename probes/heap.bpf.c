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
 *
 * The program is this file and its parts in probes/bpf/, one concern each, included below in the order they build
 * on one another; thread_stacks.h, pages.h and sampled.h only in the modes that use them (HS_STACKS, HS_PAGES,
 * HS_SAMPLED, -D defines from agent/kernel/probes.py). bcc rewrites table calls (`table.lookup(&key)`) and takes
 * programs only in the main source it compiles, not in a file that source includes: agent/kernel/loader.py
 * (program_text) writes each part into the text it hands bcc, so the parts are one source with this file; heap.h,
 * types and sizes only, stays a true include. This file holds the allocation functions' probes (entry, free,
 * return) and the target's events (exec, loader changes, exit).
 */
#include <uapi/linux/ptrace.h>
#include "heap.h"

#include "bpf/common.h"
#include "bpf/unwind.h"
#if HS_STACKS
#include "bpf/thread_stacks.h"
#endif
#include "bpf/schedule.h"
#include "bpf/malt.h"
#include "bpf/blocks.h"
#include "bpf/accounting.h"

/* walk_arg: the argument a tail-called walker gets (alloc_walker, page_walker): per CPU, since a tail call runs on
 * its caller's CPU, in the same program run. */
BPF_PERCPU_ARRAY(walk_arg, struct hs_page_call, 1);

/* Whether walk_arg holds this thread's argument. On a preemptible kernel another thread's program can run
 * on this CPU between a tail call's caller and callee (uprobe programs run with migration, not preemption,
 * disabled); then the argument is not ours, and that is counted. */
static __always_inline int walk_arg_is_ours(struct hs_page_call *arg)
{
    if (arg->tid == (u32)bpf_get_current_pid_tgid())
        return 1;
    struct hs_global *g = get_globals(arg->slot);
    if (g)
        __sync_fetch_and_add(&g->walks_interrupted, 1);
    return 0;
}

/* Exact mode's probes of the allocation functions; sampled mode attaches none of them (the injected sampler calls
 * its own probes: bpf/sampled.h). */
#if !HS_SAMPLED

/* slots: tid mod HS_PENDING_SLOTS -> struct hs_pending (the thread's call between entry and return).
 * An array: its lookups are inlined and take no lock, unlike a hash map's. */
BPF_ARRAY(slots, struct hs_pending, HS_PENDING_SLOTS);
/* pending: thread id -> struct hs_pending, for a thread whose slot another thread holds */
BPF_F_TABLE("hash", u32, struct hs_pending, pending, HS_MAX_PENDING, BPF_F_NO_PREALLOC);

/* alloc_walker: 0 -> alloc_enter, the entry program of the allocation functions other than malloc, tail-called
 * by theirs. Each inlined copy of the stack walk costs ~0.45 s of verification at load: malloc keeps its own
 * (no tail call on the hottest path), the others share one; walk_arg hands it its argument. */
BPF_PROG_ARRAY(alloc_walker, 1);

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
static __always_inline void wait_for_flags(void *ctx, struct hs_global *g)
{
    set_control(g, HS_CTL_STOPPED, HS_EV_SITES);
    bpf_send_signal(19 /* SIGSTOP */);
    send_event(ctx, g, HS_EV_SITES);
}

static __always_inline int on_enter(struct pt_regs *ctx, struct hs_global *g, u32 fn)
{
    if (!g || !is_armed(g))
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
#if HS_STACKS
    note_stack(g, tid, sp, 0);
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
    /* With --ignore-fn the site's flag is read after the walk: its id through memory (capture_site) keeps the
     * verifier from walking that read once per way the walk can end. */
    call.stack = HS_IGNORE ? capture_site(ctx, g, fn) : capture_stack(ctx, g, fn);
    u32 zero = 0;
    struct hs_stack *walked = scratch.lookup(&zero);
    if (walked)
        call.ret0 = walked->ip[0]; /* [rsp], read by the walk */
    if (HS_MALT)
        call.entry_ns = bpf_ktime_get_ns();
    store_pending(tid, &call, g);
    if (HS_IGNORE && HS_STOP_EVENTS && site_flag(g, call.stack) == HS_SITE_UNKNOWN)
        wait_for_flags(ctx, g);
    return 0;
}

int malloc_enter(struct pt_regs *ctx) { return on_enter(ctx, uprobe_globals(ctx), HS_MALLOC); }

/* The shared entry program (alloc_walker): the function is in walk_arg. An argument that is not ours leaves
 * the call unseen, counted (dropped_pending): its kind is unknown. */
int alloc_enter(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (!arg)
        return 0;
    if (walk_arg_is_ours(arg))
        return on_enter(ctx, get_globals(arg->slot), arg->kind);
    struct hs_global *g = get_globals(arg->slot);
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
    u32 slot = uprobe_slot(ctx);
    arg->tid = (u32)bpf_get_current_pid_tgid();
    arg->kind = fn;
    arg->slot = slot;
    alloc_walker.call(ctx, 0);
    /* Only without the walker, which user space installs before it attaches any probe: the call is unseen. */
    struct hs_global *g = get_globals(slot);
    if (g && is_armed(g))
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
    struct hs_global *g = uprobe_globals(ctx);
    if (!g || !is_armed(g))
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    if (!addr)
        return 0;
    block_prefetch(g, addr);
    u32 tid = bpf_get_current_pid_tgid();
    struct hs_pending *p = find_pending(tid, g);
    u64 sp = PT_REGS_SP(ctx), ret0 = 0;
#if HS_STACKS
    note_stack(g, tid, sp, 0);
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
        thread_stat(g, tid, HS_FREE, 1, size, 0);
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
    struct hs_global *g = uprobe_globals(ctx);
    if (!g)
        return 0;
    block_prefetch(g, PT_REGS_RC(ctx));
    u32 tid = bpf_get_current_pid_tgid();
    struct hs_pending *p = find_pending(tid, g);
    if (!p) {
        if (is_armed(g))
            __sync_fetch_and_add(&g->lost_returns, 1);
        return 0;
    }
    if (p->nested) {
        p->nested--;
        return 0;
    }
    struct hs_pending call = *p;
    release_pending(tid, p, g);
    if (!is_armed(g))
        return 0;

    u64 ret = PT_REGS_RC(ctx);
    u64 size = request_size(&call);
    u64 now = HS_MALT ? bpf_ktime_get_ns() : 0;
    if (HS_MALT)
        thread_stat(g, tid, call.fn, 1, size, now - call.entry_ns);
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

#endif /* !HS_SAMPLED */

/* ---- events: exec, loader changes and exit -------------------------------------------------------- */

/* Tell user space; with HS_STOP_EVENTS also stop the target until user space has caught up (it clears
 * control[HS_CTL_STOPPED] and sends SIGCONT). */
static __always_inline void signal_event(void *ctx, struct hs_global *g, u64 event)
{
    if (HS_STOP_EVENTS) {
        set_control(g, HS_CTL_STOPPED, event);
        bpf_send_signal(19 /* SIGSTOP */);
    }
    send_event(ctx, g, event);
}

/* The target's exec: `run` arms at the first one; any later one (or any, for `attach`) disarms. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    s64 slot = process_slot();
    struct hs_global *g = slot >= 0 ? get_globals(slot) : 0;
    if (!g)
        return 0;
    u64 n = __sync_fetch_and_add(&g->execs, 1) + 1;
    u64 armed = (n == HS_ARM_ON_EXEC);
    set_control(g, HS_CTL_ARMED, armed);
    if (armed) {
#if HS_STACKS
        /* The new image's initial stack pointer: the main stack is measured from here. */
        struct hs_user_regs u = user_regs();
        note_stack(g, (u32)bpf_get_current_pid_tgid(), u.sp, 1);
#endif
        signal_event(args, g, HS_EV_EXEC);
    }
    return 0;
}

/* _dl_debug_state: the loader's hook for debuggers, called after it maps or unmaps objects. */
int loader_enter(struct pt_regs *ctx)
{
    struct hs_global *g = uprobe_globals(ctx);
    if (!g || !is_armed(g))
        return 0;
    signal_event(ctx, g, HS_EV_LOADER);
    return 0;
}

int exit_enter(struct pt_regs *ctx)
{
    struct hs_global *g = uprobe_globals(ctx);
    if (!g || !is_armed(g))
        return 0;
    signal_event(ctx, g, HS_EV_EXIT);
    return 0;
}

#if HS_PAGES
#include "bpf/pages.h"
#endif

#if HS_SAMPLED
#include "bpf/sampled.h"
#endif
