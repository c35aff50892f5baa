/* thread_stacks.h: each thread's stack extent (HS_STACKS, --stacks=yes): the probes' stack pointers widen it,
 * a thread's start (exec, clone) sets its top, its exit drops it. */

/* thread_stacks: thread id -> struct hs_thread_stack (--stacks=yes) */
BPF_F_TABLE("hash", u32, struct hs_thread_stack, thread_stacks, HS_MAX_THREADS, BPF_F_NO_PREALLOC);
BPF_ARRAY_OF_MAPS(thread_stacks_of, "thread_stacks", HS_TARGETS);

/* A probe hit on a thread: its stack pointer extends the thread's stack extent. `top` marks a thread's
 * initial stack pointer (exec, clone): the stack is measured from there (Massif: the main stack starts at 0). */
static __always_inline void note_stack(struct hs_global *g, u32 tid, u64 sp, int top)
{
    u64 epoch = control_word(g, HS_CTL_STACK_EPOCH);
    void *stacks = thread_stacks_of.lookup(&g->slot);
    struct hs_thread_stack *t = t_lookup(stacks, &tid);
    if (!t) {
        struct hs_thread_stack fresh = {.top = sp, .low = sp, .last = sp, .epoch = epoch};
        t_update(stacks, &tid, &fresh, BPF_ANY);
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

/* A new thread starts on the stack its creator gave clone: the child's first return to user space. */
static __always_inline int clone_exit(long ret)
{
    s64 slot = ret == 0 ? process_slot() : -1;
    struct hs_global *g = slot >= 0 ? get_globals(slot) : 0;
    if (!g || !is_armed(g))
        return 0;
    struct hs_user_regs u = user_regs();
    note_stack(g, (u32)bpf_get_current_pid_tgid(), u.sp, 1);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_clone) { return clone_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_clone3) { return clone_exit(args->ret); }

/* A thread that ends takes its stack with it. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    s64 slot = process_slot();
    struct hs_global *g = slot >= 0 ? get_globals(slot) : 0;
    if (!g)
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    t_delete(thread_stacks_of.lookup(&g->slot), &tid);
    return 0;
}
