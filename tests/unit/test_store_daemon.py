"""The daemon's side of the history store, without probes: the API's history endpoints over a real store (read by the
daemon's own code, agent.daemon.history), the recorder that keeps a full disk away from the profile, and the
command line's store options and path rules. The live store (real probes, real programs) is
tests/integration/test_store_live.py."""

from __future__ import annotations

import argparse
import errno
import json
import os
from collections.abc import Container, Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from agent.cli import build_parser, store_settings
from agent.daemon import history
from agent.errors import EnvironmentProblem, NotInHistory, UnsafePath, UsageError
from agent.model.counters import Counters
from agent.model.options import MassifOptions
from agent.model.stack import Stack
from agent.offline import history as offline
from agent.offline.commands import diff_between, diff_json
from agent.session.storerec import StoreColumns, StoreRecorder, StoreSettings, store_meta
from agent.store import StoreMeta, StoreReader, StoreWriter, SyncPolicy
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget
from tests.support.massif_reader import parse_massif
from tests.support.store_workload import Workload, site_stack

S = 1_000_000_000
META = StoreMeta(pid=4242, cmd="./app --serve", options={"depth": 30, "threshold": 1.0, "max_snapshots": 100})


def iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / S).astimezone().isoformat(timespec="microseconds")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workload, list]:  # type: ignore[type-arg]
    """120 one-second samples of 60 sites, written by the store's writer; with the expected sites per step."""
    root = tmp_path_factory.mktemp("store")
    wl = Workload(n_sites=60, start_ns=1_800_000_000 * S)
    expected = []
    with StoreWriter(root / "4242", META, sync=SyncPolicy("never"), checkpoint_every=25) as w:
        for sample, sites in wl.samples(120):
            w.append(sample)
            expected.append((sample, sites))
    return root / "4242", wl, expected


@pytest.fixture
def client(stored: tuple[Path, Workload, list]) -> Iterator[TestClient]:  # type: ignore[type-arg]
    directory, _, _ = stored
    manager = FakeManager([FakeTarget(pid=4242, store_dir=directory)])
    with TestClient(create_app(ApiSettings(), manager)) as c:  # type: ignore[arg-type]
        yield c


# ---- the history endpoints, over a real store ---------------------------------------------------------------


