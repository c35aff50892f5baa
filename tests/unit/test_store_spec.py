"""docs/store-format.md is complete: a reader written from it alone (store_spec_reader) reads what the writer
writes, and agrees with heapscope's own reader."""

from __future__ import annotations

from pathlib import Path

from agent.model.profile import Frame
from agent.store import Retention, StoreMeta, StoreReader, StoreWriter, SyncPolicy
from agent.store.writer import segment_paths
from tests.support.store_workload import Workload
from tests.unit import store_spec_reader

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
