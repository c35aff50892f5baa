"""The daemon for real: `heapscope serve` profiling compiled C programs, queried with a real HTTP client.

The readers are the real ones: ms_print reads /all_snapshots and /detailed_snapshot, callgrind_annotate reads
/xtmemory, promtool checks /metrics and a real Prometheus server on loopback scrapes it. schemathesis fuzzes
the OpenAPI schema and no request may get a server error.

daemon_target.c allocates 5 x 1000 B (site_small) and 3 x 4000 B (site_big) when told to, frees the small
ones when told again, and exits at EOF on stdin.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.support.daemon import (
    TOKEN,
    Daemon,
    Target,
    answers,
    attach,
    free_port,
    run_tool,
    start_daemon,
    stop_daemon,
)
from tests.support.harness import REPO
from tests.support.massif_reader import MassifSnapshot, parse_massif, paths
from tests.support.sources import source_line
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration


SMALL = f"site_small (daemon_target.c:{source_line('daemon_target.c', 'small[i] = malloc(1000)')})"
BIG = f"site_big (daemon_target.c:{source_line('daemon_target.c', 'big[i] = malloc(4000)')})"


@pytest.fixture
def daemon(heapscope_cmd: list[str], tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(heapscope_cmd, tmp_path)
    yield d
    stop_daemon(d)


@pytest.fixture
def target_program(build: Callable[..., Path]) -> Path:
    return build("daemon_target.c")


@pytest.fixture
def target(target_program: Path) -> Iterator[Target]:
    t = Target(target_program)
    yield t
    t.kill()


# ---- the profile over HTTP, read by the real readers ------------------------------------------------------


def test_monitor_bodies_are_read_by_ms_print_and_callgrind_annotate(
    daemon: Daemon, target: Target, tmp_path: Path
) -> None:
    with daemon.client() as client:
        body = attach(client, target.pid)
        assert body["state"] == "profiling" and body["command"] == "daemon_target"
        target.step("allocated")

        ds = client.get("/detailed_snapshot")
        assert ds.status_code == 200 and ds.headers["content-type"].startswith("text/plain")
        [snap] = parse_massif(ds.text).snapshots
        assert snap.heap_B == 17000 and snap.tree is not None
        got = paths(snap.tree)
        assert got[(BIG,)] == 12000 and got[(SMALL,)] == 5000
        report = run_tool(["ms_print"], ds.text, tmp_path, "ds.out")
        assert "site_big (daemon_target.c:" in report

        # The same data as JSON.
        js = client.get("/detailed_snapshot", params={"format": "json"}).json()
        assert js["snapshots"][0]["mem_heap_B"] == 17000
        labels = {c["label"].split(": ", 1)[1]: c["bytes"] for c in js["snapshots"][0]["tree"]["children"]}
        assert labels == {BIG: 12000, SMALL: 5000}

        snap_text = client.get("/snapshot").text
        [normal] = parse_massif(snap_text).snapshots
        assert normal.heap_tree == "empty" and normal.heap_B == 17000

        allsnap = client.get("/all_snapshots").text
        parsed = parse_massif(allsnap)
        assert parsed.cmd.endswith("daemon_target") and len(parsed.snapshots) >= 1
        run_tool(["ms_print"], allsnap, tmp_path, "all.out")

        xt = client.get("/xtmemory").text
        assert xt.startswith("# callgrind format")
        annotated = run_tool(["callgrind_annotate", "--inclusive=yes"], xt, tmp_path, "xt.kcg")
        assert "17,000" in annotated and "site_big" in annotated
        xj = client.get("/xtmemory", params={"format": "json"}).json()
        assert xj["totals"]["curB"] == 17000

        target.step("freed")
        [after] = parse_massif(client.get("/snapshot").text).snapshots
        assert after.heap_B == 12000

        # Monitor commands write under the output directory.
        r = client.post("/monitor", json={"command": "detailed_snapshot named.out"})
        assert r.status_code == 200, r.text
        assert Path(r.json()["file"]) == daemon.out_dir / "named.out"
        run_tool(["ms_print"], (daemon.out_dir / "named.out").read_text(), tmp_path, "named.out")

        # The target exits: its last state stays queryable, marked exited, and its file is written.
        assert target.end() == 0
        wait_for(lambda: client.get("/targets").json()[0]["exited"], what="the target to be marked exited")
        [t] = client.get("/targets").json()
        assert t["state"] == "exited" and t["heap"]["useful_bytes"] == 12000
        [final] = parse_massif(client.get("/detailed_snapshot").text).snapshots
        assert final.heap_B == 12000 and final.tree is not None and paths(final.tree)[(BIG,)] == 12000
        written = daemon.out_dir / f"massif.out.{target.pid}"
        wait_for(written.exists, what=str(written))
        run_tool(["ms_print"], written.read_text(), tmp_path, "final.out")


def test_several_targets_and_detach(daemon: Daemon, target_program: Path) -> None:
    a, b = Target(target_program), Target(target_program)
    try:
        with daemon.client() as client:
            attach(client, a.pid)
            attach(client, b.pid)
            assert client.post("/targets", json={"pid": a.pid}).status_code == 409
            a.step("allocated")
            r = client.get("/snapshot")
            assert r.status_code == 400 and "pid" in r.json()["detail"]
            assert parse_massif(client.get("/snapshot", params={"pid": a.pid}).text).snapshots[0].heap_B == 17000
            assert parse_massif(client.get("/snapshot", params={"pid": b.pid}).text).snapshots[0].heap_B == 0
            # Detach: the target runs on unharmed, and the daemon forgets it.
            r = client.delete(f"/targets/{a.pid}")
            assert r.status_code == 200 and r.json()["state"] == "detached"
            assert [t["pid"] for t in client.get("/targets").json()] == [b.pid]
            a.step("freed")
            assert a.end() == 0
            assert (daemon.out_dir / f"massif.out.{a.pid}").exists()
            assert client.get("/snapshot", params={"pid": a.pid}).status_code == 404
    finally:
        a.kill()
        b.kill()


def test_sigterm_writes_every_targets_files(heapscope_cmd: list[str], tmp_path: Path, target_program: Path) -> None:
    d = start_daemon(heapscope_cmd, tmp_path, "--xtree-memory=full")
    a, b = Target(target_program), Target(target_program)
    try:
        with d.client() as client:
            attach(client, a.pid)
            attach(client, b.pid)
            a.step("allocated")
        assert stop_daemon(d) == 0
        for t, heap in ((a, 17000), (b, 0)):
            massif = d.out_dir / f"massif.out.{t.pid}"
            assert massif.exists(), d.stderr()
            assert parse_massif(massif.read_text()).snapshots[-1].heap_B == heap
            run_tool(["ms_print"], massif.read_text(), tmp_path, f"m{t.pid}")
            assert (d.out_dir / f"xtmemory.kcg.{t.pid}").exists()
        a.step("freed")  # both run on after the daemon is gone
        assert a.end() == 0 and b.end() == 0
    finally:
        a.kill()
        b.kill()


def test_all_snapshots_trees_are_of_their_own_instants(
    heapscope_cmd: list[str], tmp_path: Path, target_program: Path
) -> None:
    """daemon_target's 13 calls come in two bursts of microseconds, far within one sampling tick. With
    --detailed-freq=1 every snapshot is detailed, and each tree is the heap at its own snapshot's time (in B,
    which says how many calls came before it), not at the tick that read it."""
    d = start_daemon(heapscope_cmd, tmp_path, "--detailed-freq=1", "--time-unit=B")
    t = Target(target_program)
    # The calls in order, each with its (small, big) blocks after it, and its time step in B (size + extra).
    states = [(0, 0, 0)]
    for k in range(1, 6):
        states.append((states[-1][0] + 1000 + 16, k, 0))
    for j in range(1, 4):
        states.append((states[-1][0] + 4000 + 8, 5, j))
    for k in range(4, -1, -1):
        states.append((states[-1][0] + 1000 + 16, k, 3))
    at_time = {time: (small, big) for time, small, big in states}
    try:
        with d.client() as client:
            attach(client, t.pid)
            t.step("allocated")
            t.step("freed")

            def snapshots() -> list[MassifSnapshot]:
                return parse_massif(client.get("/all_snapshots", params={"pid": t.pid}).text).snapshots

            # every call's state, and the peak before the first free
            wait_for(lambda: len(snapshots()) == len(states) + 1, what="the points of all 13 calls")
            snaps = snapshots()
            assert [s.heap_tree for s in snaps].count("peak") == 1
            for s in snaps:
                assert s.tree is not None, f"snapshot at {s.time}"
                small, big = at_time[s.time]  # a peak's: the state before the free, after the call before it
                got = {k: v for k, v in paths(s.tree).items() if len(k) == 1 and v}
                want = {k: v for k, v in [((SMALL,), 1000 * small), ((BIG,), 4000 * big)] if v}
                assert got == want, f"snapshot at {s.time}"
                assert s.heap_B == 1000 * small + 4000 * big
        assert t.end() == 0
    finally:
        t.kill()
        stop_daemon(d)


# ---- metrics ------------------------------------------------------------------------------------------------


def test_metrics_pass_promtool_and_reach_prometheus(daemon: Daemon, target: Target, tmp_path: Path) -> None:
    with daemon.client() as client:
        attach(client, target.pid)
        target.step("allocated")
        text = client.get("/metrics").text
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr
    # Labels in name order; the placement labels (cgroup, container, pod, unit) come from the target's cgroup.
    labels = rf'{{cgroup="[^"]*",command="daemon_target",container="",pid="{target.pid}",pod="",unit="[^"]*"}}'
    assert re.search(rf"heapscope_heap_useful_bytes{labels} 17000.0", text), text

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: heapscope
    authorization:
      type: Bearer
      credentials_file: {token_file}
    static_configs:
      - targets: ["{daemon.url.removeprefix('http://')}"]
"""
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    try:
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"

        def query(q: str) -> list[dict]:  # type: ignore[type-arg]
            try:
                r = httpx.get(api, params={"query": q}, timeout=5)
            except httpx.TransportError:
                return []
            return r.json()["data"]["result"] if r.status_code == 200 else []  # type: ignore[no-any-return]

        sel = f'{{pid="{target.pid}",command="daemon_target"}}'
        wait_for(lambda: bool(query(f"heapscope_heap_useful_bytes{sel}")), 60, "Prometheus to scrape the daemon")
        assert float(query(f"heapscope_heap_useful_bytes{sel}")[0]["value"][1]) == 17000
        assert float(query(f"heapscope_heap_live_blocks{sel}")[0]["value"][1]) == 8
        assert float(query(f"heapscope_allocated_bytes_total{sel}")[0]["value"][1]) == 17000
        site = query(f'heapscope_site_live_bytes{{pid="{target.pid}",site="{BIG}"}}')
        assert float(site[0]["value"][1]) == 12000
        [up] = query('up{job="heapscope"}')
        assert up["value"][1] == "1"
    finally:
        prom.terminate()
        prom.wait(30)


