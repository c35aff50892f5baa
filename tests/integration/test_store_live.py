"""The history store written by live profiles: `run --store`, `attach --store` and `serve` (which keeps a store by
default), read back by `heapscope report` (its files by the real ms_print and callgrind_annotate), `heapscope
diff` and the daemon's history endpoints; a heapscope killed mid-profile, and a full disk.

Programs: daemon_target.c (5 x 1000 B at site_small and 3 x 4000 B at site_big, then frees the small ones, each on
a line of stdin), web_growth.c (a known growth of 40 x 25000 B at grow_site on a line of stdin), store_busy.c
(allocates without pause at many stacks, printing its count of allocations every 100 ms).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from agent.store import StoreReader
from tests.support.daemon import Daemon, Target, attach, run_tool, start_daemon, stop_daemon
from tests.support.massif_reader import parse_massif, paths
from tests.support.sources import source_line
from tests.support.store_spec_reader import read_segment
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

INTERVAL = 0.2  # --store-interval of these tests: several stored samples a second
EVERY = ("--store-quiet-interval", str(INTERVAL))  # every look stored, quiet or not (the quiet test below: not)


SMALL = f"site_small (daemon_target.c:{source_line('daemon_target.c', 'small[i] = malloc(1000)')})"
BIG = f"site_big (daemon_target.c:{source_line('daemon_target.c', 'big[i] = malloc(4000)')})"
GROW = f"grow_site (web_growth.c:{source_line('web_growth.c', 'grown[i] = malloc(25000)')})"
GROWTH_B = 40 * 25000


def moment() -> str:
    """Now, as an ISO 8601 time with microseconds and zone (what a user may type, to the microsecond)."""
    return datetime.now().astimezone().isoformat(timespec="microseconds")


def more_samples(directory: Path, n: int, what: str) -> None:
    """Wait for `n` more stored samples than there are now (looks at the target, not seconds)."""
    have = len(stored_heaps(directory))
    wait_for(lambda: len(stored_heaps(directory)) >= have + n, 60, what)


def nonzero(tree: dict[tuple[str, ...], int]) -> dict[tuple[str, ...], int]:
    return {p: b for p, b in tree.items() if b}


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("seg-*.hss"))


def stored_heaps(directory: Path) -> list[int]:
    """The heap of every snapshot stored so far (the writer may be appending meanwhile)."""
    with StoreReader(directory) as reader:
        return [int(ref.info.get("heap", -1)) for ref in reader.snapshots()]


def heapscope(cmd: list[str], *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def report_json(cmd: list[str], store: Path, pid: int, cwd: Path) -> tuple[dict, str]:  # type: ignore[type-arg]
    done = heapscope(cmd, "report", str(store), "--pid", str(pid), "--format=json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


class Busy:
    """store_busy running with its stdin open, its progress lines read by a thread."""

    def __init__(self, program: Path, sites: int) -> None:
        env = {**os.environ, "STORE_BUSY_STDIN": "1"}
        self.proc = subprocess.Popen([str(program), str(sites), "600"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.counts: list[tuple[float, int]] = []  # (monotonic time, allocations so far)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_for(lambda: len(self.counts) > 2, 10, "store_busy's first progress lines")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.counts.append((time.monotonic(), int(line)))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def allocations_since(self, t: float) -> int:
        """Allocations made after monotonic time `t` (from its progress lines)."""
        before = [n for at, n in self.counts if at <= t]
        after = [n for at, n in self.counts if at > t]
        if not before or not after:
            return 0
        return after[-1] - before[-1]

    def end(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def busy_program(build: Callable[..., Path]) -> Path:
    return build("store_busy.c")


# ---- attach --store / run --store, then report and diff -----------------------------------------------------


def test_attach_store_report_is_read_by_ms_print_and_callgrind_annotate(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    target = Target(build("daemon_target.c"))
    prof = subprocess.Popen(
        [*heapscope_cmd, "attach", "--mode=exact", "--store", str(store), "--store-interval", str(INTERVAL), *EVERY,
         "--massif-out-file=live.out", "--xtree-memory=full", str(target.pid)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        directory = store / str(target.pid)
        wait_for(lambda: bool(segments(directory)), 60, "the first stored sample")
        target.step("allocated")
        # The first new sites are symbolized first (DWARF read once, seconds on a loaded machine): wait for
        # stored samples of each state rather than a fixed time.
        wait_for(lambda: stored_heaps(directory).count(17000) >= 3, 60, "samples of the allocated state")
        t_allocated = moment()
        target.step("freed")
        wait_for(lambda: stored_heaps(directory)[-1:] == [12000], 60, "a sample of the freed state")
        more_samples(directory, 2, "two more samples of the freed state")
        t_freed = moment()
        more_samples(directory, 2, "two samples after the moment the diff ends at")
        prof.send_signal(signal.SIGINT)
        _, err = prof.communicate(timeout=60)
        assert prof.returncode == 0, err
        assert f"keeping the history in {directory}" in err
    finally:
        target.kill()
        if prof.poll() is None:
            prof.kill()

    # massif.out of the whole history, read by ms_print: the peak (17,000 B with both sites) and the end.
    done = heapscope(heapscope_cmd, "report", str(store), "--pid", str(target.pid), "-o", "report.out",
                     "--detailed-freq=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "skipped" not in done.stderr
    report = (tmp_path / "report.out").read_text()
    printed = run_tool(["ms_print"], report, tmp_path, "report.out")
    assert "site_big (daemon_target.c:" in printed
    parsed = parse_massif(report)
    peak = [s for s in parsed.snapshots if s.heap_tree == "peak"]
    assert len(peak) == 1 and peak[0].heap_B == 17000
    at_peak = paths(peak[0].tree)
    assert at_peak[(BIG,)] == 12000 and at_peak[(SMALL,)] == 5000
    final = parsed.snapshots[-1]
    assert final.heap_B == 12000 and final.tree is not None
    at_end = paths(final.tree)
    assert at_end[(BIG,)] == 12000 and at_end.get((SMALL,), 0) == 0
    # The live profile's own massif.out ends where the history ends.
    live = parse_massif((tmp_path / "live.out").read_text())
    assert live.snapshots[-1].heap_B == final.heap_B
    assert max(s.heap_B for s in live.snapshots) == 17000

    # Every stored sample is there, not only Massif's culled hundred: more snapshots than the file keeps.
    doc, _ = report_json(heapscope_cmd, store, target.pid, tmp_path)
    assert len(doc["snapshots"]) >= 8
    assert [s["heap_B"] for s in doc["snapshots"]].count(17000) >= 3

    # The xtree of the range's end, read by callgrind_annotate.
    done = heapscope(heapscope_cmd, "report", str(store), "--pid", str(target.pid), "--format=xtree",
                     "-o", "report.kcg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    annotated = run_tool(["callgrind_annotate", "--inclusive=yes"], (tmp_path / "report.kcg").read_text(),
                         tmp_path, "report.kcg")
    assert "12,000" in annotated and "site_big" in annotated

    # diff between two moments: the small site's 5,000 B went, nothing grew.
    done = heapscope(heapscope_cmd, "diff", str(store), "--pid", str(target.pid), "--from", t_allocated,
                     "--to", t_freed, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert d["heap_delta_B"] == -5000 and d["grew"]["bytes"] == 0
    assert d["shrank"]["bytes"] == -5000 and d["shrank"]["blocks"] == -5
    [site] = d["shrank"]["children"]
    assert site["label"].endswith(SMALL) and site["bytes"] == -5000


def test_run_store_matches_the_runs_own_massif_out(heapscope_cmd: list[str], build: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    program = build("sites.c")
    store = tmp_path / "store"
    # A short run: every call is a snapshot, detailed with --detailed-freq=1, so the file's last one is the end
    # state (a massif.out ends at its last snapshot, as Massif's), and its peak snapshot is the exact peak.
    done = heapscope(heapscope_cmd, "run", "--store", str(store), "--massif-out-file=run.out", "--time-unit=B",
                     "--detailed-freq=1", "--", str(program), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [pid_dir] = list(store.iterdir())
    assert segments(pid_dir)
    live = parse_massif((tmp_path / "run.out").read_text())

    done = heapscope(heapscope_cmd, "report", str(store), "-o", "report.out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = (tmp_path / "report.out").read_text()
    run_tool(["ms_print"], report, tmp_path, "report.out")
    stored = parse_massif(report)
    assert stored.time_unit == "B" and stored.cmd == live.cmd
    # The final state and the exact peak are the run's.
    assert stored.snapshots[-1].heap_B == live.snapshots[-1].heap_B
    assert stored.snapshots[-1].heap_extra_B == live.snapshots[-1].heap_extra_B
    assert paths(stored.snapshots[-1].tree) == paths(live.snapshots[-1].tree)
    [live_peak] = [s for s in live.snapshots if s.heap_tree == "peak"]
    [stored_peak] = [s for s in stored.snapshots if s.heap_tree == "peak"]
    assert (stored_peak.time, stored_peak.heap_B) == (live_peak.time, live_peak.heap_B)
    # The live file's peak tree is Massif's, of its instant: no node for a site yet to allocate, which the stored
    # one, built from the sites' peak counters, holds at 0 bytes.
    assert nonzero(paths(stored_peak.tree)) == nonzero(paths(live_peak.tree))


# ---- a quiet target ------------------------------------------------------------------------------------------


def test_a_quiet_target_is_stored_as_a_step_and_once_a_quiet_interval(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    """A sleeping target is not stored at every look: nothing moved. When it moves, the state it held is stored
    once more at the last quiet look before the new one, and a target that stays quiet is still stored once a
    --store-quiet-interval."""
    store = tmp_path / "store"
    target = Target(build("daemon_target.c"))
    quiet_s = 3.0
    prof = subprocess.Popen(
        [*heapscope_cmd, "attach", "--mode=exact", "--store", str(store), "--store-interval", str(INTERVAL),
         "--store-quiet-interval", str(quiet_s), str(target.pid)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    directory = store / str(target.pid)
    try:
        wait_for(lambda: bool(segments(directory)), 60, "the first stored sample")
        time.sleep(1.5)  # a span to observe, not a wait: about 7 looks at a sleeping target store nothing new
        before = stored_heaps(directory)
        assert len(before) <= 2, before  # its first samples (attach, then the first look), not one a look
        target.step("allocated")
        wait_for(lambda: 17000 in stored_heaps(directory), 60, "a sample of the allocated state")
        time.sleep(INTERVAL * 3)  # a span to observe: three looks after the step store at most the step again
        after_step = stored_heaps(directory)
        with StoreReader(directory) as reader:
            step_time = next(r.time for r in reader.snapshots() if int(r.info["heap"]) == 17000)

        def stored_again() -> bool:  # a sample stored for real after the step (not only the held last look)
            with StoreReader(directory) as reader:
                refs = reader.snapshots()
                return any(int(r.info["heap"]) == 17000 and r.time > step_time for r in refs[:-1])

        wait_for(stored_again, quiet_s + 10, "the quiet target stored again once the quiet interval passed")
        with StoreReader(directory) as reader:
            later_stored = [(r.time, int(r.info["heap"])) for r in reader.snapshots()]
        later = [heap for _, heap in later_stored]
        prof.send_signal(signal.SIGINT)
        _, err = prof.communicate(timeout=60)
        assert prof.returncode == 0, err
    finally:
        target.kill()
        if prof.poll() is None:
            prof.kill()
    first = after_step.index(17000)
    # The state before the step, held until the last quiet look just before it: stored once more.
    assert first >= 2 and after_step[first - 1] == after_step[first - 2] == before[-1]
    # The step, maybe one look while symbolizing it, and the last quiet look held at the end (StoreWriter.hold)
    assert after_step[first:].count(17000) <= 3
    # Stored again once the quiet interval passed, not at every look; the last look held at the end
    stored = [t for t, heap in later_stored[first:] if heap == 17000]
    assert 2 <= len(stored) <= 5 and later.count(17000) == len(stored), later
    assert later_stored[-1][0] - step_time >= quiet_s * 1000 * 0.9  # the history reaches past the quiet interval
    with StoreReader(directory) as reader:
        refs = reader.snapshots()
        held, new = refs[first - 1], refs[first]
        assert held.time > refs[first - 2].time and new.wall_ns - held.wall_ns < 2e9  # a step, not a ramp


# ---- SIGKILL of heapscope mid-profile ------------------------------------------------------------------------


def test_sigkill_mid_profile_target_runs_on_and_report_recovers_every_flushed_snapshot(
    heapscope_cmd: list[str], busy_program: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    busy = Busy(busy_program, 200)
    prof = subprocess.Popen(
        [*heapscope_cmd, "attach", "--mode=exact", "--store", str(store), "--store-interval", str(INTERVAL), *EVERY,
         str(busy.pid)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    directory = store / str(busy.pid)
    try:
        wait_for(lambda: bool(segments(directory)), 60, "the first stored sample")
        wait_for(lambda: len(stored_heaps(directory)) >= 3.0 / INTERVAL, 60, "several stored samples")
        killed_at_ns = time.time_ns()
        killed_at = time.monotonic()
        prof.kill()  # SIGKILL: no detach, no final sample, no close
        prof.wait(30)
        # The target runs on: the kernel removed the probes with heapscope's descriptors, and it allocates on.
        wait_for(lambda: busy.allocations_since(killed_at + 0.2) > 10_000 or busy.proc.poll() is not None, 30,
                 "the target's allocations after the kill")
        assert busy.proc.poll() is None
        assert busy.allocations_since(killed_at + 0.2) > 10_000
        assert busy.end() == 0
    finally:
        busy.kill()
        if prof.poll() is None:
            prof.kill()

    # What was written, read by the reader written from the spec page alone (tests/support/store_spec_reader.py):
    # every snapshot whose table of contents reached the file.
    [seg] = segments(directory)
    raw = seg.read_bytes()
    spec = read_segment(str(seg))
    written = len(spec.snapshots)
    doc, err = report_json(heapscope_cmd, store, busy.pid, tmp_path)
    recovered = len(doc["snapshots"])
    assert written >= 3.0 / INTERVAL * 0.5  # several a second, while it ran
    assert recovered == written, err
    assert [s["wall_ns"] for s in doc["snapshots"]] == [info["wall_ns"] for info, _ in spec.snapshots]
    if spec.skipped:  # killed in the middle of a write: that snapshot is the reader's to report
        assert "skipped" in err and "incomplete snapshot" in err, err
    else:
        assert "skipped" not in err, err
    # ... and everything up to the kill is there: the last sample is at most an interval (and a slow one) old.
    assert killed_at_ns - doc["snapshots"][-1]["wall_ns"] < (INTERVAL + 1.0) * 1e9
    assert doc["snapshots"][-1]["heap_B"] > 0

    # A write torn by the kill: cut the file in the middle of its last snapshot. The reader recovers the rest
    # and says what it skipped.
    with StoreReader(directory) as reader:
        last = reader.snapshots()[-1]
        before_last = reader.snapshots()[-2].toc.end
    torn = tmp_path / "torn" / str(busy.pid)
    torn.mkdir(parents=True)
    (torn / seg.name).write_bytes(raw[: (before_last + last.toc.end) // 2])
    doc2, err2 = report_json(heapscope_cmd, tmp_path / "torn", busy.pid, tmp_path)
    assert len(doc2["snapshots"]) == recovered - 1
    assert "skipped" in err2 and "bytes at the end" in err2, err2


# ---- the daemon: its default store, the history endpoints -------------------------------------------------


@pytest.fixture
def store_daemon(heapscope_cmd: list[str], tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(heapscope_cmd, tmp_path, "--store-interval", str(INTERVAL), *EVERY)
    yield d
    stop_daemon(d)


def held(client: httpx.Client, pid: int) -> dict:  # type: ignore[type-arg]
    r = client.get(f"/targets/{pid}/history")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_daemon_diff_endpoint_gives_exactly_the_known_growth(
    store_daemon: Daemon, heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    target = Target(build("web_growth.c"))
    try:
        with store_daemon.client() as client:
            attach(client, target.pid)
            # serve keeps a store under --output-dir by default
            directory = store_daemon.out_dir / "store" / str(target.pid)
            wait_for(lambda: held(client, target.pid)["snapshots_held"] >= 3, 30, "stored samples")
            assert segments(directory)
            h = held(client, target.pid)
            assert h["enabled"] and Path(h["directory"]) == directory and h["write_errors"] == 0

            t1, t1_ns = moment(), time.time_ns()
            wait_for(lambda: held(client, target.pid)["last_wall_ns"] > t1_ns, 30, "a sample after the diff's start")
            target.step("grown")
            grown_ns = time.time_ns()
            wait_for(lambda: held(client, target.pid)["last_wall_ns"] > grown_ns + 10**8, 30, "a sample after")
            t2 = moment()

            for url in ("/diff", f"/targets/{target.pid}/history/diff"):
                r = client.get(url, params={"from": t1, "to": t2})
                assert r.status_code == 200, r.text
                d = r.json()
                assert d["heap_delta_B"] == GROWTH_B
                assert d["grew"]["bytes"] == GROWTH_B and d["grew"]["blocks"] == 40
                assert d["shrank"]["bytes"] == 0 and d["shrank"]["children"] == []
                [site] = d["grew"]["children"]
                assert site["label"].endswith(GROW) and site["bytes"] == GROWTH_B
                assert d["new_sites"] == 1 and d["gone_sites"] == 0
            # The same as `heapscope diff` prints from the files.
            cli = subprocess.run(
                [*heapscope_cmd, "diff", str(store_daemon.out_dir / "store"), "--pid", str(target.pid), "--from", t1,
                 "--to", t2, "--json"], capture_output=True, text=True, check=False, timeout=60)
            assert cli.returncode == 0, cli.stderr
            offline = json.loads(cli.stdout)
            assert offline["grew"] == d["grew"] and offline["from"] == d["from"]
            text = client.get("/diff", params={"from": t1, "to": t2, "format": "text"}).text
            assert "grow_site" in text and "+1,000,000" in text

            # Relative times: from a minute ago (before the first sample) there is nothing to compare.
            r = client.get("/diff", params={"from": "-1h", "to": "now"})
            assert r.status_code == 404 and "no snapshot at or before" in r.json()["detail"]
            # Bad times: 400 with a clear line.
            for params in ({"from": "yesterday-ish", "to": "now"}, {"from": t2, "to": t1}, {"from": "now"}):
                r = client.get("/diff", params=params)
                assert r.status_code in (400, 422), r.text
                assert r.json()["detail"]
            r = client.get("/diff", params={"from": "yesterday-ish", "to": "now"})
            assert r.status_code == 400 and "cannot read the time 'yesterday-ish'" in r.json()["detail"]
            r = client.get("/snapshot", params={"at": "-1h"})
            assert r.status_code == 404

            # /snapshot?at= and /detailed_snapshot?at= read the store; ms_print reads them.
            r = client.get("/detailed_snapshot", params={"at": t2})
            assert r.status_code == 200, r.text
            [snap] = parse_massif(r.text).snapshots
            assert snap.heap_B == GROWTH_B and paths(snap.tree)[(GROW,)] == GROWTH_B
            run_tool(["ms_print"], r.text, tmp_path, "at.out")
            [before] = parse_massif(client.get("/snapshot", params={"at": t1}).text).snapshots
            assert before.heap_B == 0 and before.heap_tree == "empty"
            js = client.get(f"/targets/{target.pid}/history/snapshot",
                            params={"at": t2, "detailed": "true", "format": "json"}).json()
            assert js["snapshots"][0]["mem_heap_B"] == GROWTH_B

            # /all_snapshots?from=&to=: Massif's series of the stored range, read by ms_print.
            r = client.get("/all_snapshots", params={"from": t1, "to": t2})
            assert r.status_code == 200, r.text
            series = parse_massif(r.text)
            assert series.snapshots[0].heap_B == 0 and series.snapshots[-1].heap_B == GROWTH_B
            assert all(s.heap_B in (0, GROWTH_B) for s in series.snapshots)
            run_tool(["ms_print"], r.text, tmp_path, "range.out")
            # Without a range: the snapshots held in memory, as before.
            assert parse_massif(client.get("/all_snapshots").text).snapshots
    finally:
        target.kill()


def test_serve_no_store_keeps_no_history(heapscope_cmd: list[str], tmp_path: Path,
                                         build: Callable[..., Path]) -> None:
    d = start_daemon(heapscope_cmd, tmp_path, "--no-store")
    target = Target(build("daemon_target.c"))
    try:
        with d.client() as client:
            attach(client, target.pid)
            h = held(client, target.pid)
            assert not h["enabled"] and h["directory"] is None
            r = client.get("/diff", params={"from": "-1m", "to": "now"})
            assert r.status_code == 409 and "--no-store" in r.json()["detail"]
            assert client.get("/snapshot", params={"at": "now"}).status_code == 409
            assert client.get("/snapshot").status_code == 200  # the live profile as ever
    finally:
        target.kill()
        stop_daemon(d)
    assert not (d.out_dir / "store").exists()


def test_a_store_outside_the_output_directory_is_refused(cli_cmd: list[str], tmp_path: Path) -> None:
    for store in ("../elsewhere", str(tmp_path / "elsewhere"), "/tmp"):
        done = subprocess.run(
            [*cli_cmd, "serve", "--output-dir", str(tmp_path / "out"), "--store", store],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "outside the output directory" in line
    assert not (tmp_path / "elsewhere").exists()


# ---- a full disk -----------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, mounted for the test."""
    mnt = tmp_path / "out" / "store"
    mnt.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0755", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_one_clear_error_and_a_metric_and_the_target_runs_on(
    heapscope_cmd: list[str], tmp_path: Path, small_disk: Path, busy_program: Path
) -> None:
    filler = small_disk / "filler"
    # Leave room for the segment's start (the stack tables) and a few samples, then the disk is full.
    filler.write_bytes(b"\0" * (512 * 1024 - 96 * 1024))
    d = start_daemon(heapscope_cmd, tmp_path, "--store-interval", str(INTERVAL), *EVERY)
    busy = Busy(busy_program, 1000)
    try:
        with d.client() as client:
            attach(client, busy.pid)

            def refused() -> bool:
                return held(client, busy.pid)["write_errors"] >= 3

            wait_for(refused, 60, "the disk to fill up")
            h = held(client, busy.pid)
            assert "the disk is full" in h["last_error"] and h["snapshots_written"] > 0
            metrics = client.get("/metrics").text
            errors = [line for line in metrics.splitlines()
                      if line.startswith("heapscope_store_write_errors_total{") and f'pid="{busy.pid}"' in line]
            assert len(errors) == 1 and float(errors[0].rsplit(" ", 1)[1]) >= 3
            # One line for each streak of refused samples, not one a sample. A refused sample leaves no partial
            # write behind, so a smaller one may still fit in what is left: a streak then ends with "again" (the
            # last one too, if a sample fitted just before this look).
            log = d.stderr()
            streaks, resumed = log.count("the disk is full"), log.count("again, after")
            assert streaks >= 1 and streaks - resumed in (0, 1), log
            assert streaks < held(client, busy.pid)["write_errors"], log
            # The profile goes on (the live snapshot), and so does the target.
            t = time.monotonic()
            wait_for(lambda: busy.allocations_since(t) > 5_000 or busy.proc.poll() is not None, 30,
                     "the target's allocations while the disk is full")
            assert busy.proc.poll() is None and busy.allocations_since(t) > 5_000
            assert parse_massif(client.get("/snapshot").text).snapshots[0].heap_B > 0
            # Room again: writing resumes, and says so.
            written = held(client, busy.pid)["snapshots_written"]
            filler.unlink()
            wait_for(lambda: held(client, busy.pid)["snapshots_written"] > written + 2, 30, "writes to resume")
            assert "again, after" in d.stderr()
        assert stop_daemon(d) == 0
    finally:
        busy.kill()
        if d.proc.poll() is None:
            stop_daemon(d)
    # Every snapshot that was written reads back; nothing refused left a partial one behind.
    doc, err = report_json(heapscope_cmd, small_disk, busy.pid, tmp_path)
    assert "skipped" not in err, err
    assert len(doc["snapshots"]) == held_count(small_disk / str(busy.pid))


def held_count(directory: Path) -> int:
    """Snapshots in the directory, by the reader written from the spec page alone."""
    return sum(len(read_segment(str(seg)).snapshots) for seg in segments(directory))
