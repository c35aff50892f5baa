/* procevents.bpf.c: the processes that appear, fork and exit, for the daemon's selectors (compiled by bcc at
 * run time; agent/kernel/procevents.py reads it).
 *
 * Three tracepoints, no kprobe:
 * - sched:sched_process_exec, every exec on the machine: a new program may match a selector;
 * - task:task_newtask, a new process (not a thread: CLONE_THREAD is dropped here, which sched_process_fork's
 *   arguments cannot tell), only when its parent is watched: the children of a profiled process;
 * - sched:sched_process_exit, the exit of a watched process's main thread.
 * One 32-byte record each, through a ring buffer; records it has no room for are counted in `lost`, and user
 * space then scans /proc, so nothing is missed for long.
 */
#include <uapi/linux/ptrace.h>

#define PE_EXEC 1
#define PE_FORK 2
#define PE_EXIT 3
#define PE_CLONE_THREAD 0x00010000ULL

struct pe_event {
    u32 kind;
    u32 pid;     /* the process (thread group) */
    u32 parent;  /* PE_FORK: the watched parent */
    u32 pad;
    char comm[16];  /* PE_EXEC: the new program's name */
};

BPF_RINGBUF_OUTPUT(proc_events, PE_RING_PAGES);
/* watched: thread group id -> 1, the processes profiled now (user space keeps it) */
BPF_HASH(watched, u32, u8, PE_MAX_WATCHED);
/* lost: records the ring buffer had no room for */
BPF_ARRAY(lost, u64, 1);

static __always_inline void pe_send(u32 kind, u32 pid, u32 parent)
{
    struct pe_event *e = proc_events.ringbuf_reserve(sizeof(struct pe_event));
    if (!e) {
        u32 zero = 0;
        u64 *n = lost.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
        return;
    }
    e->kind = kind;
    e->pid = pid;
    e->parent = parent;
    e->pad = 0;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    proc_events.ringbuf_submit(e, 0);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    pe_send(PE_EXEC, bpf_get_current_pid_tgid() >> 32, 0);
    return 0;
}

TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & PE_CLONE_THREAD)
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!watched.lookup(&parent))
        return 0;
    pe_send(PE_FORK, args->pid, parent);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid)
        return 0;
    if (!watched.lookup(&tgid))
        return 0;
    pe_send(PE_EXIT, tgid, 0);
    return 0;
}
