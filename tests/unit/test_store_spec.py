"""docs/store-format.md is complete: a reader written from it alone (store_spec_reader) reads what the writer
writes, and agrees with heapscope's own reader."""

from __future__ import annotations

import json
from pathlib import Path

from agent.model.stack import Frame, SiteCounts
from agent.store import Retention, StoreMeta, StoreReader, StoreSample, StoreWriter, SyncPolicy
from agent.store import format as fmt
from agent.store.files import segment_paths
from tests.support import store_spec_reader
from tests.support.store_workload import Workload, site_stack

FIELDS = ("tot_blocks", "tot_bytes", "freed_blocks", "freed_bytes", "cur_blocks", "cur_bytes", "cur_extra",
          "peak_bytes", "peak_extra")


def plain(frame: Frame) -> tuple:
    return (frame.address, frame.function, frame.file, frame.line, frame.obj, frame.path, frame.inlined)


def test_the_spec_reader_reads_every_snapshot_the_writer_wrote(tmp_path: Path) -> None:
    wl = Workload(n_sites=300, new_sites_per_step=11, rate=3.0)
    truth = []
    meta = StoreMeta(pid=77, cmd="./app", time_unit="ms", desc=("--threshold=0.5",), options={"depth": 12})
    with StoreWriter(tmp_path, meta, sync=SyncPolicy("never"), checkpoint_every=6,
                     retention=Retention(segment_bytes=40_000, max_bytes=None)) as w:
        for sample, expected in wl.samples(45):
            w.append(sample)
            truth.append((sample, expected))
    paths = segment_paths(tmp_path)
    assert len(paths) >= 3
    # the workload's three-size sites make the writer give byte units (subversion 3): the spec reader must use them
    assert any(fmt.kind_bytes(fmt.K_HINT_UNIT) in p.read_bytes() for p in paths)
    got = []
    for p in paths:
        seg = store_spec_reader.read_segment(str(p))
        assert seg.skipped == []
        assert seg.filemeta["pid"] == 77 and seg.filemeta["desc"] == ["--threshold=0.5"]
        assert seg.filemeta["options"] == {"depth": 12}
        got += seg.snapshots
    assert len(got) == len(truth)
    for (info, sites), (sample, expected) in zip(got, truth, strict=True):
        assert (info["wall_ns"], info["time"], info["heap"], info["extra"], info["mapped"], info["rss"]) == (
            sample.wall_ns, sample.time, sample.heap_B, sample.extra_B, sample.mapped_B, sample.rss_B)
        assert info["peak"]["heap"] == sample.peak.heap_B  # type: ignore[union-attr]
        want = {tuple(plain(f) for f in stack): [getattr(c, f) for f in FIELDS] for stack, c in expected.items()}
        assert sites == want


def test_the_spec_reader_and_heapscope_agree_on_a_torn_file(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, StoreMeta(pid=1, cmd="x"), sync=SyncPolicy("never"), checkpoint_every=4) as w:
        for sample, _ in Workload(n_sites=60).samples(13):
            w.append(sample)
    (path,) = segment_paths(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 700])
    spec = store_spec_reader.read_segment(str(path))
    ours = StoreReader(path)
    refs = ours.snapshots()
    assert len(spec.snapshots) == len(refs) == 12
    for (_, sites), ref in zip(spec.snapshots, refs, strict=True):
        mine = ours.load(ref).sites()
        assert sites == {tuple(plain(f) for f in s): [getattr(c, f) for f in FIELDS] for s, c in mine.items()}
    assert spec.skipped and ours.skipped


def test_the_spec_reader_follows_a_unit_changed_between_checkpoints(tmp_path: Path) -> None:
    # a site allocating multiples of 48 bytes, then a block of 40: its unit falls from 48 to 16 in a hint row
    # between checkpoints, and both readers must give back the exact byte totals
    stack = site_stack(0)
    totals = []
    bk = b = 0
    for blocks, size in [(2, 48), (3, 96), (1, 144), (2, 40), (1, 48), (4, 96)]:
        bk, b = bk + blocks, b + blocks * size
        totals.append((bk, b))
    with StoreWriter(tmp_path, StoreMeta(pid=1, cmd="x"), sync=SyncPolicy("never")) as w:
        for t, (bk, b) in enumerate(totals):
            counts = SiteCounts(tot_blocks=bk, tot_bytes=b, cur_blocks=bk, cur_bytes=b)
            w.append(StoreSample(wall_ns=(t + 1) * 10**9, time=t, heap_B=b, extra_B=0, stacks_B=0, sites={3: counts},
                                 new_stacks={3: stack} if t == 0 else {}))
    (path,) = segment_paths(tmp_path)
    spec = store_spec_reader.read_segment(str(path))
    assert [info["hinted"] for info, _ in spec.snapshots] == [1, 0, 0, 1, 0, 0]
    key = tuple(plain(f) for f in stack)
    assert [(sites[key][0], sites[key][1], sites[key][5]) for _, sites in spec.snapshots] == [
        (bk, b, b) for bk, b in totals
    ]


def test_a_subversion_2_segment_still_reads(tmp_path: Path) -> None:
    # written by heapscope before byte units (tests/support/store_v2: its counters in expected.json): no h_unit
    # block, so every unit is 0 and counts as 1, in heapscope's reader as in the spec's
    here = Path(__file__).resolve().parents[1] / "support" / "store_v2"
    expected = json.loads((here / "expected.json").read_text())["snapshots"]
    path = here / "seg-00000001.hss"
    assert fmt.kind_bytes(fmt.K_HINT_UNIT) not in path.read_bytes()
    spec = store_spec_reader.read_segment(str(path))
    assert spec.filemeta["subversion"] == 2 and spec.skipped == []
    with StoreReader(path) as ours:
        refs = ours.snapshots()
        assert len(refs) == len(spec.snapshots) == len(expected) == 12
        for ref, (info, spec_sites), want in zip(refs, spec.snapshots, expected, strict=True):
            assert info["wall_ns"] == ref.wall_ns == want["wall_ns"]
            want_sites = {fn: counts for fn, counts in want["sites"]}
            mine = {stack[0].function: [getattr(c, f) for f in FIELDS] for stack, c in ours.load(ref).sites().items()}
            assert mine == want_sites
            assert {stack[0][1]: counts for stack, counts in spec_sites.items()} == want_sites
