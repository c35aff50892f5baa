/* Sampled mode: compiled after heap.bpf.c, in the same translation unit, when ProbeSettings.sampled is set
 * (agent/kernel/probes.py; bcc takes programs only from its main source, so it is appended, not included).
 *
 * The in-process sampler (probes/sampler/hs_sampler.c) calls hs_sample_alloc(ptr, size, weight) for each
 * sampled allocation and hs_sample_free(ptr) when a sampled block is freed; unsampled calls never reach the
 * kernel. Both functions start with a 5-byte nop, so Linux 6.18 runs these probes through its uprobe
 * trampoline instead of a trap. No return probe is needed: the block's address is an argument.
 *
 * A sampled block is recorded at its weight, the bytes it stands for (s / (1 - e^(-s/T)), exactly s at or
 * above the rate T), so every sum the kernel keeps (sites, the peak, the timeline) is an estimate by
 * construction. Its free subtracts the same weight, since the block table keeps what was recorded.
 * The stack starts inside the sampler (hs_account_slow, then an hs_hook_* function); user space is to trim
 * those frames as it trims allocation functions (not done yet: the session does not know sampled mode).
 */

int sample_alloc_enter(struct pt_regs *ctx)
{
    struct hs_global *g = get_globals();
    if (!g || !is_armed())
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    u64 weight = PT_REGS_PARM3(ctx);
    if (!addr || !weight)
        return 0;
    block_prefetch(addr);
#if HS_STACKS
    note_stack((u32)bpf_get_current_pid_tgid(), PT_REGS_SP(ctx), 0);
#endif
    u64 stack = capture_stack(ctx, g, HS_MALLOC);
    record_alloc(ctx, g, addr, weight, HS_ALIGNMENT, stack, HS_MALT ? bpf_ktime_get_ns() : 0);
    return 0;
}

int sample_free_enter(struct pt_regs *ctx)
{
    struct hs_global *g = get_globals();
    if (!g || !is_armed())
        return 0;
    u64 addr = PT_REGS_PARM1(ctx);
    if (!addr)
        return 0;
    block_prefetch(addr);
    u64 free_site = (HS_FREE_STACKS || HS_MALT) ? capture_stack(ctx, g, HS_FREE) : 0;
    record_free(ctx, g, addr, free_site, HS_MALT ? bpf_ktime_get_ns() : 0);
    return 0;
}
