/* pages.h: page-level memory (HS_PAGES): mmap, munmap, mremap and brk, one event per completed call, charged to
 * the user stack that made it.
 * Sampled mode compiles this only with --page-calls=yes (ProfileSettings.traces_page_calls): a syscall tracepoint
 * sends every system call of every process through the kernel's slower path. It then sends an event only for the
 * calls it samples, by length as the sampler samples allocations (a call of L bytes with probability
 * min(1, L / HS_SAMPLE_RATE): MALT's mmap and munmap statistics, estimated), and folds every call into the
 * process's mapped total as the kernel keeps it (mm->total_vm, read at each call's exit: the last value and the
 * highest since user space looked). A server like apache2 moves its break and maps and unmaps a block at every
 * request, tens of thousands of calls a second: a stack walk and an event each, and user space applying them to
 * a page map, cost it a fifth of its throughput. */

/* page_calls: thread id -> the page syscall it is in (arguments and site), from entry to exit */
BPF_F_TABLE("hash", u32, struct hs_page_call, page_calls, HS_MAX_THREADS, BPF_F_NO_PREALLOC);
/* page_events: struct hs_page_event, one per completed page syscall, in the order they completed */
BPF_RINGBUF_OUTPUT(page_events, HS_PAGE_RING_PAGES);
BPF_ARRAY_OF_MAPS(page_events_of, "page_events", HS_TARGETS);
/* page_counters: enum hs_page_counter -> count */
BPF_F_TABLE("array", int, u64, page_counters, HS_PGC_COUNT, BPF_F_MMAPABLE);
BPF_ARRAY_OF_MAPS(page_counters_of, "page_counters", HS_TARGETS);
/* page_walker: 0 -> page_enter_walk, the one copy of the stack walk of the four entry tracepoints (a
 * program array holds programs of one type, so not alloc_walker) */
BPF_PROG_ARRAY(page_walker, 1);

static __always_inline void page_count(struct hs_global *g, u32 which)
{
    count_in(t_lookup(page_counters_of.lookup(&g->slot), &which), 1);
}

#if HS_SAMPLED
/* Rates run to 2^40 bytes: shifted by this, the rate and a length below it fit 32 bits. */
#define HS_RATE_SHIFT (HS_SAMPLE_RATE > 0xffffffffULL ? 8 : 0)

/* Sampled mode: whether a page call of `length` bytes is sampled (probability min(1, length / HS_SAMPLE_RATE)). */
static __always_inline int page_call_sampled(u64 length)
{
    if (length >= HS_SAMPLE_RATE)
        return 1;
    return bpf_get_prandom_u32() < ((length >> HS_RATE_SHIFT) << 32) / (HS_SAMPLE_RATE >> HS_RATE_SHIFT);
}

/* Sampled mode, at every page call's exit: the process's mapped bytes into two control words, the last and the
 * highest since user space looked (agent/kernel/probes.py mapped_fold). Two threads' exits may land in the other
 * order than their calls: the next call sets the last value right. True for brk, which is then done. */
static __always_inline int fold_mapped(u32 kind, long ret)
{
    s64 slot = process_slot();
    if (slot < 0)
        return kind == HS_PG_BRK;
    struct hs_global *g = get_globals(slot);
    if (!g || !is_armed(g))
        return kind == HS_PG_BRK;
    u64 mm = 0, pages = 0;
    bpf_probe_read_kernel(&mm, sizeof(mm), (void *)(bpf_get_current_task() + HS_TASK_MM));
    if (mm && !bpf_probe_read_kernel(&pages, sizeof(pages), (void *)(mm + HS_MM_TOTAL_VM))) {
        u64 bytes = pages * 4096;
        set_control(g, HS_CTL_MAPPED_NOW, bytes);
        if (bytes > control_word(g, HS_CTL_MAPPED_HIGH))
            set_control(g, HS_CTL_MAPPED_HIGH, bytes);
    }
    if (kind != HS_PG_BRK)
        return 0;
    if (ret > 0)
        page_count(g, HS_PGC_BRK_FOLDED);
    return 1;
}
#endif

/* At a page syscall's entry: keep its arguments and charge it to the user stack that made it. The walk
 * starts at the user's instruction pointer (just past the syscall instruction, in the libc wrapper). */
static __always_inline int page_enter(void *ctx, u32 kind, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4)
{
    s64 slot = process_slot();
    if (slot < 0)
        return 0;
    struct hs_global *g = get_globals(slot);
    if (!g || !is_armed(g))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct hs_user_regs u = user_regs();
    u32 tid = id;
#if HS_STACKS
    note_stack(g, tid, u.sp, 0);
#endif
#if HS_SAMPLED
    if (kind == HS_PG_BRK)
        return 0; /* folded at its exit: no site, no call kept */
    if (!page_call_sampled(kind == HS_PG_MREMAP && a2 > a1 ? a2 : a1)) {
        /* Folded at its exit. What can bring new code is counted here: its exit is not followed. */
        if ((kind == HS_PG_MMAP && (a2 & 4 /* PROT_EXEC */)) || kind == HS_PG_MREMAP)
            page_count(g, HS_PGC_CODE_MAPS);
        page_count(g, HS_PGC_UNSAMPLED);
        return 0;
    }
#endif
    struct hs_page_call call = {.tid = tid, .arg0 = a0, .arg1 = a1, .arg2 = a2, .arg3 = a3, .arg4 = a4, .kind = kind,
                                .slot = slot};
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (arg) {
        *arg = call;
        page_walker.call(ctx, 0);
    }
    /* Only without the walker (installed before the probes are armed): the call, charged to no stack. */
    call.site = HS_STACK_OVERFLOW;
    if (page_calls.update(&tid, &call))
        page_count(g, HS_PGC_CALLS_FULL);
    return 0;
}

