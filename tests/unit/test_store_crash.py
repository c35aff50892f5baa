"""Crash tolerance of the store: torn files, damaged blocks, a full disk and a writer killed mid-write. The
reader recovers every complete snapshot and reports what it skipped; a full disk is one clear error."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.store import StoreMeta, StoreReader, StoreWriter, SyncPolicy
from agent.store import format as fmt
from agent.store.files import segment_paths
from agent.store.reader import SegmentReader, SnapshotUnavailable
from tests.support import store_spec_reader
from tests.support.store_workload import Workload

ROOT = Path(__file__).resolve().parents[2]
META = StoreMeta(pid=9, cmd="./victim")


def write_segment(directory: Path, wl: Workload, steps: int, every: int) -> tuple[Path, list]:
    truth = []
    with StoreWriter(directory, META, sync=SyncPolicy("never"), checkpoint_every=every) as w:
        for sample, expected in wl.samples(steps):
            w.append(sample)
            truth.append(expected)
    (path,) = segment_paths(directory)
    return path, truth


def boundaries(path: Path) -> tuple[list[int], set[int]]:
    """End of each snapshot's snaptoc, and the offsets where a file may end with nothing to report: after the
    filemeta, after a snapshot's TOC (its outer TOC is missing, but no data), after the outer TOC's offset."""
    seg = SegmentReader(path)
    data = path.read_bytes()
    ends = [r.toc.end for r in seg.snapshots()]
    clean = {16 + len(fmt.json_block(fmt.K_FILEMETA, seg.filemeta)), *ends}
    at = len(data)
    (outer,) = fmt.U64.unpack_from(data, at - 8)
    # every snapshot ends 8 bytes after its outertoc: walk the snaptocs' successors
    for e in ends:
        b = fmt.read_block(data, e)
        assert b.kind == fmt.K_OUTERTOC
        clean.add(b.end + 8)
    assert outer == fmt.read_block(data, ends[-1]).start
    return ends, clean


def check_cut(
    src: bytes, cut: int, dest: Path, ends: list[int], clean: set[int], truth: list, last: int | None = None
) -> None:
    dest = dest.with_name(f"cut-{cut}.hss")  # a fresh file: truncating one in place is slow on overlayfs
    dest.write_bytes(src[:cut])
    with StoreReader(dest) as reader:
        refs = reader.snapshots()
        complete = sum(1 for e in ends if e <= cut)
        assert len(refs) == complete, cut
        for k, ref in enumerate(refs):
            if last is None or k >= len(refs) - last:
                assert reader.load(ref).sites() == truth[k], (cut, k)
        if cut in clean:
            assert reader.skipped == [], cut
        else:
            assert reader.skipped, cut  # a torn tail (or a torn header) is reported, never silent
            assert all(s.snapshots == 0 for s in reader.skipped), cut  # ...and no complete snapshot is lost
    dest.unlink()


def test_every_possible_truncation_of_a_small_file(tmp_path: Path) -> None:
    path, truth = write_segment(tmp_path / "w", Workload(n_sites=3, rate=2.0), 3, every=2)
    src = path.read_bytes()
    ends, clean = boundaries(path)
    assert len(src) < 6000
    dest = tmp_path / "cut.hss"
    for cut in range(len(src) + 1):
        check_cut(src, cut, dest, ends, clean, truth)


def test_random_truncations_of_a_larger_file(tmp_path: Path) -> None:
    path, truth = write_segment(tmp_path / "w", Workload(n_sites=400, new_sites_per_step=9), 40, every=7)
    src = path.read_bytes()
    ends, clean = boundaries(path)
    rng = random.Random(15)
    dest = tmp_path / "cut.hss"
    cuts = [*rng.sample(range(len(src)), 150), *clean]
    for i, cut in enumerate(cuts):
        check_cut(src, cut, dest, ends, clean, truth, last=2)  # the last two: they need all before them
        if i % 10 == 0 and cut >= min(clean):
            dest.write_bytes(src[:cut])
            spec = store_spec_reader.read_segment(str(dest))
            assert len(spec.snapshots) == sum(1 for e in ends if e <= cut)


def _blocks_of(path: Path, seq: int) -> dict[bytes, fmt.TocEntry]:
    seg = SegmentReader(path)
    ref = seg.snapshots()[seq]
    toc = fmt.decode_toc(fmt.read_block(path.read_bytes(), ref.toc.start))
    return {e.kind: e for e in toc}


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_counter_block_costs_the_snapshots_up_to_the_next_checkpoint(tmp_path: Path) -> None:
    path, truth = write_segment(tmp_path, Workload(n_sites=100), 30, every=10)
    block = _blocks_of(path, 13)[b"c_totbk"]
    flip(path, (block.start + block.end) // 2)
    reader = StoreReader(path)
    refs = reader.snapshots()
    assert len(refs) == 30  # the index is whole: the outer TOCs are intact
    good = []
    for ref in refs:
        try:
            assert reader.load(ref).sites() == truth[ref.seq]
            good.append(ref.seq)
        except SnapshotUnavailable:
            pass
    assert good == [*range(13), *range(20, 30)]
    (skip,) = reader.skipped
    assert skip.snapshots == 7 and "checksum mismatch" in skip.reason and "13..19" in skip.what
    spec = store_spec_reader.read_segment(str(path))
    assert [info["seq"] for info, _ in spec.snapshots] == good


def test_a_damaged_header_is_stepped_over_by_the_scan(tmp_path: Path) -> None:
    path, truth = write_segment(tmp_path, Workload(n_sites=50), 25, every=5)
    info = _blocks_of(path, 8)[b"snapinfo"]
    flip(path, info.start + 2)  # its kind name: the block is no longer recognisable
    data = path.read_bytes()
    flip(path, len(data) - 3)  # and the tail offset: the outer TOC chain cannot be followed
    reader = StoreReader(path)
    refs = reader.snapshots()
    assert [r.seq for r in refs] == [s for s in range(25) if s != 8]
    got = []
    for ref in refs:
        try:
            assert reader.load(ref).sites() == truth[ref.seq]
            got.append(ref.seq)
        except SnapshotUnavailable:
            pass
    assert got == [*range(8), *range(10, 25)]  # 9 needs 8; 10 is a checkpoint
    reasons = " | ".join(str(s) for s in reader.skipped)
    assert "unknown block kind" in reasons and "snapshot 8 is missing" in reasons
    assert sum(s.snapshots for s in reader.skipped) >= 2


def test_a_damaged_table_block_costs_the_rest_of_the_segment(tmp_path: Path) -> None:
    path, _ = write_segment(tmp_path, Workload(n_sites=100, new_sites_per_step=10), 20, every=5)
    flip(path, _blocks_of(path, 3)[b"stk_frm"].start + 25)
    reader = StoreReader(path)
    assert reader.verify() == 3
    (skip,) = reader.skipped
    assert skip.snapshots == 17 and "stack tables" in skip.reason


FULL_DISK_CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from agent.errors import HeapscopeError
    from agent.store import StoreMeta, StoreWriter, SyncPolicy
    from tests.support.store_workload import Workload

    directory, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death: the same as a full disk to us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    w = StoreWriter(directory, StoreMeta(pid=1, cmd="x"), sync=SyncPolicy("always"))
    ok = errors = 0
    for sample, _ in Workload(n_sites=200).samples(60):
        try:
            w.append(sample)
            ok += 1
        except HeapscopeError as exc:  # what the session does: count it, say it once, profile on
            if not errors:
                print(f"heapscope: {exc}", file=sys.stderr)
            errors += 1
    w.close()
    print(ok, errors, w.stats.write_errors)
    """
)


