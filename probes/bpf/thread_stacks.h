/* thread_stacks.h: each thread's stack extent (HS_STACKS, --stacks=yes): the probes' stack pointers widen it,
 * a thread's start (exec, clone) sets its top, its exit drops it. */

/* thread_stacks: thread id -> struct hs_thread_stack (--stacks=yes) */
BPF_F_TABLE("hash", u32, struct hs_thread_stack, thread_stacks, HS_MAX_THREADS, BPF_F_NO_PREALLOC);

/* A probe hit on a thread: its stack pointer extends the thread's stack extent. `top` marks a thread's
 * initial stack pointer (exec, clone): the stack is measured from there (Massif: the main stack starts at 0). */
static __always_inline void note_stack(u32 tid, u64 sp, int top)
{
    u32 idx = HS_CTL_STACK_EPOCH;
    u64 *epoch_word = control.lookup(&idx);
    u64 epoch = epoch_word ? *epoch_word : 0;
    struct hs_thread_stack *t = thread_stacks.lookup(&tid);
    if (!t) {
        struct hs_thread_stack fresh = {.top = sp, .low = sp, .last = sp, .epoch = epoch};
        thread_stacks.update(&tid, &fresh);
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
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID || ret != 0 || !is_armed())
        return 0;
    struct hs_user_regs u = user_regs();
    note_stack((u32)id, u.sp, 1);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_clone) { return clone_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_clone3) { return clone_exit(args->ret); }

/* A thread that ends takes its stack with it. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != HS_TARGET_TGID)
        return 0;
    u32 tid = id;
    thread_stacks.delete(&tid);
    return 0;
}
