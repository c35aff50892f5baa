"""--depth as Massif counts it, judged by real Valgrind (deep.c: allocations 41 and 59 calls deep in a recursion).

A function calling itself from one line puts every one of those frames at the same return address; Massif counts
each call against --depth all the same. Its tree keeps --depth frames under the allocation function; its xtree
keeps every frame it captured (--depth + 49, after its own replacement of malloc) up to main. heapscope's massif.out,
its xtree, its MALT stacks and the daemon's answers must show the same frames.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import answers, free_port
from tests.support.harness import ORACLE_OPTIONS, PROGRAMS, RUN_TIMEOUT, Completed
from tests.support.massif_reader import parse_massif, paths
from tests.support.oracle import NO_CULL, Paths, final, heapscope_peak, read_snapshots, reference_peak
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration


def _line_of(marker: str) -> int:
    for n, text in enumerate((PROGRAMS / "deep.c").read_text().splitlines(), start=1):
        if f"/* {marker} */" in text:
            return n
    raise AssertionError(f"no {marker} in deep.c")


LEAF, RECURSE = _line_of("LEAF"), _line_of("RECURSE")


def _diff(ref: Paths, got: Paths) -> str:
    return "\n".join(
        f"  massif={ref.get(p)} heapscope={got.get(p)}  {len(p)} frames, {p[-1]}"
        for p in sorted(set(ref) | set(got))
        if ref.get(p) != got.get(p)
    )


def _descend_depths(tree: Paths) -> Counter[int]:
    """The frames of each leaf path from the allocation in descend (paths start below the root)."""
    leaves = [p for p in tree if not any(len(q) == len(p) + 1 and q[: len(p)] == p for q in tree)]
    return Counter(len(p) for p in leaves if p[0] == f"descend (deep.c:{LEAF})")


@pytest.fixture(scope="module")
def deep(build: Callable[..., Path]) -> Path:
    return build("deep.c")


@pytest.mark.parametrize("depth", [30, 7])
def test_trees_keep_depth_frames(
    depth: int, deep: Path, run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    options = (f"--depth={depth}", *NO_CULL)
    ref = read_snapshots(run_massif(deep, (), options).massif_text)
    run = run_heapscope(deep, (), options)
    assert run.returncode == 0, run.stderr
    got = read_snapshots(run.massif_text)
    ref_peak, got_peak = reference_peak(ref).tree, heapscope_peak(got).tree
    assert got_peak == ref_peak, "peak trees differ:\n" + _diff(ref_peak, got_peak)
    ref_end, got_end = final(ref).tree, final(got).tree
    assert got_end == ref_end, "final trees differ:\n" + _diff(ref_end, got_end)
    # What the comparison is about: the two deep stacks, cut at --depth, become one path; the shallow one
    # (7 frames to main) ends apart.
    assert _descend_depths(got_peak) == Counter([depth, 7])


# ---------------------------------------------------------------------------------------------------------
# The xtree


def xtree_stacks(text: str) -> dict[tuple[tuple[str, int], ...], tuple[int, ...]]:
    """The stacks of a callgrind-format xtree as (function, line) from the outermost caller to the allocation,
    with their costs summed over the stacks that are equal so."""
    names: dict[str, str] = {}
    out: dict[tuple[tuple[str, int], ...], tuple[int, ...]] = {}
    body = text.split("\nevents:", 1)[1].split("\n", 1)[1]
    for block in body.strip().split("\n\n"):
        frames: list[tuple[str, int]] = []
        fn = ""
        costs: tuple[int, ...] = ()
        expect_line = False
        for line in block.splitlines():
            m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
            if m:
                if m.group(3) is not None:
                    names[m.group(2)] = m.group(3)
                if m.group(1) == "fn":
                    fn, expect_line = names[m.group(2)], True
                continue
            if not line or not line[0].isdigit():
                continue
            fields = [int(x) for x in line.split()]
            if expect_line:
                frames.append((fn, fields[0]))
                expect_line = False
            if len(fields) > 1:
                costs = tuple(fields[1:])
        if frames and costs:
            key = tuple(frames)
            out[key] = tuple(a + b for a, b in zip(out.get(key, (0,) * len(costs)), costs, strict=True))
    return out


def test_xtree_keeps_what_massif_captured(
    deep: Path, run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    ref_run = run_massif(deep, (), (), xtree=True)
    got_run = run_heapscope(deep, (), (), xtree=True)
    assert ref_run.xtree_out is not None and got_run.xtree_out is not None
    ref = xtree_stacks(ref_run.xtree_out.read_text())
    got = xtree_stacks(got_run.xtree_out.read_text())
    assert got == ref, f"xtree stacks differ:\nvalgrind  {sorted(ref.items())}\nheapscope {sorted(got.items())}"
    # Whole stacks up to main, deeper than --depth: 41 and 59 calls of descend, and the shallow one.
    lengths = sorted(len(k) for k in got if k[-1] == ("descend", LEAF))
    assert lengths == [7, 42, 60]


# ---------------------------------------------------------------------------------------------------------
# MALT and the daemon


def test_malt_stacks_count_each_call(deep: Path, run_heapscope: Callable[..., Completed], tmp_path: Path) -> None:
    malt = tmp_path / "deep.malt.json"
    run = run_heapscope(deep, (), (f"--malt-out-file={malt}",))
    assert run.returncode == 0, run.stderr
    doc = json.loads(malt.read_text())
    strings, instr = doc["sites"]["strings"], doc["sites"]["instr"]

    def where(address: str) -> tuple[str, int | None]:
        entry = instr[address]
        return strings[entry["function"]], entry.get("line")

    lengths = []
    for stack in doc["stacks"]["stats"]:
        frames = [where(a) for a in stack["stack"]]
        if frames[0][0] == "malloc" and len(frames) > 1 and frames[1] == ("descend", LEAF):
            # Every address of the recursion is named (the same frames as the xtree's) up to main; MALT's
            # stacks go on below main.
            main = [fn for fn, _ in frames].index("main")
            assert frames[2:main] == [("descend", RECURSE)] * (main - 2), frames
            lengths.append(main)
    assert sorted(lengths) == [7, 42, 60]


def test_daemon_answers_follow_depth(
    deep: Path, heapscope_cmd: list[str], run_massif: Callable[..., Completed], tmp_path: Path
) -> None:
    """`run --http`: /detailed_snapshot and /xtmemory, asked while deep.c waits before its free, show Massif's
    frames (Massif's state before the free is its peak)."""
    ref_run = run_massif(deep, (), ("--depth=12", *NO_CULL), xtree=True)
    ref_peak = reference_peak(read_snapshots(ref_run.massif_text)).tree
    assert ref_run.xtree_out is not None
    ref_xt = xtree_stacks(ref_run.xtree_out.read_text())
    port = free_port()
    cmd = [*heapscope_cmd, "run", *ORACLE_OPTIONS, "--depth=12", "--http", f"127.0.0.1:{port}"]
    cmd += ["--output-dir", str(tmp_path / "out"), "--", str(deep), "wait"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"allocated\n"
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(f"{url}/healthz"), what="the daemon to answer")
        snap = httpx.get(f"{url}/detailed_snapshot", timeout=30).text
        xt = httpx.get(f"{url}/xtmemory", timeout=30).text
        proc.stdin.write(b"\n")
        proc.stdin.close()
        assert proc.wait(RUN_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tree = parse_massif(snap).snapshots[0].tree
    assert tree is not None
    # deep.c's own sites (the daemon's run also has stdout's buffer, which the run under Massif never made).
    got = {p: b for p, b in paths(tree).items() if p and p[0].startswith("descend")}
    ref = {p: b for p, b in ref_peak.items() if p[0].startswith("descend")}
    assert got == ref, "the daemon's tree differs:\n" + _diff(ref, got)
    assert _descend_depths(got) == Counter([12, 7])
    # The xtree of now (curB, curBk): the same stacks, each holding what it allocated in Massif's whole run
    # (totB), as the free has not happened yet.
    got_xt = {k: v[0] for k, v in xtree_stacks(xt).items() if k[-1] == ("descend", LEAF)}
    ref_xt_alloc = {k: v[2] for k, v in ref_xt.items() if k[-1] == ("descend", LEAF)}
    assert got_xt == ref_xt_alloc
    assert sorted(len(k) for k in got_xt) == [7, 42, 60]
