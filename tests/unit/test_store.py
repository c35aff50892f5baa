"""The history store: what goes in comes back out, across checkpoints, segments, retention and thinning."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agent.model.stack import Frame, SiteCounts, ip_groups
from agent.store import (
    Retention,
    StoreMeta,
    StoreReader,
    StoreSample,
    StoreWriteError,
    StoreWriter,
    SyncPolicy,
    ThinRule,
    retention,
)
from agent.store import format as fmt
from agent.store import writer as writer_mod
from agent.store.files import segment_paths
from agent.store.reader import SegmentReader
from tests.support.store_workload import Workload, site_stack

META = StoreMeta(pid=4242, cmd="./app --serve", desc=("--depth=30",), options={"depth": 30})


def write(directory: Path, wl: Workload, steps: int, **kwargs) -> list:
    truth = []
    with StoreWriter(directory, META, sync=SyncPolicy("never"), **kwargs) as w:
        for sample, expected in wl.samples(steps):
            w.append(sample)
            truth.append((sample, expected))
    return truth


def test_every_snapshot_comes_back_in_any_order(tmp_path: Path) -> None:
    truth = write(tmp_path, Workload(n_sites=200, new_sites_per_step=7), 40, checkpoint_every=9)
    reader = StoreReader(tmp_path)
    refs = reader.snapshots()
    assert len(refs) == 40
    order = [*range(40), 39, 0, 17, 9, 8, 26, 25, 3]
    for k in order:
        snap = reader.load(refs[k])
        sample, expected = truth[k]
        assert snap.sites() == expected
        assert (snap.wall_ns, snap.time, snap.heap_B, snap.extra_B) == (
            sample.wall_ns, sample.time, sample.heap_B, sample.extra_B)
        assert (snap.mapped_B, snap.rss_B, snap.peak) == (sample.mapped_B, sample.rss_B, sample.peak)
    assert reader.skipped == []
    assert reader.meta == META


def test_time_range_selects_by_wall_clock(tmp_path: Path) -> None:
    wl = Workload(n_sites=20)
    write(tmp_path, wl, 30, retention=Retention(segment_bytes=3000, max_bytes=None))  # several segments
    reader = StoreReader(tmp_path)
    second = 1_000_000_000
    got = reader.snapshots(wl.start_ns + 10 * second, wl.start_ns + 19 * second)
    assert [r.time for r in got] == [1000 * k for k in range(10, 20)]
    at = reader.at(wl.start_ns + 15 * second + 500_000_000)
    assert at is not None and at.time == 15000
    assert len(reader.segments) > 3
    opened = [seg for seg in reader.segments if seg._indexed]
    assert 1 <= len(opened) < len(reader.segments)  # only the segments the range reaches are indexed
    assert reader.at(wl.start_ns - 1) is None
    last = reader.at(wl.start_ns + 10**6 * second)
    assert last is not None and last.time == 29000


def test_unchanged_sites_are_not_listed_and_sites_left_out_keep_their_counters(tmp_path: Path) -> None:
    frames = {i: (Frame(0x10 + i, f"f{i}"), Frame(0x99, "main")) for i in range(3)}
    same = (Frame(0x10, "f0"), Frame(0x99, "main"))  # site 3 has site 0's stack: they add up
    c = [SiteCounts(cur_bytes=10 * i, cur_blocks=i, tot_bytes=10 * i, tot_blocks=i) for i in range(4)]
    with StoreWriter(tmp_path, META, sync=SyncPolicy("never"), checkpoint_every=50) as w:
        w.append(StoreSample(1, 0, 60, 0, 0, dict(enumerate(c)), {**frames, 3: same}))
        c2 = SiteCounts(cur_bytes=25, cur_blocks=2, tot_bytes=35, tot_blocks=3, freed_bytes=10, freed_blocks=1)
        w.append(StoreSample(2, 1, 65, 0, 0, {2: c2}))
    reader = StoreReader(tmp_path)
    seg = reader.segments[0]
    second = reader.snapshots()[1]
    assert second.info["listed"] == 1
    sites = reader.load(second).sites()
    assert sites[frames[2]] == c2
    assert sites[frames[1]] == c[1]
    assert sites[same].cur_bytes == c[0].cur_bytes + c[3].cur_bytes
    assert len(seg.site_stacks) == 4


def test_inlined_frames_stay_inlined(tmp_path: Path) -> None:
    """A stack's split into instruction pointers survives the store: an inlined call is marked, and a recursion
    (frames at one address, none inlined) is not taken for one."""
    inl = (Frame(0x20, "h", "r.c", 2, inlined=True), Frame(0x20, "r", "r.c", 9))
    recursion = (Frame(0x10, "leaf", "r.c", 5), *(inl * 3), Frame(0x30, "r", "r.c", 9), Frame(0x30, "r", "r.c", 9))
    with StoreWriter(tmp_path, META, sync=SyncPolicy("never")) as w:
        w.append(StoreSample(1, 0, 10, 0, 0, {0: SiteCounts(cur_bytes=10, cur_blocks=1)}, {0: recursion}))
    reader = StoreReader(tmp_path)
    (stack,) = reader.load(reader.snapshots()[0]).sites()
    assert [f.inlined for f in stack] == [f.inlined for f in recursion]
    assert len(ip_groups(stack)) == 1 + 3 + 2


def test_unknown_site_is_refused(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, META) as w, pytest.raises(ValueError, match="site 7"):
        w.append(StoreSample(1, 0, 0, 0, 0, {7: SiteCounts(cur_bytes=1)}))


def test_awkward_values_round_trip(tmp_path: Path) -> None:
    odd = (
        Frame(0xFFFF_FFFF_FFFF_FFF0, None, None, None, None),
        Frame(0x7FFF_0000_1234, "ünïcode ∑ fn", "dir/ä.c", 2**31 + 5, "/lib/x.so", "/very/long/" + "p" * 3000),
    )
    big = SiteCounts(cur_bytes=-5, cur_blocks=-1, tot_bytes=2**61, tot_blocks=2**40, freed_bytes=2**61 + 5,
                     freed_blocks=3, peak_bytes=2**50, cur_extra=-7, peak_extra=1)
    with StoreWriter(tmp_path, META, sync=SyncPolicy("always")) as w:
        w.append(StoreSample(1, 0, 0, 0, 0, {0: big}, {0: odd}))
        w.append(StoreSample(2, 5, 0, 0, 0, {0: SiteCounts()}))
    reader = StoreReader(tmp_path)
    a, b = (reader.load(r).sites() for r in reader.snapshots())
    assert a == {odd: big}
    (stack,) = a
    assert stack[1].path == odd[1].path  # not part of a Frame's equality: checked on its own
    assert b == {odd: SiteCounts()}


def test_outer_toc_chain_indexes_in_log2_reads(tmp_path: Path) -> None:
    write(tmp_path, Workload(n_sites=5), 77)
    (path,) = segment_paths(tmp_path)
    reads = []
    real = fmt.read_block

    def counting(data, at):  # type: ignore[no-untyped-def]
        b = real(data, at)
        reads.append(b.kind)
        return b

    fmt.read_block = counting  # type: ignore[assignment]
    try:
        seg = SegmentReader(path)
        refs = seg.snapshots()
    finally:
        fmt.read_block = real  # type: ignore[assignment]
    assert len(refs) == 77
    # 77 = 0b1001101: four outer TOCs cover it (77, 76, 72, 64), plus the filemeta block
    assert reads.count(fmt.K_OUTERTOC) == bin(77).count("1")
    assert reads.count(fmt.K_SNAPTOC) == 0


def test_segments_rotate_and_each_stands_alone(tmp_path: Path) -> None:
    truth = write(tmp_path, Workload(n_sites=50), 60, retention=Retention(segment_bytes=6000, max_bytes=None),
                  checkpoint_every=7)
    paths = segment_paths(tmp_path)
    assert len(paths) > 3
    reader = StoreReader(tmp_path)
    refs = reader.snapshots()
    assert [reader.load(r).sites() for r in refs] == [e for _, e in truth]
    paths[0].unlink()
    paths[2].unlink()
    reader = StoreReader(tmp_path)
    kept = {r.time for r in reader.snapshots()}
    for r in reader.snapshots():
        assert reader.load(r).sites() == truth[r.time // 1000][1]
    assert len(kept) < 60 and reader.skipped == []


def test_retention_by_size_deletes_oldest_segments(tmp_path: Path) -> None:
    limit = 20_000
    with StoreWriter(tmp_path, META, sync=SyncPolicy("never"),
                     retention=Retention(segment_bytes=4000, max_bytes=limit)) as w:
        for sample, _ in Workload(n_sites=40).samples(120):
            w.append(sample)
            sizes = [p.stat().st_size for p in segment_paths(tmp_path)]
            # the bound holds after each rotation; the open segment may pass its own size by one snapshot
            assert sum(sizes[:-1]) <= limit
        assert w.stats.segments_deleted > 0
    reader = StoreReader(tmp_path)
    times = [r.time for r in reader.snapshots()]
    assert times == sorted(times) and times[-1] == 119_000 and times[0] > 0


def test_retention_by_age(tmp_path: Path) -> None:
    now = [time.time()]
    w = StoreWriter(tmp_path, META, sync=SyncPolicy("never"), clock=lambda: now[0],
                    retention=Retention(segment_bytes=3000, max_age_s=3600, max_bytes=None))
    samples = Workload(n_sites=30).samples(60)
    for _ in range(20):
        w.append(next(samples)[0])
    old = segment_paths(tmp_path)[:-1]
    assert old
    for p in old:
        os.utime(p, (now[0] - 7200, now[0] - 7200))
    for _ in range(20):
        w.append(next(samples)[0])
    w.close()
    left = segment_paths(tmp_path)
    assert not set(old) & set(left)
    assert w.stats.segments_deleted == len(old)


def one_segment(directory: Path) -> None:
    """A writer that opens, writes one snapshot and closes: one more segment, as a process attached once more."""
    with StoreWriter(directory, META, sync=SyncPolicy("never")) as w:
        w.append(next(Workload(n_sites=3).samples(1))[0])


def test_a_writer_opening_applies_the_retention_once_in_a_while(tmp_path: Path, monkeypatch) -> None:
    """A process attached again and again opens a segment each time: the retention looks at its directory at most
    once in RETENTION_RECHECK seconds then, and at once when a writer closes a segment of its own."""
    clock = [1000.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: clock[0])
    for _ in range(3):
        one_segment(tmp_path)
    week_ago = time.time() - 8 * 86400
    for p in segment_paths(tmp_path):
        os.utime(p, (week_ago, week_ago))
    one_segment(tmp_path)  # within ten seconds of the first: not looked at
    assert len(segment_paths(tmp_path)) == 4
    clock[0] += writer_mod.RETENTION_RECHECK
    one_segment(tmp_path)  # later: the week-old ones go (the default max_age is seven days)
    assert [p.name for p in segment_paths(tmp_path)] == ["seg-00000004.hss", "seg-00000005.hss"]
    for p in segment_paths(tmp_path):
        os.utime(p, (week_ago, week_ago))
    with StoreWriter(tmp_path, META, sync=SyncPolicy("never"), retention=Retention(segment_bytes=1)) as w:
        for sample, _ in Workload(n_sites=3).samples(2):  # the second append closes the first segment
            w.append(sample)
        assert w.stats.segments_deleted == 2  # no ten seconds' wait for what it closed itself


def test_retention_reads_a_segment_made_again_under_a_known_name(tmp_path: Path) -> None:
    """Sizes of closed segments are remembered by name and inode: a file put in place of one (a directory
    emptied and written again) is read again."""
    for _ in range(3):
        one_segment(tmp_path)
    sizes = [p.stat().st_size for p in segment_paths(tmp_path)]
    limit = sum(sizes) + 100
    now = time.time()
    assert retention.apply_retention(tmp_path, Retention(max_bytes=limit), now, None).segments_deleted == 0
    first = segment_paths(tmp_path)[0]
    bigger = tmp_path / "bigger"
    bigger.write_bytes(first.read_bytes() + b"\0" * 200)
    os.replace(bigger, first)
    done = retention.apply_retention(tmp_path, Retention(max_bytes=limit), now, None)
    assert done.segments_deleted == 1 and not first.exists()


def test_thinning_keeps_first_last_and_one_per_interval(tmp_path: Path) -> None:
    now = [time.time()]
    wl = Workload(n_sites=30)
    truth = []
    w = StoreWriter(tmp_path, META, sync=SyncPolicy("never"), clock=lambda: now[0], checkpoint_every=4,
                    retention=Retention(segment_bytes=1 << 30, thin=(ThinRule(3600, 10),)))
    samples = wl.samples(100)
    for _ in range(60):
        s, e = next(samples)
        w.append(s)
        truth.append(e)
    first = w._segment.path  # type: ignore[union-attr]
    w.retention = Retention(segment_bytes=1, thin=(ThinRule(3600, 10),))  # close it at the next append
    os.utime(first, (now[0] - 4000, now[0] - 4000))
    s, e = next(samples)
    w.append(s)
    truth.append(e)
    w.close()
    assert w.stats.segments_thinned == 1
    seg = SegmentReader(first)
    times = [r.time // 1000 for r in seg.snapshots()]
    assert times == [0, 10, 20, 30, 40, 50, 59]
    assert w.stats.snapshots_thinned == 60 - len(times)
    for r in seg.snapshots():
        assert seg.load(r).sites() == truth[r.time // 1000]
    assert seg.filemeta["thinned_every_s"] == 10
    assert abs(first.stat().st_mtime - (now[0] - 4000)) < 1


def test_full_disk_is_a_clear_error_and_the_store_stays_whole(tmp_path: Path, monkeypatch) -> None:
    samples = Workload(n_sites=40).samples(10)
    truth = []
    w = StoreWriter(tmp_path, META, sync=SyncPolicy("never"), checkpoint_every=3)
    for _ in range(4):
        s, e = next(samples)
        w.append(s)
        truth.append(e)
    real = os.pwrite
    calls = [0]

    def half_then_fail(fd, data, offset):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            return real(fd, bytes(data[: len(data) // 2]), offset)  # a short write, then no room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_mod.os, "pwrite", half_then_fail)
    lost, _ = next(samples)
    with pytest.raises(StoreWriteError, match="the disk is full"):
        w.append(lost)
    assert w.stats.write_errors == 1
    reader = StoreReader(tmp_path)
    assert [reader.load(r).sites() for r in reader.snapshots()] == truth
    assert reader.skipped == []  # cut back to the last whole snapshot
    monkeypatch.setattr(writer_mod.os, "pwrite", real)
    for _ in range(3):  # room again: the history goes on (the lost sample's changes come with the next)
        s, e = next(samples)
        w.append(s)
        truth.append(e)
    w.close()
    reader = StoreReader(tmp_path)
    assert [reader.load(r).sites() for r in reader.snapshots()] == truth


def test_interval_sync_happens_without_further_appends(tmp_path: Path, monkeypatch) -> None:
    synced = threading.Event()
    real = os.fdatasync

    def spy(fd: int) -> None:
        real(fd)
        synced.set()

    monkeypatch.setattr(writer_mod.os, "fdatasync", spy)
    w = StoreWriter(tmp_path, META, sync=SyncPolicy("interval", 0.2))
    samples = Workload(n_sites=5).samples(3)
    w.append(next(samples)[0])  # the first write: the last sync (at open) is recent, so it waits
    w.append(next(samples)[0])
    assert synced.wait(5.0)
    w.close()
    assert w.stats.syncs >= 1


def test_one_thread_syncs_every_writer_in_its_interval_and_none_after_its_close(tmp_path: Path, monkeypatch) -> None:
    """Writers with the interval policy share the process's one syncer thread: each is synced at most its interval
    after its write (early by half of it at most), and a closed writer's data is synced by its close, never later."""
    synced: dict[str, list[float]] = {}
    real = os.fdatasync

    def spy(fd: int) -> None:
        real(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
        synced.setdefault(Path(name).parent.name, []).append(time.monotonic())

    monkeypatch.setattr(writer_mod.os, "fdatasync", spy)
    interval = 0.4
    writers = {f"w{i}": StoreWriter(tmp_path / f"w{i}", META, sync=SyncPolicy("interval", interval)) for i in range(6)}
    written: dict[str, float] = {}
    for name, w in writers.items():
        w.append(next(Workload(n_sites=5).samples(1))[0])
        written[name] = time.monotonic()
        time.sleep(0.05)
    closed = writers.pop("w5")
    closed.close()
    after_close = len(synced.get("w5", []))
    deadline = time.monotonic() + 10
    while set(synced) < set(writers) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2 * interval)
    assert [t.name for t in threading.enumerate()].count("store-sync") == 1
    for name in writers:
        first = synced[name][0] - written[name]
        assert interval / 2 - 0.05 <= first <= interval + 0.5, (name, first)  # 0.5: a busy machine's scheduling
    assert len(synced.get("w5", [])) == after_close  # nothing of a closed writer's after its close
    for w in writers.values():
        w.close()
    assert all(w.stats.syncs >= 1 and not w.stats.write_errors for w in writers.values())