# ---- security ---------------------------------------------------------------------------------------------


def _maps_figures(pid: int) -> tuple[int, int, int]:
    """The target's mapped total (agent.model.pages.mapped_total's rule), its [uprobes] and its [stack] bytes."""
    from agent.model.maps import parse_maps_full
    from tests.support.reference import mapped_total

    text = Path(f"/proc/{pid}/maps").read_text()
    entries = parse_maps_full(text)
    uprobes = sum(e.size for e in entries if e.path == "[uprobes]")
    stack = sum(e.size for e in entries if e.path == "[stack]")
    return mapped_total(text), uprobes, stack


def test_mapped_memory_agrees_with_proc_maps(daemon: Daemon, target: Target) -> None:
    """The mapped gauge and the target's `pages` figures follow the page syscalls (malloc's first brk
    here): they equal /proc/PID/maps but for the page the kernel maps for the probes and stack growth."""
    with daemon.client() as client:
        attach(client, target.pid)
        _, _, stack_at_attach = _maps_figures(target.pid)
        target.step("allocated")
        text = client.get("/metrics").text
        labels = rf'{{[^}}]*command="daemon_target",[^}}]*pid="{target.pid}"[^}}]*}}'
        series = re.search(rf"heapscope_mapped_bytes{labels} (\S+)", text)
        assert series, text
        gauge = int(float(series[1]))
        total, uprobes, stack = _maps_figures(target.pid)
        assert 0 <= total - uprobes - gauge <= stack - stack_at_attach, (total, uprobes, gauge)
        listed = {t["pid"]: t for t in client.get("/targets").json()}[target.pid]
        assert listed["pages"]["mapped_bytes"] == gauge
        assert listed["pages"]["page_syscalls"] >= 1  # malloc's arena came from brk after the attach
        assert listed["pages"]["dropped"] == 0