def test_a_full_disk_is_one_clear_error_and_the_store_stays_readable(tmp_path: Path) -> None:
    limit = 60_000
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path), str(limit)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ok, errors, counted = map(int, proc.stdout.split())
    assert ok > 0 and errors > 0 and counted == errors and ok + errors == 60
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "the disk is full" in proc.stderr
    (path,) = segment_paths(tmp_path)
    assert path.stat().st_size <= limit
    reader = StoreReader(tmp_path)
    assert reader.skipped == []
    truth = [e for _, e in Workload(n_sites=200).samples(ok)]
    assert [reader.load(r).sites() for r in reader.snapshots()] == truth


@pytest.mark.needs("root", "mount")  # mounting a tmpfs
def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        w = StoreWriter(mnt / "9", META, sync=SyncPolicy("always"))
        ok = 0
        errors = []
        for sample, _ in Workload(n_sites=200).samples(200):
            try:
                w.append(sample)
                ok += 1
            except Exception as exc:  # must be the one clear error
                errors.append(exc)
        w.close()
        assert errors and all(type(e).__name__ == "StoreWriteError" for e in errors)
        assert "the disk is full" in str(errors[0])
        with StoreReader(mnt / "9") as reader:
            truth = [e for _, e in Workload(n_sites=200).samples(ok)]
            assert [reader.load(r).sites() for r in reader.snapshots()] == truth
            assert reader.skipped == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


KILLED_CHILD = textwrap.dedent(
    """
    import sys
    from agent.store import StoreMeta, StoreWriter, SyncPolicy
    from tests.support.store_workload import Workload

    w = StoreWriter(sys.argv[1], StoreMeta(pid=1, cmd="x"), sync=SyncPolicy("interval", 1.0), checkpoint_every=8)
    for k, (sample, _) in enumerate(Workload(n_sites=3000, seed=5).samples(10_000)):
        w.append(sample)
        print(k + 1, flush=True)
    """
)


@pytest.mark.parametrize("delay_ms", [0, 3, 11])
def test_sigkill_mid_write_loses_nothing_that_was_written(tmp_path: Path, delay_ms: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    done = 0
    while done < 20:
        done = int(proc.stdout.readline())
    import time

    time.sleep(delay_ms / 1000)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    done = int(rest[-1]) if rest else done
    reader = StoreReader(tmp_path)
    refs = reader.snapshots()
    # every append that returned is in the file (the page cache outlives the process); one more may be whole
    assert done <= len(refs) <= done + 1
    truth = [e for _, e in Workload(n_sites=3000, seed=5).samples(len(refs))]
    for ref in refs[-10:]:
        assert reader.load(ref).sites() == truth[ref.seq]
    assert all(s.snapshots == 0 for s in reader.skipped)  # at most a torn tail, never a complete snapshot
