"""RowSpace (agent/kernel/rowspace.py): the shared unwind rows, placed once per object, kept idle once no target
uses them, and their space reused when a new object needs it."""

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
    assert space.objects == {} and list(space.idle) == ["libc"] and space.used == 0


def test_an_idle_object_is_found_again_without_writing_its_rows() -> None:
    """The next target of the same program (a recycled worker, a backend a connection) finds the rows where the
    last one left them: not new, nothing to write."""
    space = RowSpace(100)
    assert space.acquire("prog", 40) is not None
    space.release("prog")
    got = space.acquire("prog", 40)
    assert got is not None and not got[1] and (got[0].first, got[0].users) == (0, 1)
    assert space.idle == {} and space.free_extents() == [(40, 60)]


def test_freed_extents_merge_and_are_reused_first_fit() -> None:
    """Idle objects keep their rows until a new object finds no free extent: then the least recently idle give
    theirs back, merged with their neighbours, one after another until it fits (or none is left)."""
    space = RowSpace(100)
    for key, n in (("a", 10), ("b", 20), ("c", 30)):
        assert space.acquire(key, n) is not None
    assert space.acquire("d", 41) is None  # 40 rows left, nothing idle
    space.release("b")
    space.release("a")
    assert space.free_extents() == [(60, 40)] and list(space.idle) == ["b", "a"]
    assert space.acquire("d", 41) is None  # b's and a's rows given back, still no extent of 41
    assert space.idle == {} and space.free_extents() == [(0, 30), (60, 40)]
    got = space.acquire("e", 25)
    assert got is not None and got[1] and got[0].first == 0
    space.release("c")
    got = space.acquire("f", 50)  # c's rows go back: 25-100 in one extent
    assert got is not None and got[0].first == 25 and space.free_extents() == [(75, 25)]
