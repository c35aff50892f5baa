"""RowSpace (agent/kernel/rowspace.py): the shared unwind rows, placed once per object and reused when freed."""

from __future__ import annotations

from agent.kernel.rowspace import RowSpace


def test_an_object_is_placed_once_and_counted_by_its_users() -> None:
    space = RowSpace(100)
    got = space.acquire("libc", 30)
    assert got is not None and got[1] and (got[0].first, got[0].count) == (0, 30)
    again = space.acquire("libc", 30)
    assert again is not None and not again[1] and again[0].users == 2
    space.release("libc")
    assert "libc" in space.objects and space.used == 30
    space.release("libc")
    assert space.objects == {} and space.free_extents() == [(0, 100)]


def test_freed_extents_merge_and_are_reused_first_fit() -> None:
    space = RowSpace(100)
    for key, n in (("a", 10), ("b", 20), ("c", 30)):
        assert space.acquire(key, n) is not None
    assert space.acquire("d", 41) is None  # 40 rows left
    space.release("b")
    assert space.free_extents() == [(10, 20), (60, 40)]
    space.release("a")
    assert space.free_extents() == [(0, 30), (60, 40)]
    got = space.acquire("e", 25)
    assert got is not None and got[0].first == 0
    space.release("c")
    assert space.free_extents() == [(25, 75)]
    space.release("e")
    assert space.free_extents() == [(0, 100)]