def test_residuals_are_zero_for_a_steady_single_size_site() -> None:
    prev = np.array([[10], [160], [4], [64], [6], [96], [48], [0], [0]], dtype=np.int64)
    new = np.array([[13], [208], [9], [144], [4], [64], [32], [0], [0]], dtype=np.int64)
    size, xpb, _ = fmt.hints_of(prev)  # 16 bytes a block, 8 extra bytes a block
    res = fmt.encode_counters(prev, new, size, xpb)
    assert res[:, 0].tolist() == [3, 0, 5, 0, 0, 0, 0, 0, 0]
    assert (fmt.decode_counters(prev, res, size, xpb) == new).all()
    # summed residuals of two snapshots decode in one step (the reader's fast path)
    newer = np.array([[20], [320], [11], [176], [9], [144], [72], [0], [0]], dtype=np.int64)
    res2 = fmt.encode_counters(new, newer, size, xpb)
    assert (fmt.advance(prev, res + res2, size, xpb) == newer).all()


def test_byte_residuals_of_a_site_with_three_sizes_count_whole_units() -> None:
    # blocks of 48, 96 and 144 bytes: 10 blocks, 960 bytes (mean 96), then 3 more of 48+144+144
    prev = np.array([[10], [960], [0], [0], [10], [960], [0], [0], [0]], dtype=np.int64)
    new = np.array([[13], [1296], [2], [240], [11], [1056], [0], [0], [0]], dtype=np.int64)
    quantum = np.gcd(np.gcd(np.array([0]), prev[1]), prev[3])  # as the writer keeps it: 960
    quantum = np.gcd(np.gcd(quantum, new[1]), new[3])  # 48
    size, xpb, unit = fmt.hints_of(new, quantum)
    # mean 1296 // 13 = 99, rounded to a multiple of 48: 96
    assert (size.tolist(), unit.tolist()) == ([96], [48])
    res = fmt.encode_counters(prev, new, size, xpb, unit=unit)
    # allocated 336 = 3 * 96 + 1 * 48; freed 240 = 2 * 96 + 1 * 48
    assert res[:, 0].tolist() == [3, 1, 2, 1, 0, 0, 0, 0, 0]
    assert (fmt.decode_counters(prev, res, size, xpb, unit=unit) == new).all()
    # a residual that is not a whole number of units cannot be encoded with that unit
    odd = new.copy()
    odd[1] += 8
    odd[5] += 8
    with pytest.raises(ValueError):
        fmt.encode_counters(prev, odd, size, xpb, unit=unit)


