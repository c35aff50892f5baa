"""Kernel calls that wait for an RCU grace period doing nothing (an update of a map of maps, the close of a uprobe
link or perf event), made side by side: the waits of calls made at once end together. The threads that make them
are kept for the process's life: a pool started for each attach and detach cost some 3 ms of CPU a use in thread
starts and exits (a tenth of a busy target's attach/check/detach cycle)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# More than the calls of one attach or detach (a map of maps per per-target map, a link per probe): two targets'
# at once still overlap.
WAITERS = 32

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def side_by_side(call: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """call(item) for every item, each on a thread of its own (ctypes and os.close let go of the GIL in the call),
    the results in the items' order."""
    global _pool
    if len(items) <= 1:
        return [call(item) for item in items]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="bpf-wait")
        pool = _pool
    return list(pool.map(call, items))
