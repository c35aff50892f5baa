"""The sampler's exact call counts per thread (agent.model.callcounts) and how MALT's per-thread statistics take
them in sampled mode (agent.session.maltrec)."""

from __future__ import annotations

import random

from agent.model.callcounts import COUNTED_KINDS, ThreadCalls, merge_by_thread, total
from agent.model.functions import malt_name_of_kind
from agent.model.malt import MALT_FUNCTIONS, MaltThread, ThreadFunctionStats
from agent.process.sampler import COUNT_FIELDS, COUNTS, calls_total_of, thread_calls_of
from agent.session.maltrec import _exact_thread_counts


def test_malloc_and_free_are_what_the_other_counts_leave() -> None:
    # 10 allocations: 2 callocs, 3 reallocs, 1 memalign, the other 4 mallocs; 7 frees, 2 of them the old
    # blocks of reallocs.
    c = ThreadCalls(5, allocs=10, frees=7, alloc_bytes=999, calloc=2, realloc=3, memalign=1, realloc_frees=2)
    assert c.by_kind() == {"malloc": 4, "calloc": 2, "realloc": 3, "memalign": 1, "free": 5}
    # A count read between a hook's two adds cannot make a function's calls negative.
    assert ThreadCalls(1, allocs=0, calloc=1).by_kind() == {"calloc": 1}


def test_the_counted_kinds_are_the_mirrors_fields_and_malt_functions() -> None:
    assert set(COUNTED_KINDS) <= set(COUNT_FIELDS)
    assert set(COUNT_FIELDS) == {f for f in ThreadCalls.__dataclass_fields__}
    assert {malt_name_of_kind(k) for k in (*COUNTED_KINDS, "malloc", "free")} <= set(MALT_FUNCTIONS)


def test_slots_of_one_tid_add_up() -> None:
    a = ThreadCalls(7, allocs=3, frees=1, alloc_bytes=30)
    b = ThreadCalls(7, allocs=2, frees=2, alloc_bytes=20, calloc=1)
    c = ThreadCalls(8, allocs=1)
    merged = merge_by_thread([a, b, c])
    assert merged[7] == ThreadCalls(7, allocs=5, frees=3, alloc_bytes=50, calloc=1)
    assert merged[8] == c
    assert total([a, b, c]).allocs == 6
    assert total([a, b, c]) == ThreadCalls(0, allocs=6, frees=3, alloc_bytes=50, calloc=1)
    assert total([]) == ThreadCalls(0)


def test_a_count_table_read_as_the_sampler_keeps_it() -> None:
    """The raw table (struct hs_counts a slot, padded to 128 bytes): its slots one by one, and their sum taken in
    numpy, equal to the sum of the slots; a full table of 16,384 threads, as a thread-per-connection server
    leaves."""
    rng = random.Random(3)
    rows = [{name: rng.randrange(1 << 40) for name in COUNT_FIELDS} for _ in range(16384)]
    table = b"".join(COUNTS.pack(*(row[name] for name in COUNT_FIELDS)) for row in rows)
    slots = thread_calls_of(table)
    assert [s.tid for s in slots] == [row["tid"] for row in rows]
    assert slots[5] == ThreadCalls(**rows[5])
    summed = calls_total_of(table)
    assert summed == total(slots)
    assert summed.alloc_bytes == sum(row["alloc_bytes"] for row in rows)
    assert calls_total_of(b"") == ThreadCalls(0) and thread_calls_of(b"") == []


def test_malt_threads_take_the_exact_counts_and_keep_the_estimated_bytes() -> None:
    # Thread 5's samples were estimated at 40 mallocs and 3 callocs; it made 37 malloc and 2 calloc calls.
    # Thread 9 made calls but no sample: its entry comes from the counts alone.
    threads = {5: MaltThread(5, {"malloc": ThreadFunctionStats(40, 4000, 0), "calloc": ThreadFunctionStats(3, 90, 0)})}
    calls = [ThreadCalls(5, allocs=39, frees=30, calloc=2), ThreadCalls(9, allocs=4, frees=1)]
    _exact_thread_counts(threads, calls)
    t5 = threads[5].stats
    assert (t5["malloc"].count, t5["malloc"].sum) == (37, 4000)
    assert (t5["calloc"].count, t5["calloc"].sum) == (2, 90)
    assert t5["free"].count == 30
    assert threads[5].mem_ops == 69
    assert {k: v.count for k, v in threads[9].stats.items()} == {"malloc": 4, "free": 1}
