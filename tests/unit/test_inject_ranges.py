"""The pure parts of the injection's safe-point check: which symbols count as allocator or loader code, and
the range lookup a stack scan does for every word."""

from __future__ import annotations

from agent.process.inject import _inside, _is_unsafe_name, _merge


def test_allocator_loader_and_fork_names_are_unsafe() -> None:
    for name in ("malloc", "free@@GLIBC_2.2.5", "_int_malloc", "sysmalloc", "malloc_consolidate", "tcache_init",
                 "arena_get2", "_dl_open", "_dl_catch_exception", "dlopen@GLIBC_2.2.5", "dl_iterate_phdr",
                 "__restore_rt", "_Znwm", "_ZdlPvm", "fork", "__libc_fork", "pthread_create@@GLIBC_2.34"):
        assert _is_unsafe_name(name), name


def test_blocking_calls_and_thread_start_are_safe() -> None:
    # A thread blocked in these is the usual safe point; start_thread is on every thread's stack.
    for name in ("read", "__libc_read", "nanosleep", "__GI___nanosleep", "epoll_wait", "__futex_abstimed_wait_common",
                 "start_thread", "clone3", "__libc_start_call_main", "main", "memcpy"):
        assert not _is_unsafe_name(name), name


def test_ranges_merge_and_lookup() -> None:
    ranges = _merge([(100, 200), (150, 180), (300, 400), (400, 410), (50, 60)])
    assert ranges == [(50, 60), (100, 200), (300, 410)]
    # An address inside a long range is found even when a shorter alias starts after the long one.
    assert _inside(ranges, 190)
    assert _inside(ranges, 300) and _inside(ranges, 409)
    assert not _inside(ranges, 200) and not _inside(ranges, 49) and not _inside(ranges, 410)
    assert not _inside([], 5)
