"""heapscope report and diff over a stored history: read by the real ms_print and callgrind_annotate, a diff
that gives exactly the growth that was made, times as users write them, and one-line errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main
from agent.errors import UsageError
from agent.model.stack import Frame, SiteCounts
from agent.offline.timespec import parse_duration, parse_moment, parse_thin_rules
from agent.store import PeakState, SegmentReader, StoreMeta, StoreSample, StoreWriter, SyncPolicy, ThinRule
from tests.support.massif_reader import read_massif
from tests.support.store_workload import S, iso_of, make_store

ROOT = Path(__file__).resolve().parents[2]


def heapscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.needs("ms_print")
def test_report_massif_is_read_by_ms_print_and_culled(tmp_path: Path) -> None:
    wl = make_store(tmp_path)
    out = tmp_path / "m.out"
    start, end = wl.start_ns + 50 * S, wl.start_ns + 350 * S
    rc = main(["report", str(tmp_path), "--pid", "4242", "--from", iso_of(start), "--to", iso_of(end),
               "--format=massif", "-o", str(out), "--max-snapshots", "40"])
    assert rc == 0
    prof = read_massif(out)
    times = [s.time for s in prof.snapshots]
    assert 20 <= len(times) <= 40  # Massif's culling keeps between N/2 and N
    assert times[0] == 50_000 and times[-1] == 350_000
    assert prof.snapshots[-1].tree is not None
    # the exact peak as of the end of the range (the workload's heap mostly grows: it is inside the range)
    peak = [s for s, _ in wl.samples(351)][350].peak
    assert peak is not None and peak.time >= 50_000
    assert prof.peak is not None and prof.peak.time == peak.time and prof.peak.total_B == peak.total_B
    assert prof.peak.tree is not None and prof.peak.tree.bytes == peak.heap_B
    text = subprocess.run(["ms_print", str(out)], capture_output=True, text=True, check=True).stdout
    assert "Detailed snapshots" in text and "alloc_site_" in text
    assert prof.cmd == "./app --serve"


@pytest.mark.needs("callgrind_annotate")
def test_report_xtree_is_read_by_callgrind_annotate(tmp_path: Path) -> None:
    make_store(tmp_path, steps=30)
    out = tmp_path / "x.kcg"
    assert main(["report", str(tmp_path), "--format=xtree", "-o", str(out)]) == 0
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(out)], capture_output=True, text=True,
                          check=True).stdout
    assert "main.c:main" in text and "PROGRAM TOTALS" in text


def test_report_json_lists_every_snapshot_of_the_range(tmp_path: Path) -> None:
    wl = make_store(tmp_path, steps=60)
    buf = io.StringIO()
    from agent.offline import commands

    ns = commands_namespace(["report", str(tmp_path), "--format=json", "--from", iso_of(wl.start_ns + 10 * S),
                             "--to", iso_of(wl.start_ns + 19 * S)])
    assert commands.Report(out=buf).run(ns) == 0
    doc = json.loads(buf.getvalue())
    assert [s["time"] for s in doc["snapshots"]] == [k * 1000 for k in range(10, 20)]
    truth = list(wl.samples(20))[19][0]
    assert doc["snapshots"][-1]["heap_B"] == truth.heap_B
    assert sum(s["cur_bytes"] for s in doc["sites_at_end"]) == truth.heap_B


def commands_namespace(args: list[str]):  # type: ignore[no-untyped-def]
    from agent.cli import build_parser

    return build_parser().parse_args(args)


GROW = (Frame(0x401100, "grow", "prog.c", 12, "/bin/prog"), Frame(0x401200, "main", "prog.c", 40, "/bin/prog"))
KEEP = (Frame(0x401300, "keep", "prog.c", 20, "/bin/prog"), Frame(0x401210, "main", "prog.c", 41, "/bin/prog"))
SHRINK = (Frame(0x401400, "cache", "prog.c", 30, "/bin/prog"), Frame(0x401220, "main", "prog.c", 42, "/bin/prog"))
MALLOC = (Frame(0x7F0000001000, "malloc", None, None, "/lib/libc.so.6"),)


def test_diff_gives_exactly_the_growth_that_was_made(tmp_path: Path) -> None:
    # grow() allocates 1000 blocks of 64 bytes per second for 60 s; cache() frees 10 blocks of 4096 a second
    start = 1_800_000_000 * S
    with StoreWriter(tmp_path / "7", StoreMeta(pid=7, cmd="prog"), sync=SyncPolicy("never"),
                     checkpoint_every=16) as w:
        for t in range(61):
            grow = SiteCounts(cur_bytes=64_000 * t, cur_blocks=1000 * t, tot_bytes=64_000 * t, tot_blocks=1000 * t)
            keep = SiteCounts(cur_bytes=512, cur_blocks=1, tot_bytes=512 * (t + 1), tot_blocks=t + 1,
                              freed_bytes=512 * t, freed_blocks=t)
            cache = SiteCounts(cur_bytes=4096 * (600 - 10 * t), cur_blocks=600 - 10 * t, tot_bytes=4096 * 600,
                               tot_blocks=600, freed_bytes=4096 * 10 * t, freed_blocks=10 * t)
            heap = grow.cur_bytes + keep.cur_bytes + cache.cur_bytes
            w.append(StoreSample(start + t * S, t * 1000, heap, 0, 0, {1: grow, 2: keep, 3: cache},
                                 {1: MALLOC + GROW, 2: MALLOC + KEEP, 3: MALLOC + SHRINK} if t == 0 else {},
                                 peak=PeakState(t * 1000, heap, 0)))
    buf = io.StringIO()
    from agent.offline import commands

    ns = commands_namespace(["diff", str(tmp_path), "--from", iso_of(start + 10 * S), "--to",
                             iso_of(start + 40 * S), "--json", "--threshold", "0"])
    assert commands.Diff(out=buf).run(ns) == 0
    doc = json.loads(buf.getvalue())
    assert doc["grew"]["bytes"] == 30 * 64_000 and doc["grew"]["blocks"] == 30 * 1000
    (site,) = doc["grew"]["children"]  # malloc is trimmed as Massif trims it: the site is grow()
    assert site["label"] == GROW[0].label and site["bytes"] == 30 * 64_000
    assert site["children"][0]["label"] == GROW[1].label
    assert doc["shrank"]["bytes"] == -30 * 10 * 4096
    assert [c["label"] for c in doc["shrank"]["children"]] == [SHRINK[0].label]
    assert doc["heap_delta_B"] == 30 * 64_000 - 30 * 40960
    text = io.StringIO()
    ns = commands_namespace(["diff", str(tmp_path), "--from", iso_of(start + 10 * S), "--to",
                             iso_of(start + 40 * S)])
    assert commands.Diff(out=text).run(ns) == 0
    assert "+1,920,000  " + GROW[0].label in text.getvalue()
    assert "-1,228,800  " + SHRINK[0].label in text.getvalue()
    assert "keep" not in text.getvalue()  # unchanged: not in the diff


def test_relative_and_absolute_times() -> None:
    now = 1_800_000_000 * S
    assert parse_moment("now", now) == now
    assert parse_moment("-24h", now) == now - 86400 * S
    assert parse_moment("-30m", now) == now - 1800 * S
    assert parse_moment("-1.5d", now) == now - 129600 * S
    assert parse_moment("2027-01-15T08:00:00+00:00", now) == 1_800_000_000 * S  # the same moment, in ISO
    base = parse_moment("2027-01-15T08:00", now)
    assert parse_moment("09:30", now, base_ns=base) - base == 5400 * S
    assert parse_duration("500ms") == 0.5 and parse_duration("2d") == 172800 and parse_duration("10") == 10
    with pytest.raises(UsageError, match="cannot read the time"):
        parse_moment("yesterday-ish", now)


def test_thinning_rules() -> None:
    assert parse_thin_rules("1h:10s, 1d:1m") == (ThinRule(3600, 10), ThinRule(86400, 60))
    for bad in ("1h", "1d:1m,1h:10s", "1h:1m,1d:10s", "1h:0s", "1x:1s"):
        with pytest.raises(UsageError):
            parse_thin_rules(bad)


def test_bad_input_is_one_line_and_an_exit_code(tmp_path: Path) -> None:
    make_store(tmp_path, steps=5)
    (tmp_path / "99").mkdir()
    cases = [
        (["report", str(tmp_path / "nope")], "no store at"),
        (["report", str(tmp_path), "--pid", "5"], "no history of pid 5"),
        (["diff", str(tmp_path), "--from", "-1m", "--to", "-2m"], "is before --from"),
        (["diff", str(tmp_path), "--from", "soon", "--to", "now"], "cannot read the time"),
        (["report", str(tmp_path), "--from", "2001-01-01", "--to", "2001-01-02"], "no snapshot in that range"),
    ]
    for args, message in cases:
        proc = heapscope(*args)
        assert proc.returncode in (1, 2), (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, proc.stderr)


def test_a_damaged_store_is_reported_and_the_rest_reported_on(tmp_path: Path) -> None:
    make_store(tmp_path, steps=20)
    (seg,) = (tmp_path / "4242").iterdir()
    last = SegmentReader(seg).snapshots()[-1]
    seg.write_bytes(seg.read_bytes()[: last.toc.start - 10])  # into the last snapshot's blocks
    proc = heapscope("report", str(tmp_path), "--format=json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["snapshots"]) == 19
    assert "skipped" in proc.stderr and "bytes at the end" in proc.stderr


def test_a_range_starts_with_the_state_at_its_start(tmp_path: Path) -> None:
    """A quiet target is stored rarely: a range that begins between two snapshots begins with the earlier one
    (the state held until the next), and a range inside a gap is that one state."""
    from agent.offline.history import select
    from agent.store import StoreReader

    start = 1_800_000_000 * S
    with StoreWriter(tmp_path / "7", StoreMeta(pid=7, cmd="prog", start_wall_ns=start), sync=SyncPolicy("never"),
                     checkpoint_every=16) as w:
        for t, live in ((0, 1), (1, 1), (60, 2), (61, 2)):  # quiet from 1 s to 60 s
            counts = SiteCounts(cur_bytes=512 * live, cur_blocks=live, tot_bytes=512 * live, tot_blocks=live)
            w.append(StoreSample(start + t * S, t * 1000, 512 * live, 0, 0, {1: counts},
                                 {1: MALLOC + KEEP} if t == 0 else {}))
    with StoreReader(tmp_path / "7") as reader:
        def times(a: int | None, b: int | None) -> list[int]:
            return [r.time for r in select(reader, a, b).refs]

        assert times(start + 30 * S, start + 61 * S) == [1000, 60000, 61000]
        assert times(start + 30 * S, start + 40 * S) == [1000]
        assert times(start + 1 * S, start + 60 * S) == [1000, 60000]  # a snapshot at the start itself
        assert times(start - 5 * S, start + 1 * S) == [0, 1000]  # nothing before the first
        assert times(None, None) == [0, 1000, 60000, 61000]