def test_a_unit_that_stops_dividing_the_bytes_is_reduced(tmp_path: Path) -> None:
    # one site allocates multiples of 48 bytes for a while, then a block of 40: the writer's unit for it
    # must fall to 16 (a hint row), and every snapshot must read back exact
    meta = StoreMeta(pid=1, cmd="t")
    stack = site_stack(0)
    states = []
    tot_bk = tot_b = 0
    for t, (blocks, size) in enumerate([(2, 48), (3, 96), (1, 144), (2, 40), (1, 48), (4, 96)]):
        tot_bk += blocks
        tot_b += blocks * size
        states.append((t, tot_bk, tot_b))
    with StoreWriter(tmp_path, meta) as w:
        for t, bk, b in states:
            counts = SiteCounts(tot_blocks=bk, tot_bytes=b, cur_blocks=bk, cur_bytes=b)
            w.append(StoreSample(wall_ns=(t + 1) * 10**9, time=t, heap_B=b, extra_B=0, stacks_B=0, sites={7: counts},
                                 new_stacks={7: stack} if t == 0 else {}))
    with StoreReader(tmp_path) as r:
        refs = r.snapshots()
        assert len(refs) == len(states)
        units = []
        for ref, (_, bk, b) in zip(refs, states, strict=True):
            got = r.load(ref).sites()[stack]
            assert (got.tot_blocks, got.tot_bytes, got.cur_bytes) == (bk, b, b)
            units.append(r.load(ref).info["hinted"])
        # the snapshot with the 40-byte block sets the site's unit again; those before it had nothing to set
        assert units[1:4] == [0, 0, 1]