def test_pages_as_heap_daemon_serves_page_trees(heapscope_cmd: list[str], tmp_path: Path, target: Target) -> None:
    """A --pages-as-heap daemon: the live tree holds what existed at the attach under its own entry, and the
    pages malloc's first brk maps under the stack that called malloc."""
    d = start_daemon(heapscope_cmd, tmp_path, "--pages-as-heap=yes", "--threshold=0")
    try:
        with d.client() as client:
            attach(client, target.pid)
            target.step("allocated")
            text = client.get("/detailed_snapshot", params={"pid": target.pid}).text
            out = run_tool(["ms_print", "--threshold=0"], text, tmp_path, "pages.out")
            assert "(page allocation syscalls) mmap/mremap/brk" in out
            assert "(mapped before heapscope attached)" in out
            assert re.search(r"brk \(brk\.c:\d+\)", out) and "site_small (daemon_target.c:" in out, out
            listed = {t["pid"]: t for t in client.get("/targets").json()}[target.pid]
            assert listed["heap"]["useful_bytes"] == listed["pages"]["mapped_bytes"]
    finally:
        assert stop_daemon(d) == 0


def test_run_with_http_serves_the_child_and_exits_with_its_status(
    heapscope_cmd: list[str], target_program: Path, tmp_path: Path
) -> None:
    """`heapscope run --http`: the daemon serves the launched program from its first instruction and ends with
    it, with its exit status and its files written (what `make demo` does)."""
    port = free_port()
    out_dir = tmp_path / "out"
    cmd = [*heapscope_cmd, "run", "--http", f"127.0.0.1:{port}", "--output-dir", str(out_dir)]
    cmd += ["--summary-file=summary.%p.json", "--"]
    proc = subprocess.Popen(
        [*cmd, str(target_program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"ready\n"  # the child runs: its probes were attached before its exec
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(f"{url}/healthz"), what="the daemon to answer")
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"allocated\n"
        snap = httpx.get(f"{url}/snapshot", params={"format": "json"}, timeout=30).json()
        assert snap["snapshots"][0]["mem_heap_B"] == 5 * 1000 + 3 * 4000
        proc.stdin.close()
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "Traceback" not in err, err
    # The summary, written from the target's last state, still counts the unwind rows the walk used.
    summaries = list(out_dir.glob("summary.*.json"))
    assert len(summaries) == 1, err
    assert json.loads(summaries[0].read_text())["unwind"]["rows_used"] > 0, err
    assert "unwind: " in err and " table rows" in err, err
    written = list(out_dir.glob("massif.out.*"))
    assert len(written) == 1, err
    run_tool(["ms_print"], written[0].read_text(), tmp_path, "final.out")


def test_path_traversal_is_refused(daemon: Daemon, target: Target, tmp_path: Path) -> None:
    outside = Path(tempfile.mkdtemp(dir=tmp_path))
    (daemon.out_dir / "escape").symlink_to(outside)
    with daemon.client() as client:
        attach(client, target.pid)
        for name in ("../evil.out", f"{outside}/evil.out", "escape/evil.out", "a/../../evil.out"):
            r = client.post("/monitor", json={"command": f"all_snapshots {name}"})
            assert 400 <= r.status_code < 500, (name, r.text)
            assert r.json()["detail"]
    assert list(outside.iterdir()) == []
    assert not (daemon.out_dir.parent / "evil.out").exists()


def test_token_is_required(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/healthz").status_code == 200
    r = httpx.get(f"{daemon.url}/targets")
    assert r.status_code == 401 and r.json()["detail"]
    assert httpx.get(f"{daemon.url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_non_loopback_without_token_refuses_to_start(cli_cmd: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
    port = free_port()
    done = subprocess.run(
        [*cli_cmd, "serve", "--http", f"0.0.0.0:{port}", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "token" in done.stderr and "Traceback" not in done.stderr
    with socket.socket() as s:  # nothing was left listening
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ---- schemathesis ----------------------------------------------------------------------------------------


def test_schemathesis_finds_no_server_error(daemon: Daemon, target: Target, tmp_path: Path) -> None:
    st = Path(sys.executable).parent / "st"
    if not st.exists():
        pytest.skip("schemathesis is not installed")
    with daemon.client() as client:
        attach(client, target.pid)
        target.step("allocated")
    common = [
        str(st),
        "run",
        f"{daemon.url}/openapi.json",
        "-H",
        f"Authorization: Bearer {TOKEN}",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "30",
        "--seed",
        "1",
        "--request-timeout",
        "20",
    ]
    # Valid POST /targets bodies would attach to whatever processes the fuzzer's PIDs name: that operation is
    # fuzzed with invalid data only, everything else with both.
    runs = [
        [*common, "--exclude-operation-id", "attach_targets_post"],
        [*common, "--include-operation-id", "attach_targets_post", "--mode", "negative"],
    ]
    for cmd in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Traceback" not in daemon.stderr()
    with daemon.client() as client:  # still serving (the fuzzer may well have detached the target)
        assert client.get("/targets").status_code == 200


# ---- never in the target's way -------------------------------------------------------------------------------


def test_snapshot_load_does_not_stall_the_target(daemon: Daemon, tmp_path: Path) -> None:
    """A target allocating at full speed goes on reporting its progress while a client requests /detailed_snapshot
    back to back, and every request is answered with its sites. (How much of its speed it keeps, and the longest
    stall: bench/latency.py.)"""
    program = tmp_path / "sites"
    done = subprocess.run(
        ["gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-o", str(program), str(REPO / "bench" / "sites.c")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen(
        [str(program), "2000", "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "SITES_WAIT": "1"},
    )
    reports: list[bytes] = []  # one line each 100 ms of allocating

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            reports.append(line)

    try:
        with daemon.client() as client:
            attach(client, proc.pid)
            assert proc.stdin is not None
            proc.stdin.write(b"g")
            proc.stdin.flush()
            threading.Thread(target=reader, daemon=True).start()
            wait_for(lambda: len(reports) >= 10, 30, "the target's first progress reports")
            before = len(reports)
            for _ in range(20):
                r = client.get("/detailed_snapshot")
                assert r.status_code == 200
                assert "(sites.c:" in r.text
            wait_for(lambda: len(reports) >= before + 5, 30, "the target's progress after the requests")
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


MALT_SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "malt_schema.json").read_text())


def _malt_stacks(doc: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    """Each stack's infos by the name of its innermost frame in the program (site_small, site_big)."""
    names = doc["sites"]["strings"]
    out = {}
    for entry in doc["stacks"]["stats"]:
        for ip in entry["stack"]:
            fn = doc["sites"]["instr"].get(ip, {}).get("function")
            if fn is not None and names[fn] in ("site_small", "site_big"):
                out[names[fn]] = entry["infos"]
                break
    return out


def _leaf_functions(doc: dict) -> set[str]:  # type: ignore[type-arg]
    """The names of the stacks' leaf frames: in MALT's files, the allocation function called."""
    names, instr = doc["sites"]["strings"], doc["sites"]["instr"]
    return {names[instr[entry["stack"][0]]["function"]] for entry in doc["stacks"]["stats"] if entry["stack"]}


def test_malt_profile_of_a_live_target(daemon: Daemon, target: Target) -> None:
    """GET /malt: MALT's whole profile of a target while it runs, and after it exits; both formats validate
    against the seed's schema, and the numbers are the ones daemon_target.c makes."""
    with daemon.client() as client:
        attach(client, target.pid)
        target.step("allocated")
        target.step("freed")
        r = client.get("/malt")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
        doc = r.json()
        jsonschema.validate(doc, MALT_SCHEMA)
        stacks = _malt_stacks(doc)
        assert stacks["site_small"]["alloc"] == {"count": 5, "min": 1000, "max": 1000, "sum": 5000}
        assert stacks["site_small"]["aliveReq"] == 0 and stacks["site_small"]["lifetime"]["count"] == 5
        assert stacks["site_big"]["alloc"]["sum"] == 12000 and stacks["site_big"]["aliveReq"] == 12000
        assert doc["memStats"]["sizeMap"]["1000"] == 5 and doc["memStats"]["sizeMap"]["4000"] == 3
        leaks = {leak["memory"] for leak in doc["leaks"]}
        assert 12000 in leaks

        v16 = client.get("/malt", params={"version": "1.6"}).json()
        assert v16["run"]["formatVersion"] == "1.6" and "domains" in v16
        assert client.get("/malt", params={"version": "2.0"}).status_code == 422

        assert target.end() == 0
        wait_for(lambda: client.get("/targets").json()[0]["exited"], what="the target to be marked exited")
        after = client.get("/malt").json()
        assert _malt_stacks(after)["site_big"]["aliveReq"] == 12000
        # Built after the end too: the leaf frames are the allocation functions (its /proc/PID/root is gone).
        assert {"malloc", "free"} <= _leaf_functions(doc), _leaf_functions(doc)
        assert _leaf_functions(after) == _leaf_functions(doc)


def test_malt_off_is_a_clear_error(heapscope_cmd: list[str], tmp_path: Path, target: Target) -> None:
    d = start_daemon(heapscope_cmd, tmp_path, "--malt=no")
    try:
        with d.client() as client:
            attach(client, target.pid)
            r = client.get("/malt")
            assert r.status_code == 409 and "--malt=no" in r.json()["detail"], r.text
    finally:
        stop_daemon(d)