def test_snapshot_at_a_moment_is_the_last_stored_at_or_before_it(client: TestClient, stored) -> None:  # type: ignore[no-untyped-def]
    _, _, expected = stored
    sample, sites = expected[70]
    # half a second after sample 70: that one, not 71
    for url in ("/snapshot", "/targets/4242/history/snapshot"):
        r = client.get(url, params={"at": iso(sample.wall_ns + S // 2)})
        assert r.status_code == 200, r.text
        [snap] = parse_massif(r.text).snapshots
        assert (snap.time, snap.heap_B, snap.heap_extra_B) == (sample.time, sample.heap_B, sample.extra_B)
    r = client.get("/detailed_snapshot", params={"at": iso(sample.wall_ns), "format": "json"})
    tree = r.json()["snapshots"][0]["tree"]
    assert tree["bytes"] == sum(c.cur_bytes for c in sites.values()) == sample.heap_B


def test_all_snapshots_of_a_range_are_massifs_series_of_it(client: TestClient, stored) -> None:  # type: ignore[no-untyped-def]
    _, _, expected = stored
    first, last = expected[10][0], expected[90][0]
    r = client.get("/all_snapshots", params={"from": iso(first.wall_ns), "to": iso(last.wall_ns)})
    assert r.status_code == 200, r.text
    snaps = parse_massif(r.text).snapshots
    assert snaps[0].time == first.time and snaps[-1].time == last.time
    assert snaps[-1].heap_B == last.heap_B and snaps[-1].tree is not None
    # all of them (fewer than --max-snapshots), and the exact peak
    assert len([s for s in snaps if s.heap_tree != "peak"]) == 81 and len(snaps) == 82
    js = client.get("/targets/4242/history/all_snapshots", params={"from": iso(first.wall_ns), "format": "json"})
    assert js.json()["snapshots"][-1]["time"] == expected[-1][0].time
    # without from/to: the snapshots the (fake) target holds in memory, as before
    assert client.get("/all_snapshots").text == FakeTarget(pid=4242).render("massif")


def test_diff_endpoint_is_heapscope_diffs_json(client: TestClient, stored) -> None:  # type: ignore[no-untyped-def]
    directory, _, expected = stored
    a, b = expected[20][0].wall_ns, expected[100][0].wall_ns
    r = client.get("/diff", params={"from": iso(a), "to": iso(b)})
    assert r.status_code == 200, r.text
    with StoreReader(directory) as reader:
        want = diff_json(diff_between(reader, a, b), 1.0)
    got = r.json()
    assert {k: got[k] for k in want} == json.loads(json.dumps(want))
    # the growth is the change of the live bytes per site between the two samples
    before, after = expected[20][1], expected[100][1]
    delta = sum(c.cur_bytes for c in after.values()) - sum(c.cur_bytes for c in before.values())
    assert got["grew"]["bytes"] + got["shrank"]["bytes"] == delta == got["heap_delta_B"]
    assert client.get("/targets/4242/history/diff", params={"from": iso(a), "to": iso(b)}).json() == got
    text = client.get("/diff", params={"from": iso(a), "to": iso(b), "format": "text"})
    assert text.headers["content-type"].startswith("text/plain") and "grew:" in text.text


def test_history_says_what_the_store_holds(client: TestClient, stored) -> None:  # type: ignore[no-untyped-def]
    directory, _, expected = stored
    h = client.get("/history").json()
    assert h["enabled"] and h["directory"] == str(directory) and h["snapshots_held"] == 120
    assert h["first_wall_ns"] == expected[0][0].wall_ns and h["last_wall_ns"] == expected[-1][0].wall_ns
    assert client.get("/targets/4242/history").json() == h
    [errors] = [line for line in client.get("/metrics").text.splitlines()
                if line.startswith("heapscope_store_write_errors_total{") and 'pid="4242"' in line]
    assert errors.endswith(" 0.0")
    [quiet] = [line for line in client.get("/metrics").text.splitlines()
               if line.startswith("heapscope_store_quiet_skipped_total{") and 'pid="4242"' in line]
    assert quiet.endswith(" 3.0") and h["quiet_skipped"] == 3  # the writer's looks not stored (fake: 3)


def test_bad_times_are_400_and_moments_outside_the_history_404(client: TestClient, stored) -> None:  # type: ignore[no-untyped-def]
    _, _, expected = stored
    first = expected[0][0].wall_ns
    for params in ({"from": "yesterday", "to": "now"}, {"from": "now", "to": "-1h"}, {"from": "-1e999h", "to": "now"},
                   {"from": "99999-01-01", "to": "now"}, {"from": " ", "to": "now"}):
        r = client.get("/diff", params=params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"] == "UsageError" and "\n" not in r.json()["detail"]
    assert client.get("/diff", params={"from": "now"}).status_code == 422  # `to` missing
    r = client.get("/snapshot", params={"at": iso(first - S)})
    assert r.status_code == 404 and "no stored snapshot at or before" in r.json()["detail"]
    r = client.get("/all_snapshots", params={"from": iso(first - 100 * S), "to": iso(first - 50 * S)})
    assert r.status_code == 404 and "holds" in r.json()["detail"]
    # a query string's '+' before the zone arrives as a space: still read as the zone
    t = datetime.fromtimestamp(expected[5][0].wall_ns / S).astimezone().isoformat()
    assert "+" in t
    r = client.get(f"/snapshot?at={t}")  # an unescaped '+': a space once decoded
    assert r.status_code == 200, r.text


def test_a_target_without_a_store_is_409(tmp_path: Path) -> None:
    with TestClient(create_app(ApiSettings(), FakeManager([FakeTarget(pid=7)]))) as c:  # type: ignore[arg-type]
        for url, params in (("/diff", {"from": "-1h", "to": "now"}), ("/snapshot", {"at": "now"}),
                            ("/all_snapshots", {"from": "-1h"}), ("/targets/7/history/snapshot", {"at": "now"})):
            r = c.get(url, params=params)
            assert r.status_code == 409 and "no history" in r.json()["detail"], url
        assert c.get("/history").json()["enabled"] is False
        assert c.get("/snapshot").status_code == 200  # the live profile as ever
        assert "heapscope_store_write_errors_total{" not in c.get("/metrics").text  # no store, no store series


def test_an_empty_store_directory_is_404(tmp_path: Path) -> None:
    with pytest.raises(NotInHistory, match="no history stored"):
        history.series(tmp_path / "nothing", None, None, max_snapshots=100, detailed_freq=10)


# ---- the recorder: a full disk never reaches the profile ----------------------------------------------------


class _FullDisk:
    """Stands for the file system: refuses writes while `full`."""

    full = False

    def pwrite(self, real):  # type: ignore[no-untyped-def]
        def write(fd: int, data: bytes, offset: int) -> int:
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        return write


def _columns(n: int, step: int, stacks: dict[int, Stack]) -> StoreColumns:
    counters = np.zeros((9, n), dtype=np.int64)
    counters[0] = counters[4] = step + 1  # blocks allocated and live
    counters[1] = counters[5] = counters[7] = 64 * (step + 1)  # the peak is now
    heap = int(counters[5].sum())
    c = Counters(heap=heap, extra=0, blocks=int(counters[4].sum()), peak_total=heap, peak_heap=heap, peak_gen=step + 1)
    return StoreColumns(c, 1000 * step, 1000 * step, 0, None, np.arange(n, dtype=np.int64), counters, stacks)


def test_recorder_counts_a_full_disk_says_it_once_and_writes_again_after(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _FullDisk()
    monkeypatch.setattr(os, "pwrite", disk.pwrite(os.pwrite))
    said: list[str] = []
    opts = MassifOptions()
    settings = StoreSettings(tmp_path, sync=SyncPolicy("never"))
    rec = StoreRecorder.open(settings, store_meta(9, "prog", opts, (), 0), opts, said.append)
    stacks = {i: site_stack(i) for i in range(5)}

    def take(step: int):  # type: ignore[no-untyped-def]
        def columns(known: Container[int]) -> StoreColumns:
            return _columns(5, step, {i: s for i, s in stacks.items() if i not in known})

        return columns

    assert rec.record(take(0), rss=1 << 20)
    disk.full = True
    for step in range(1, 6):
        assert not rec.record(take(step), rss=None)  # refused: counted, not raised
    assert rec.errors == 5 and rec.status().write_errors == 5
    assert len(said) == 1 and "the disk is full" in said[0]
    disk.full = False
    assert rec.record(take(6), rss=None)
    assert "again, after 5 samples" in said[-1]
    rec.close()
    with StoreReader(tmp_path / "9") as reader:
        snaps = reader.snapshots()
        assert [r.time for r in snaps] == [0, 6000]  # nothing partial between them
        assert reader.load(snaps[-1]).column("cur_blocks").tolist() == [7] * 5
        assert not reader.skipped


def test_a_quiet_target_is_stored_as_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples whose activity token and RSS did not move are skipped until quiet_interval has passed; when the
    target moves again, its last state is stored once more at the last quiet look, then the new one."""
    opts = MassifOptions()
    rec = StoreRecorder.open(StoreSettings(tmp_path, sync=SyncPolicy("never"), quiet_interval=30.0),
                             store_meta(9, "p", opts, (), 0), opts)
    stacks = {i: site_stack(i) for i in range(3)}
    clock = [100.0]
    monkeypatch.setattr("agent.session.storerec.time.monotonic", lambda: clock[0])
    taken: list[int] = []

    def take(step: int):  # type: ignore[no-untyped-def]
        def columns(known: Container[int]) -> StoreColumns:
            taken.append(step)
            return _columns(3, step, {i: s for i, s in stacks.items() if i not in known})

        return columns

    assert rec.record(take(0), rss=4096, token=b"a", now=lambda: 0)
    for t in range(1, 6):  # quiet: the same token and RSS
        clock[0] += 1
        assert rec.record(take(t), rss=4096, token=b"a", now=lambda t=t: 1000 * t)  # type: ignore[misc]
    assert taken == [0] and rec.quiet_skipped == 5 and rec.status().quiet_skipped == 5
    clock[0] += 1
    assert rec.record(take(6), rss=8192, token=b"a", now=lambda: 6000)  # the RSS moved: stored
    clock[0] += 1
    assert rec.record(take(7), rss=8192, token=b"b", now=lambda: 7000)  # the counters moved: stored
    for t in range(8, 8 + 31):  # quiet for longer than quiet_interval: stored again once it has passed
        clock[0] += 1
        rec.record(take(t), rss=8192, token=b"b", now=lambda t=t: 1000 * t)  # type: ignore[misc]
    assert taken == [0, 6, 7, 37]
    rec.close()
    with StoreReader(tmp_path / "9") as reader:
        snaps = reader.snapshots()
        # 5000: the state of 0 held until the last quiet look before the RSS moved
        assert [r.time for r in snaps] == [0, 5000, 6000, 7000, 37000]  # 37000: quiet_interval passed
        held = reader.load(snaps[1])
        assert held.column("cur_blocks").tolist() == [1] * 3 and held.rss_B == 4096
        assert reader.load(snaps[2]).column("cur_blocks").tolist() == [7] * 3
        assert reader.at(snaps[0].wall_ns + 1) is not None


def test_recorder_survives_an_error_of_its_own(tmp_path: Path) -> None:
    said: list[str] = []
    opts = MassifOptions()
    rec = StoreRecorder.open(StoreSettings(tmp_path, sync=SyncPolicy("never")), store_meta(9, "p", opts, (), 0),
                             opts, said.append)

    def broken(known: Container[int]) -> StoreColumns:
        raise KeyError("a bug")

    assert not rec.record(broken, rss=None)
    assert rec.errors == 1 and "KeyError" in said[0]
    rec.close()


def test_recorder_leaves_ignore_fn_sites_out_of_the_totals(tmp_path: Path) -> None:
    opts = MassifOptions(ignore_fns=["alloc_site_1"])
    rec = StoreRecorder.open(StoreSettings(tmp_path, sync=SyncPolicy("never")), store_meta(9, "p", opts, (), 0), opts)
    stacks = {i: site_stack(i) for i in range(3)}
    assert rec.record(lambda known: _columns(3, 0, stacks), rss=None)
    rec.close()
    with StoreReader(tmp_path / "9") as reader:
        [ref] = reader.snapshots()
        assert ref.info["heap"] == 2 * 64 and ref.peak is not None and ref.peak.heap_B == 2 * 64


def test_a_symbolic_link_for_a_targets_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "9").symlink_to(tmp_path / "elsewhere")
    opts = MassifOptions()
    with pytest.raises(EnvironmentProblem, match="not a plain directory"):
        StoreRecorder.open(StoreSettings(tmp_path / "store"), store_meta(9, "p", opts, (), 0), opts)


# ---- the command line ----------------------------------------------------------------------------------------


def _ns(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(list(args))


def test_store_options_of_run_and_attach(tmp_path: Path) -> None:
    s = store_settings(_ns("attach", "--store", str(tmp_path / "st"), "--store-interval", "0.5", "--store-sync",
                           "always", "--store-max-size", "1G", "--store-max-age", "2d", "--store-thin", "1h:10s", "7"))
    assert s is not None and s.root == tmp_path / "st" and s.root.is_dir()
    assert s.interval == 0.5 and s.sync.mode == "always"
    assert s.retention.max_bytes == 1 << 30 and s.retention.max_age_s == 2 * 86400
    assert [(r.older_than_s, r.keep_every_s) for r in s.retention.thin] == [(3600, 10)]
    assert s.directory(7) == tmp_path / "st" / "7"
    assert s.quiet_interval == 60.0
    quiet = store_settings(_ns("attach", "--store", str(tmp_path / "st"), "--store-quiet-interval", "5", "7"))
    assert quiet is not None and quiet.quiet_interval == 5.0
    assert store_settings(_ns("attach", "7")) is None  # off unless asked for
    with pytest.raises(UsageError):
        store_settings(_ns("attach", "--store", str(tmp_path), "--store-thin", "1h", "7"))
    with pytest.raises(UsageError):
        _ns("attach", "--store-max-size", "lots", "7")


def test_serve_keeps_a_store_under_the_output_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    s = store_settings(_ns("serve"), out)
    assert s is not None and s.root == (out / "store").resolve()
    s = store_settings(_ns("serve", "--store", "hist/a"), out)
    assert s is not None and s.root == (out / "hist" / "a").resolve()
    assert store_settings(_ns("serve", "--no-store"), out) is None
    for outside in ("../x", str(tmp_path / "x"), "/tmp", ".", "hist/../.."):
        with pytest.raises(UnsafePath):
            store_settings(_ns("serve", "--store", outside), out)
    (out / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="outside the output directory"):
        store_settings(_ns("serve", "--store", "link/x"), out)
    with pytest.raises(UsageError, match="contradict"):
        store_settings(_ns("serve", "--no-store", "--store", "x"), out)


def test_offline_diff_and_the_daemons_agree(stored) -> None:  # type: ignore[no-untyped-def]
    directory, _, expected = stored
    a, b = expected[3][0].wall_ns, expected[40][0].wall_ns
    d = history.diff(directory, iso(a), iso(b), 0.0)
    with StoreReader(directory) as reader:
        want = offline.diff(reader.at(a), reader.at(b), offline.Trimmer(META.options), META.root_label)  # type: ignore[arg-type]
    assert d.document["grew"]["bytes"] == want.grew.bytes  # type: ignore[index]
    assert d.document["shrank"]["bytes"] == want.shrank.bytes  # type: ignore[index]


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 9, 64, 101])
def test_extent_from_the_tail_agrees_with_the_index(tmp_path: Path, steps: int) -> None:
    wl = Workload(n_sites=5, start_ns=1_800_000_000 * S)
    with StoreWriter(tmp_path, META, sync=SyncPolicy("never"), checkpoint_every=10) as w:
        for sample, _ in wl.samples(steps):
            w.append(sample)
    with StoreReader(tmp_path) as reader:
        fast = reader.extent()
    with StoreReader(tmp_path) as reader:
        refs = reader.snapshots()
        assert fast == (len(refs), refs[0].wall_ns, refs[-1].wall_ns) and fast[0] == steps
    # a torn tail, into the last snapshot's TOC: no outer TOC at the end, so the index (a scan) says it
    [seg] = sorted(tmp_path.glob("seg-*.hss"))
    seg.write_bytes(seg.read_bytes()[: refs[-1].toc.end - 3])
    with StoreReader(tmp_path) as reader:
        n, _, last = reader.extent()
        assert n == steps - 1 and (n == 0 or last == refs[n - 1].wall_ns)
        assert reader.skipped


class _Quiet:
    """A recorder at quiet_interval 60 s on a clock the test moves, and the columns of `sites` sites at a step."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sites: int) -> None:
        opts = MassifOptions()
        self.rec = StoreRecorder.open(StoreSettings(tmp_path, sync=SyncPolicy("never"), quiet_interval=60.0),
                                      store_meta(9, "p", opts, (), 0), opts)
        self.stacks = {i: site_stack(i) for i in range(sites)}
        self.clock = [100.0]
        monkeypatch.setattr("agent.session.storerec.time.monotonic", lambda: self.clock[0])

    def look(self, step: int, token: bytes, rss: int) -> bool:
        """One look, a second after the last, at profile time 1000 * step."""
        self.clock[0] += 1
        stacks = self.stacks
        return self.rec.record(lambda known: _columns(len(stacks), step, {i: s for i, s in stacks.items()
                                                                          if i not in known}),
                               rss=rss, token=token, now=lambda: 1000 * step)


def test_a_moving_target_is_stored_at_every_look_whichever_of_token_and_rss_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quiet test needs both to stand still: the kernel's token moving with the RSS equal is a sample, and so
    is the RSS moving with the token equal."""
    q = _Quiet(tmp_path, monkeypatch, 2)
    looks = [(b"t0", 4096), (b"t1", 4096), (b"t2", 4096), (b"t2", 8192), (b"t2", 12288), (b"t3", 12288)]
    assert all(q.look(step, token, rss) for step, (token, rss) in enumerate(looks))
    assert q.rec.quiet_skipped == 0
    q.rec.close()
    with StoreReader(tmp_path / "9") as reader:
        snaps = reader.snapshots()
        assert [r.time for r in snaps] == [0, 1000, 2000, 3000, 4000, 5000]
        assert [reader.load(r).rss_B for r in snaps] == [rss for _, rss in looks]


def test_a_history_cut_during_a_quiet_stretch_reaches_its_last_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heapscope killed (no close) while its target is quiet: the segment ends with the step up to the last quiet
    look, which each look writes over the one before; a sample written after it goes over it; a close in order
    ends the segment at its last stored sample. Nothing is ever skipped by the reader."""
    q = _Quiet(tmp_path, monkeypatch, 3)
    def times() -> list[int]:  # as a reader sees the directory now, the writer still open (a SIGKILL's view)
        with StoreReader(tmp_path / "9") as reader:
            assert not reader.skipped, reader.skipped
            snaps = reader.snapshots()
            assert reader.load(snaps[-1]).column("cur_blocks").tolist() == [last_stored[0] + 1] * 3
            return [r.time for r in snaps]

    last_stored = [0]
    assert q.look(0, b"a", 4096)
    for t in range(1, 6):
        assert q.look(t, b"a", 4096)
        assert times() == [0, 1000 * t]  # the step so far, at this look
    assert q.rec.status().snapshots_written == 1 and q.rec.quiet_skipped == 5
    last_stored[0] = 6
    assert q.look(6, b"b", 4096)  # moves: the step, then the new state
    assert times() == [0, 5000, 6000]
    for t in range(7, 10):
        assert q.look(t, b"b", 4096)
    assert times() == [0, 5000, 6000, 9000]
    q.rec.close()
    assert times() == [0, 5000, 6000]


def test_the_end_of_run_summary_says_what_the_history_stored_and_skipped() -> None:
    from agent.model.counters import Counters
    from agent.model.stored import StoreStatus
    from agent.model.summary import ProfileSummary

    st = StoreStatus("/s/9", snapshots_written=12, quiet_skipped=40, bytes_written=9000, write_errors=2,
                     last_error="store: cannot write /s/9: the disk is full")
    [line] = [ln for ln in ProfileSummary(Counters(), store=st).lines() if ln.startswith("history:")]
    assert "12 samples stored in /s/9" in line and "40 looks" in line and "NOT STORED: 2 samples" in line
    assert ProfileSummary(Counters(), store=st).to_json()["store"]["quiet_skipped"] == 40
    assert not [ln for ln in ProfileSummary(Counters()).lines() if ln.startswith("history:")]