def test_writer_does_not_import_above_its_layer() -> None:
    import ast

    root = Path(__file__).resolve().parents[2] / "agent" / "store"
    for py in root.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent."):
                assert node.module.split(".")[1] in ("model", "errors", "store"), (py.name, node.module)


def test_sync_interval_default_is_one_second() -> None:
    assert SyncPolicy() == SyncPolicy("interval", 1.0)


def test_summed_runs_match_with_sparse_listings_new_hints_and_peak_moves(tmp_path: Path) -> None:
    # few allocations per site and step: many sites unchanged (partial listings), sites appearing (hints set
    # between checkpoints), a heap that rises and falls (the peak moves now and then)
    wl = Workload(n_sites=150, rate=0.5, new_sites_per_step=5, seed=11)
    truth = write(tmp_path, wl, 80, checkpoint_every=25)
    reader = StoreReader(tmp_path)
    refs = reader.snapshots()
    infos = [r.info for r in refs]
    assert any(0 < i["listed"] < i["sites"] for i in infos)
    assert any(i["hinted"] and not i["checkpoint"] for i in infos)
    moved = [i["peak_moved"] for i in infos if not i["checkpoint"]]
    assert any(moved) and not all(moved)
    for k in (79, 24, 49, 60, 33, 74):  # each from a fresh reader: summed from its checkpoint
        cold = StoreReader(tmp_path)
        assert cold.load(cold.snapshots()[k]).sites() == truth[k][1], k


