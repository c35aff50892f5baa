"""The pure parts of the injection's safe-point check: which symbols count as allocator or loader code, and
the range lookup the safe-point walk does for every return address."""

from __future__ import annotations

from agent.process.inject import REG, REG_NAMES, _is_unsafe_name, _resume_context
from agent.process.safepoint import UnsafeRanges


def test_allocator_loader_and_fork_names_are_unsafe() -> None:
    for name in ("malloc", "free@@GLIBC_2.2.5", "_int_malloc", "sysmalloc", "malloc_consolidate", "tcache_init",
                 "arena_get2", "_dl_open", "_dl_catch_exception", "dlopen@GLIBC_2.2.5", "dl_iterate_phdr",
                 "_Znwm", "_ZdlPvm", "fork", "__libc_fork", "pthread_create@@GLIBC_2.34"):
        assert _is_unsafe_name(name), name


def test_blocking_calls_and_thread_start_are_safe() -> None:
    # A thread blocked in these is the usual safe point; start_thread is on every thread's stack.
    for name in ("read", "__libc_read", "nanosleep", "__GI___nanosleep", "epoll_wait", "__futex_abstimed_wait_common",
                 "start_thread", "clone3", "__libc_start_call_main", "main", "memcpy"):
        assert not _is_unsafe_name(name), name


def test_ranges_merge_and_lookup() -> None:
    ranges = UnsafeRanges([(100, 200, "a"), (150, 180, "b"), (300, 400, "c"), (400, 410, "d"), (50, 60, "e")])
    assert ranges.ranges == [(50, 60, "e"), (100, 200, "a"), (300, 410, "c")]
    # An address inside a long range is found even when a shorter alias starts after the long one.
    assert ranges.name_at(190) == "a"
    assert ranges.name_at(300) == "c" and ranges.name_at(409) == "c"
    assert ranges.name_at(200) is None and ranges.name_at(49) is None and ranges.name_at(410) is None
    assert UnsafeRanges([]).name_at(5) is None


def _regs(**values: int) -> list[int]:
    regs = [0] * len(REG_NAMES)
    for name, value in values.items():
        regs[REG[name]] = value & 0xFFFFFFFFFFFFFFFF
    return regs


def test_interrupted_system_calls_are_set_to_run_again() -> None:
    """As the kernel does when no handler runs: ERESTARTSYS/NOINTR/NOHAND re-run the call itself,
    ERESTART_RESTARTBLOCK runs restart_syscall; anything else is left exactly as it was."""
    for code in (512, 513, 514):
        out = _resume_context(_regs(rax=-code, orig_rax=0, rip=0x1002))  # read() interrupted
        assert out[REG["rax"]] == 0 and out[REG["rip"]] == 0x1000
    out = _resume_context(_regs(rax=-516, orig_rax=35, rip=0x2002))  # nanosleep
    assert out[REG["rax"]] == 219 and out[REG["rip"]] == 0x2000
    for regs in (
        _regs(rax=-4, orig_rax=0, rip=0x3002),  # a real EINTR: the program's to see
        _regs(rax=-512, orig_rax=-1, rip=0x3002),  # not in a system call
        _regs(rax=12345, orig_rax=1, rip=0x3002),  # a finished call
    ):
        assert _resume_context(regs) == regs
