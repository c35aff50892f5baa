"""agent.model.massif_file, the product's massif.out reader: what heapscope's writer wrote reads back to the
same snapshots and trees (checked against the tests' own strict reader), Valgrind's labels (C++ names with
parentheses, objects without debug info, the threshold aggregates) parse, and bad files are one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.errors import UsageError
from agent.model.massif_file import MassifFileError, parse_label, parse_massif
from agent.model.snapshot import SnapshotKind
from agent.model.stack import Frame
from agent.model.tree import Tree
from tests.support import massif_reader
from tests.support.massif_sample import sample_massif_out


def label_paths(tree: Tree) -> dict[tuple[str, ...], int]:
    """Bytes of every root-to-node path of labels without addresses (the root left out), as
    massif_reader.paths gives them."""
    out: dict[tuple[str, ...], int] = {}

    def visit(node, prefix: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
        for key, child in node.children.items():
            path = (*prefix, massif_reader.strip_address(key.rstrip("'")))
            out[path] = out.get(path, 0) + child.bytes
            visit(child, path)

    visit(tree, ())
    return out


def test_heapscope_files_read_back_to_the_same_snapshots_and_trees() -> None:
    text = sample_massif_out()
    mine = parse_massif(text)
    theirs = massif_reader.parse_massif(text)
    assert (mine.desc, mine.cmd, mine.time_unit) == ("--threshold=1.0", "./prog a b", "ms")
    assert len(mine.snapshots) == len(theirs.snapshots) == 4
    for m, t in zip(mine.snapshots, theirs.snapshots, strict=True):
        assert (m.time, m.heap_B, m.heap_extra_B, m.stacks_B) == (t.time, t.heap_B, t.heap_extra_B, t.stacks_B)
        assert str(m.kind) == {"empty": "normal"}.get(t.heap_tree, t.heap_tree)
        assert (m.tree is None) == (t.tree is None)
        if m.tree is not None and t.tree is not None:
            assert label_paths(m.tree) == massif_reader.paths(t.tree)
            assert m.tree.total == t.tree.bytes


def test_valgrind_labels() -> None:
    assert parse_label("0x10919E: grow (p.c:4)") == Frame(0x10919E, "grow", "p.c", 4)
    assert parse_label("0x4A2C3B1: std::vector<int, std::allocator<int> >::_M_realloc_insert(int&&) (vector.tcc:440)") \
        == Frame(0x4A2C3B1, "std::vector<int, std::allocator<int> >::_M_realloc_insert(int&&)", "vector.tcc", 440)
    assert parse_label("0x4914E3A: operator new(unsigned long) (in /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)") \
        == Frame(0x4914E3A, "operator new(unsigned long)", obj="/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30")
    assert parse_label("0x1234: ???") == Frame(0x1234, None)
    below = parse_label("in 3 places, all below massif's threshold (1.00%)")
    assert below == Frame(0, "in 3 places, all below massif's threshold (1.00%)")


VALGRIND_STYLE = """\
desc: --time-unit=B
cmd: ./cxx
time_unit: B
#-----------
snapshot=0
#-----------
time=0
mem_heap_B=0
mem_heap_extra_B=0
mem_stacks_B=0
heap_tree=empty
#-----------
snapshot=1
#-----------
time=1200
mem_heap_B=1100
mem_heap_extra_B=20
mem_stacks_B=0
heap_tree=detailed
n2: 1100 (heap allocation functions) malloc/new/new[], --alloc-fns, etc.
 n1: 1000 0x4914E3A: operator new(unsigned long) (in /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)
  n0: 1000 0x109203: main (cxx.cpp:7)
 n0: 100 in 2 places, all below massif's threshold (1.00%)
"""


def test_a_valgrind_style_file() -> None:
    f = parse_massif(VALGRIND_STYLE)
    assert [s.kind for s in f.snapshots] == [SnapshotKind.NORMAL, SnapshotKind.DETAILED]
    tree = f.snapshots[1].tree
    assert tree is not None and tree.total == 1100 and tree.n_stacks == 2
    kids = list(tree.children.values())
    assert [(k.frame.function, k.bytes) for k in kids] == [
        ("operator new(unsigned long)", 1000), ("in 2 places, all below massif's threshold (1.00%)", 100)]
    assert next(iter(kids[0].children.values())).frame == Frame(0x109203, "main", "cxx.cpp", 7)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "desc"),
        ("desc: x\ncmd: y\ntime_unit: s\n", "time_unit 's'"),
        ("desc: x\ncmd: y\ntime_unit: ms\n", "no snapshot"),
        (VALGRIND_STYLE.replace("mem_heap_B=1100", "mem_heap_B=lots"), "not a whole number"),
        (VALGRIND_STYLE.replace(" n0: 100 in 2", "#n0: 100 in 2"), "tree node was expected"),
        (VALGRIND_STYLE.replace("heap_tree=detailed", "heap_tree=full"), "heap_tree='full'"),
    ],
)
def test_bad_files_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(MassifFileError) as err:
        parse_massif(text, name="bad.out")
    assert isinstance(err.value, UsageError)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("bad.out:")