def test_segments_hold_a_span_of_history_by_the_snapshots_clock(tmp_path: Path) -> None:
    # written much faster than real time: the segments still hold 10 s of the profile's history each
    write(tmp_path, Workload(n_sites=10), 30, retention=Retention(segment_seconds=10, max_bytes=None))
    reader = StoreReader(tmp_path)
    spans = [[r.time // 1000 for r in seg.snapshots()] for seg in reader.segments]
    assert spans == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]


def test_columns_are_compressed_and_read_from_many_threads_at_once() -> None:
    """A daemon's targets store, and its requests read, from threads of their own: each thread has its own zstd
    objects (python-zstandard's are not thread-safe; one shared compressor crashed a daemon), and every column
    comes back as it went in."""
    seen: dict[int, tuple[int, int]] = {}
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        seen[seed] = (id(fmt._codecs.compressor), id(fmt._codecs.decompressor))
        for _ in range(300):
            values = rng.integers(-(1 << 40), 1 << 40, size=int(rng.integers(1, 3000)))
            parsed = fmt.read_block(fmt.column_block(fmt.K_SITE_GAP, values), 0)
            if not np.array_equal(fmt.decode_column(parsed), values):
                errors.append(f"thread {seed}: a column came back changed")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({ids for ids in seen.values()}) == 4  # no two threads share a compressor or a decompressor


def _aged(path: Path, age_s: float, now: float) -> None:
    os.utime(path, (now - age_s, now - age_s))


def _history(root: Path, name: str, ages: list[float], now: float) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for i, age in enumerate(ages, 1):
        seg = d / f"seg-{i:08d}.hss"
        seg.write_bytes(b"x")
        _aged(seg, age, now)
    return d


def test_a_sweep_deletes_the_old_history_of_processes_no_writer_holds(tmp_path: Path) -> None:
    now = time.time()
    day = 86400.0
    gone = _history(tmp_path, "100", [9 * day, 8 * day], now)  # every segment past the age: gone whole
    partly = _history(tmp_path, "200", [9 * day, 1 * day], now)  # the newer segment stays
    held = _history(tmp_path, "300", [9 * day], now)  # a writer holds it: its own retention applies
    fresh_empty = tmp_path / "400"  # a writer may have just made it
    fresh_empty.mkdir()
    old_empty = tmp_path / "500"
    old_empty.mkdir()
    _aged(old_empty, 9 * day, now)
    other = tmp_path / "notes"  # not a process's directory
    other.mkdir()
    _aged(other, 9 * day, now)

    swept = retention.sweep_ended(tmp_path, 7 * day, busy={"300"}, now=now)

    assert (swept.segments_deleted, swept.directories_removed, swept.errors) == (3, 2, [])
    assert not gone.exists() and not old_empty.exists()
    assert [p.name for p in segment_paths(partly)] == ["seg-00000002.hss"]
    assert len(segment_paths(held)) == 1
    assert fresh_empty.is_dir() and other.is_dir()
    again = retention.sweep_ended(tmp_path, 7 * day, busy={"300"}, now=now)
    assert (again.segments_deleted, again.directories_removed) == (0, 0)


def test_a_sweep_without_an_age_or_a_store_does_nothing(tmp_path: Path) -> None:
    now = time.time()
    d = _history(tmp_path, "100", [400 * 86400.0], now)
    assert retention.sweep_ended(tmp_path, None, busy=set(), now=now).segments_deleted == 0
    assert len(segment_paths(d)) == 1
    missing = retention.sweep_ended(tmp_path / "none", 1.0, busy=set(), now=now)
    assert (missing.segments_deleted, missing.errors) == (0, [])


def test_a_quiet_targets_holds_encode_its_counters_once_and_write_what_a_full_encoding_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet target's looks are held snapshots of the same counters: their blocks are encoded once per stored
    sample (and again when the peak in their info moves), and every held snapshot's bytes are those a full
    encoding of it gives, at a checkpoint's turn too. The reader finds the last one held."""
    from dataclasses import replace

    from agent.store.segment import SegmentFile

    bodies = []
    body = SegmentFile._body
    monkeypatch.setattr(SegmentFile, "_body", lambda self, *a: bodies.append(self.n_snapshots) or body(self, *a))
    wl = Workload(n_sites=40, rate=0.5, new_sites_per_step=3, seed=5)
    w = StoreWriter(tmp_path, META, sync=SyncPolicy("never"), checkpoint_every=3)
    for sample, expected in wl.samples(7):
        w.append(sample)
        bodies.clear()
        held = [replace(sample, wall_ns=sample.wall_ns + k * 100_000_000, time=sample.time + 100 * k, new_stacks={})
                for k in range(1, 5)]
        held[3] = replace(held[3], peak=None)  # a peak unlike the stored one's: its info says the peak moved
        for h in held:
            assert w.hold(h)
            seg = w._segment
            assert seg is not None
            full, _ = seg.encode(writer_mod._info(h), w._state, [])
            assert seg.path.read_bytes()[seg.offset:] == full
        # the held ones: one body for the first three looks (besides encode's own above), one for the moved peak
        assert bodies.count(seg.n_snapshots) == 4 + (2 if sample.peak is not None else 1)
        with StoreReader(tmp_path) as reader:
            refs = reader.snapshots()
            assert refs[-1].wall_ns == held[-1].wall_ns and reader.load(refs[-1]).sites() == expected
    w.close()