/* page_walker's program: the stack of the page syscall in walk_arg, and the call kept until its exit (an
 * argument that is not ours leaves the call out: its exit counts it unpaired). */
int page_enter_walk(void *ctx)
{
    u32 zero = 0;
    struct hs_page_call *arg = walk_arg.lookup(&zero);
    if (!arg || !walk_arg_is_ours(arg))
        return 0;
    struct hs_global *g = get_globals(arg->slot);
    if (!g)
        return 0;
    struct hs_page_call call = *arg;
    struct hs_user_regs u = user_regs();
    u32 tid = bpf_get_current_pid_tgid();
    call.site = capture_stack_at(0, u.ip, u.sp, u.bp, g, HS_FN_PAGES);
    if (page_calls.update(&tid, &call))
        page_count(g, HS_PGC_CALLS_FULL);
    return 0;
}

/* At its exit: one event with the arguments and the result, for agent/model/pages.py to apply in order. */
static __always_inline int page_exit(void *ctx, u32 kind, long ret)
{
#if HS_SAMPLED
    if (fold_mapped(kind, ret))
        return 0;
#endif
    /* The thread's call first: one its target's detach left (it was in the syscall then) goes too. */
    u32 tid = bpf_get_current_pid_tgid();
    struct hs_page_call *c = page_calls.lookup(&tid);
    struct hs_page_call call = {};
    if (c) {
        call = *c;
        page_calls.delete(&tid);
    }
    s64 slot = process_slot();
    if (slot < 0)
        return 0;
    struct hs_global *g = get_globals(slot);
    if (!g)
        return 0;
    if (!c) {
        if (!HS_SAMPLED && is_armed(g)) /* sampled mode keeps only the calls it sampled */
            page_count(g, HS_PGC_UNPAIRED);
        return 0;
    }
    if (call.kind != kind || call.slot != slot) { /* cannot happen: a thread is in one syscall at a time */
        page_count(g, HS_PGC_UNPAIRED);
        return 0;
    }
    if (ret >= 0 && ((kind == HS_PG_MMAP && (call.arg2 & 4 /* PROT_EXEC */)) || kind == HS_PG_MREMAP))
        page_count(g, HS_PGC_CODE_MAPS);
    void *ring = page_events_of.lookup(&g->slot);
    struct hs_page_event *e = t_reserve(ring, sizeof(struct hs_page_event));
    if (!e) {
        page_count(g, HS_PGC_LOST);
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
    bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    page_count(g, HS_PGC_EVENTS);
    /* But the event that fills the ring to a quarter (and to half and three quarters, should that wake-up be
     * missed or come late) wakes user space once: a daemon looking at a quiet target once a second drains a burst
     * before the ring overflows, so the ring can stay small. A quarter leaves three quarters of the ring to a
     * burst while the daemon wakes: on a loaded machine half (35 ms of a burst at 80,000 calls a second into
     * sampled mode's ring) was not always enough. Its fill is the events sent less those user space took. */
    u32 sent_idx = HS_PGC_EVENTS;
    u64 *sent = t_lookup(page_counters_of.lookup(&g->slot), &sent_idx);
    if (sent) {
        u64 held = HS_ONCE(*sent) - control_word(g, HS_CTL_PAGES_DRAINED);
        u64 room = (u64)HS_PAGE_RING_PAGES * 4096 / ((sizeof(struct hs_page_event) + 8 + 7) & ~7ULL);
        if (held == room / 4 || held == room / 2 || held == room / 2 + room / 4)
            send_event(ctx, g, HS_EV_PAGES);
        /* `run`: from three quarters full on, the target waits until user space has drained the ring, so no
         * call is lost however fast it makes them (sampled mode never stops a target). */
        if (HS_STOP_EVENTS && !HS_SAMPLED && held >= room / 2 + room / 4) {
            set_control(g, HS_CTL_STOPPED, HS_EV_PAGES);
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
#if !HS_SAMPLED || HS_STACKS
/* Sampled mode folds brk at its exit alone: its entry is followed only for --stacks=yes's note of the thread's
 * stack. Left out, every brk on the machine (apache2's workers make two a request) skips a program run. */
TRACEPOINT_PROBE(syscalls, sys_enter_brk) { return page_enter(args, HS_PG_BRK, args->brk, 0, 0, 0, 0); }
#endif
TRACEPOINT_PROBE(syscalls, sys_exit_brk) { return page_exit(args, HS_PG_BRK, args->ret); }
