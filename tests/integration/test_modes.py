"""The two modes end to end, through the real CLI and daemon: `attach` samples by default and its estimates
hold; exact mode still equals Massif; every output says which mode it came from; a SIGKILLed heapscope leaves
its target as it found it; the daemon switches a live target between modes and keeps serving; and where
sampling cannot be made safe, heapscope refuses with one line.

modes_sites.c holds known bytes at four call sites (its own count of them is printed at the end: the truth).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agent.process.inject import single_threaded
from agent.process.sampler import SamplerControl, build_sampler
from agent.session.maltrec import EXACT_IN_SAMPLED
from agent.store.reader import StoreReader
from tests.support.annotate import annotate_inclusive
from tests.support.attach import Attach
from tests.support.conversation import Conversation
from tests.support.daemon import Daemon, start_daemon, stop_daemon
from tests.support.harness import Completed
from tests.support.massif_reader import MassifFile, parse_massif, paths
from tests.support.oracle import NO_CULL
from tests.support.sampled_sites import SCALE, SITES, check_estimates, sampling_rate, site_sizes
from tests.support.target_memory import got_slot, libc_function, read_word
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

TIMEOUT = 60.0


class Program(Conversation):
    """modes_sites in its `wait` form, driven line by line."""

    def __init__(self, path: Path, scale: int = 1, threaded: bool = False) -> None:
        super().__init__([str(path), str(scale), "wait", *(["threaded"] if threaded else [])])
        self.expect("ready")

    def go(self) -> None:
        self.say("go")

    def truth(self) -> dict[str, int]:
        """Let it print its truth and exit; the live bytes per site."""
        self.go()
        out, _ = self.proc.communicate(timeout=TIMEOUT)
        assert self.proc.returncode == 0, out
        truth = {}
        for line in out.splitlines():
            _, name, value = line.split()
            truth[name] = int(value)
        assert set(truth) == set(SITES), out
        return truth


@pytest.fixture(scope="module")
def program(build: Callable[..., Path]) -> Path:
    return build("modes_sites.c")


@pytest.fixture(scope="module")
def sampled_run(program: Path, heapscope_cmd: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `heapscope attach` (no --mode: sampled by default) with every output asked for. Its estimates are
    judged at the rate it asks for, so without the sampling budget, which would raise that rate for its burst of
    some 10,000 samples (the budget on the default: test_the_default_budget_raises_the_rate...)."""
    tmp = tmp_path_factory.mktemp("sampled")
    rate = sampling_rate(SCALE)
    files = {
        "massif": tmp / "m.out", "malt": tmp / "malt.json", "pprof": tmp / "heap.pb.gz",
        "xtree": tmp / "xt.kcg", "summary": tmp / "summary.json",
    }
    target = Program(program, SCALE)
    try:
        attach = Attach([
            *heapscope_cmd, "attach", str(target.pid), f"--sample-rate={rate}", "--max-samples=0", "--time-unit=B",
            "--threshold=0.0",
            "--detailed-freq=1", f"--massif-out-file={files['massif']}", f"--malt-out-file={files['malt']}",
            f"--pprof-out-file={files['pprof']}", "--xtree-memory=allocs", f"--xtree-memory-file={files['xtree']}",
            f"--summary-file={files['summary']}",
        ], tmp)
        attach.wait_for("probes attached")  # the users' line: said once the sampler is armed too
        target.go()
        target.expect("allocated")  # every call made: the profile's end reads them all (Session.finish)
        assert attach.end() == 0, attach.stderr
        truth = target.truth()
    finally:
        target.kill()
    return {"rate": rate, "truth": truth, "files": files, "stderr": attach.stderr, "tmp": tmp}


def test_attach_samples_by_default_within_10_percent_per_big_site(sampled_run: dict) -> None:
    truth, rate = sampled_run["truth"], sampled_run["rate"]
    stderr = sampled_run["stderr"]
    assert "sampler (glibc build) loaded into" in stderr and f"one sample per {rate} bytes" in stderr, stderr
    files = sampled_run["files"]
    got = end_sites(files["xtree"])
    total = sum(truth.values())
    check_estimates(got, truth, rate)  # blocks at or above the rate are always sampled, at their size: exact
    # The sampler's own frames are trimmed: the program's call site leads every stack.
    detailed = parse_massif(files["massif"].read_text()).last_detailed
    assert detailed is not None and detailed.tree is not None
    assert not [p for p in paths(detailed.tree) if any("hs_" in label for label in p)]
    heap = json.loads(files["summary"].read_text())["counters"]["heap"]
    assert abs(heap / (total + 2500 * SCALE * 8) - 1) <= 0.10  # + main's array of pointers
    sampled_sites = [s for s, blocks in site_sizes(SCALE).items() if max(blocks) < rate]
    assert sampled_sites == ["site_small", "site_medium", "site_calloc"]  # what was estimated, not counted


def test_sampled_counts_are_exact_and_the_extra_model_comes_from_weights(sampled_run: dict) -> None:
    summary = json.loads(sampled_run["files"]["summary"].read_text())
    c = summary["counters"]
    # The program's calls after the attach, exactly: its kept blocks, 20000 churned per SCALE, one array (stdin's
    # and stdout's buffers were allocated before, at its first fgets and printf).
    kept = sum(len(blocks) for blocks in site_sizes(SCALE).values())
    assert c["n_allocs"] == kept + 20000 * SCALE + 1, c
    assert c["n_frees"] == 20000 * SCALE, c
    assert summary["sampling"]["rate"] == sampled_run["rate"] and summary["sampling"]["samples"] > 0
    # Massif's extra bytes, from the estimated blocks: each site's blocks * (slop + 8), within 10% overall.
    sizes = site_sizes(SCALE)
    extra = sum(((s + 15) // 16 * 16 - s + 8) for blocks in sizes.values() for s in blocks)
    assert abs(c["extra"] / extra - 1) <= 0.10, (c["extra"], extra)


def end_sites(xtree: Path) -> dict[str, int]:
    """The live bytes per site at the end, from the xtree report (callgrind_annotate reads it)."""
    return {fn: v[0] for (src, fn), v in annotate_inclusive(xtree).items() if src == "modes_sites.c" and fn in SITES}


def test_every_output_says_the_mode(sampled_run: dict) -> None:
    rate, files, tmp = sampled_run["rate"], sampled_run["files"], sampled_run["tmp"]
    text = files["massif"].read_text()
    desc = text.splitlines()[0]
    assert "--mode=sampled" in desc and f"--sample-rate={rate}" in desc and "estimates" in desc, desc
    printed = subprocess.run(["ms_print", str(files["massif"])], capture_output=True, text=True, check=True).stdout
    args = next(line for line in printed.splitlines() if line.startswith("Massif arguments:"))
    assert f"--mode=sampled --sample-rate={rate} --max-samples=0" in args and "estimates" in args, args
    malt = json.loads(files["malt"].read_text())
    assert malt["config"]["heapscope"] == {"mode": "sampled", "sample-rate": rate, "estimates": True,
                                           "exact": list(EXACT_IN_SAMPLED)}  # the per-thread call counts
    assert malt["config"]["sampling"]["volume"] == rate
    pprof = subprocess.run(["go", "tool", "pprof", "-raw", str(files["pprof"])], capture_output=True, text=True,
                           check=True, cwd=tmp, env={**os.environ, "HOME": str(tmp)}).stdout
    assert re.search(rf"^Period: {rate}$", pprof, re.M), pprof[:400]
    assert "estimates" in gzip.decompress(files["pprof"].read_bytes()).decode(errors="replace")
    annotated = subprocess.run(["callgrind_annotate", str(files["xtree"])], capture_output=True, text=True,
                               check=True).stdout
    assert f"sampled, one sample per {rate} bytes" in annotated, annotated[:600]
    assert "ESTIMATES" in sampled_run["stderr"]  # the summary line a person reads


def test_run_sampled_preloads_the_sampler_and_puts_the_environment_back(
    program: Path, run_heapscope: Callable[..., Completed]
) -> None:
    """`run --mode=sampled`: the sampler comes in by LD_PRELOAD and holds the program before main() until it is
    armed, so its estimates hold from main() on; the program and its children see the environment heapscope
    was given."""
    rate = sampling_rate(SCALE)
    got = run_heapscope(program, (str(SCALE),), ("--mode=sampled", f"--sample-rate={rate}", "--max-samples=0"),
                        xtree=True)  # judged at its rate, as sampled_run
    assert got.returncode == 0, got.stderr
    truth = {name: int(v) for _, name, v in (line.split() for line in got.stdout.splitlines())}
    assert got.xtree_out is not None
    sites = end_sites(got.xtree_out)
    for site in SITES:
        assert abs(sites.get(site, 0) / truth[site] - 1) <= 0.10, (site, sites.get(site), truth[site])
    assert got.counters["n_allocs"] >= sum(len(b) for b in site_sizes(SCALE).values()) + 20000 * SCALE
    env = run_heapscope(Path("/bin/sh"), ("-c", 'echo "[$LD_PRELOAD|$HEAPSCOPE_SAMPLER_HOLD]"'), ("--mode=sampled",),
                        env={"LD_PRELOAD": "libm.so.6"})
    assert env.returncode == 0 and env.stdout.strip() == "[libm.so.6|]", (env.stdout, env.stderr)


# ---- the sampling budget -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def churn(build: Callable[..., Path]) -> Path:
    return build("budget_churn.c")


def churn_under_attach(churn: Path, heapscope_cmd: list[str], tmp: Path, *args: str) -> dict:
    """budget_churn for 4 s under `heapscope attach` at the default rate: its summary, its allocated bytes per
    function (the xtree's totB, read by callgrind_annotate) and the bytes it says it asked for."""
    target = Conversation([str(churn), "4"])
    target.expect("ready")
    xtree, summary = tmp / "xt.kcg", tmp / "summary.json"
    try:
        attach = Attach([*heapscope_cmd, "attach", str(target.pid), "--xtree-memory=full",
                         f"--xtree-memory-file={xtree}", f"--summary-file={summary}", *args], tmp)
        attach.wait_for("probes attached")
        target.say("go")
        target.expect("done")
        assert target.proc.stdout is not None
        asked = int(target.proc.stdout.readline().split()[1])
        assert attach.end() == 0, attach.stderr
    finally:
        target.kill()
    allocated = {fn: v[2] for (src, fn), v in annotate_inclusive(xtree).items() if src == "budget_churn.c"}
    return {"summary": json.loads(summary.read_text()), "allocated": allocated.get("site_churn", 0),
            "asked": asked, "stderr": attach.stderr}


def test_the_default_budget_raises_the_rate_of_a_heavy_churn_and_its_estimate_holds(
    churn: Path, heapscope_cmd: list[str], tmp_path: Path
) -> None:
    """The defaults users get: at 512 KiB and 500 samples a second, a churn of 2 GB a second (some 3,600 samples
    a second at the asked rate) is sampled at a rate raised to keep the budget, and what it allocated is still
    estimated within 10% (each sample weighted at the rate its thread drew at). Its twin without a budget keeps the
    rate and takes several times the samples."""
    capped = churn_under_attach(churn, heapscope_cmd, tmp_path)
    sampling = capped["summary"]["sampling"]
    print(f"budgeted: {sampling}, estimate/truth {capped['allocated'] / capped['asked']:.4f}")
    assert sampling["rate"] == 524288 and sampling["max_samples"] == 500, sampling
    assert sampling["rate_changes"] >= 1 and 2 * 524288 < sampling["rate_in_force"] < 64 * 524288, sampling
    assert "over its budget of 500 samples a second" in capped["stderr"], capped["stderr"]
    assert "the sampling budget (500 samples a second) moved the rate" in capped["stderr"], capped["stderr"]
    # A window closes at a second or at the budget's 500 samples: about 375 a second once the rate follows.
    assert 0 < sampling["samples"] < 4 * 500 * 2, sampling
    assert abs(capped["allocated"] / capped["asked"] - 1) <= 0.10, (capped["allocated"], capped["asked"])
    free = tmp_path / "unbudgeted"
    free.mkdir()
    unbudgeted = churn_under_attach(churn, heapscope_cmd, free, "--max-samples=0")
    plain = unbudgeted["summary"]["sampling"]
    print(f"unbudgeted: {plain}, estimate/truth {unbudgeted['allocated'] / unbudgeted['asked']:.4f}")
    assert plain["max_samples"] == 0 and plain["rate_changes"] == 0 and plain["rate_in_force"] == 524288, plain
    assert plain["samples"] > 4 * sampling["samples"], (plain, sampling)
    assert abs(unbudgeted["allocated"] / unbudgeted["asked"] - 1) <= 0.10


def test_sampled_mode_drains_the_schedule_at_its_looks(churn: Path, heapscope_cmd: list[str], tmp_path: Path) -> None:
    """The defaults users get: sampled mode is not woken at each culling of the snapshot schedule; its looks
    drain the points, and the kernel wakes the loop only HS_SCHED_SAMPLED_SLACK points past a cull. A steady
    churn of 4 s culls again and again; no point is lost. Its twin in exact mode is woken at its cullings."""
    run = churn_under_attach(churn, heapscope_cmd, tmp_path)
    c, sc = run["summary"]["counters"], run["summary"]["schedule"]
    print(f"sampled: points {c['sched_points']}, lost {c['sched_lost']}, wake-ups {c['sched_wakes']}, "
          f"cullings {sc['cullings']}, kept {sc['kept']}")
    assert sc["cullings"] >= 4 and c["sched_lost"] == 0 and 50 <= sc["kept"] <= 100, (c, sc)
    assert c["sched_wakes"] <= 1, (c, sc)
    exact = tmp_path / "exact"
    exact.mkdir()
    run = churn_under_attach(churn, heapscope_cmd, exact, "--mode=exact")
    c, sc = run["summary"]["counters"], run["summary"]["schedule"]
    print(f"exact: points {c['sched_points']}, lost {c['sched_lost']}, wake-ups {c['sched_wakes']}, "
          f"cullings {sc['cullings']}, kept {sc['kept']}")
    assert sc["cullings"] >= 4 and c["sched_lost"] == 0 and c["sched_wakes"] >= 2, (c, sc)


def test_the_daemon_serves_and_stores_the_rate_in_force(churn: Path, heapscope_cmd: list[str], tmp_path: Path) -> None:
    """The daemon's defaults (sampled, the budget, the history): while the budget holds the churn's rate up, the
    metrics give the rate in force and its moves, and the history stores it with each snapshot."""
    daemon = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled")
    target = Conversation([str(churn), "4"])
    target.expect("ready")
    try:
        with daemon.client() as c:
            r = c.post("/targets", json={"pid": target.pid})
            assert r.status_code == 201, r.text
            target.say("go")
            target.expect("done")

            def in_force() -> tuple[float, float] | None:
                """The metrics' rate in force and moves, once moved and said alike by /targets (the churn has
                ended: the rate stays, and the daemon's next look reads it)."""
                text = c.get("/metrics").text
                found = [float(re.search(rf'^{name}{{[^}}]*pid="{target.pid}"[^}}]*}} (\S+)$', text, re.M)[1])
                         for name in ("heapscope_sample_rate_in_force_bytes", "heapscope_sample_rate_changes_total")]
                said = f"one sample per {found[0]:.0f} bytes now" in c.get("/targets").json()[0]["sampler"]
                return (found[0], found[1]) if found[1] >= 1 and said else None

            rate, changes = wait_for(in_force, 30, "the budget's move in the metrics and /targets")
            assert 2 * 524288 < rate < 64 * 524288 and changes >= 1, (rate, changes)
            r = c.delete(f"/targets/{target.pid}")
            assert r.status_code == 200, r.text
        [store] = {p.parent for p in daemon.out_dir.rglob("seg-*.hss")}
        reader = StoreReader(store)
        stored = [reader.load(ref, stacks=False).rate for ref in reader.snapshots()]
        assert stored and all(x is not None and x >= 524288 for x in stored), stored
        assert max(x for x in stored if x is not None) > 2 * 524288, stored  # the budget's rate, stored
    finally:
        target.kill()
        stop_daemon(daemon)


# ---- exact mode ------------------------------------------------------------------------------------------


def test_run_is_exact_by_default_and_equals_massif(
    program: Path, run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    ref = run_massif(program, ("1",), (*NO_CULL, "--run-libc-freeres=no"), xtree=True)  # what a native run keeps
    got = run_heapscope(program, ("1",), NO_CULL, xtree=True)
    assert ref.returncode == 0 and got.returncode == 0, got.stderr
    assert got.massif_text.splitlines()[0].endswith("--mode=exact"), got.massif_text.splitlines()[0]
    assert ref.xtree_out is not None and got.xtree_out is not None
    # The end state per function of the program, live and allocated bytes: its threads' calls interleave
    # otherwise natively than under Valgrind, and a massif.out ends at its last snapshot, not at the end.
    pick = {k: (v[0], v[2]) for k, v in annotate_inclusive(ref.xtree_out).items() if k[0] == "modes_sites.c"}
    mine = {k: (v[0], v[2]) for k, v in annotate_inclusive(got.xtree_out).items() if k[0] == "modes_sites.c"}
    assert pick and mine == pick, f"(curB, totB) per function differ:\nvalgrind  {pick}\nheapscope {mine}"


# ---- safety ------------------------------------------------------------------------------------------------


def test_sigkill_while_armed_leaves_the_target_at_full_speed(
    program: Path, heapscope_cmd: list[str], tmp_path: Path
) -> None:
    """heapscope SIGKILLed while its sampler is armed in a process with threads: within a second the sampler's
    control thread has put every GOT slot back (the target's malloc is libc's again, no hook in the way) by itself,
    and the program runs on unharmed."""
    target = Program(program, threaded=True)
    try:
        attach = Attach([*heapscope_cmd, "attach", str(target.pid), "--sample-rate=4096"], tmp_path)
        attach.wait_for("sampler armed")
        library = build_sampler()
        watcher = SamplerControl(target.pid, library)
        assert watcher.read().state == "armed" and watcher.read()["slots_patched"] > 0
        slot = got_slot(target.pid, program, "malloc")
        assert read_word(target.pid, slot) != libc_function(target.pid, "malloc")  # hooked
        attach.end(signal.SIGKILL)
        killed = time.monotonic()
        while watcher.read().state == "armed":
            assert time.monotonic() - killed < 1.0, "the sampler stayed armed after heapscope died"
            time.sleep(0.005)
        st = watcher.read()
        assert st.disarm_reason == "controller gone" and st["slots_patched"] == 0
        assert read_word(target.pid, slot) == libc_function(target.pid, "malloc")
        watcher.close()
        target.go()
        target.expect("allocated")
        truth = target.truth()
        assert truth["site_calloc"] == 1920000  # it computed what it always computes
    finally:
        target.kill()


def test_sigkill_while_armed_in_a_single_threaded_target_lets_it_go_at_its_next_sample(
    program: Path, heapscope_cmd: list[str], tmp_path: Path
) -> None:
    """The default target, single-threaded when heapscope attaches: kept so (no control thread; glibc's flag says
    single-threaded again after the injection). heapscope SIGKILLed while armed: the program's first sample after
    it sees the lease gone, and from then on the hooks pass everything through; the program computes what it
    always computes, still with one thread before its own second one."""
    target = Program(program)
    try:
        attach = Attach([*heapscope_cmd, "attach", str(target.pid), "--sample-rate=4096"], tmp_path)
        attach.wait_for("sampler armed")
        assert "it was single-threaded and is kept so" in attach.stderr
        watcher = SamplerControl(target.pid, build_sampler())
        st = watcher.read()
        assert st.state == "armed" and st.threadless and st["slots_patched"] > 0, st.fields
        assert os.listdir(f"/proc/{target.pid}/task") == [str(target.pid)] and single_threaded(target.pid, "/proc")
        attach.end(signal.SIGKILL)
        target.go()
        target.expect("allocated")
        st = watcher.read()
        assert (st.state, st.disarm_reason) == ("threadless", "controller gone"), st.fields
        watcher.close()
        truth = target.truth()
        assert truth["site_calloc"] == 1920000
    finally:
        target.kill()


def _refusal(heapscope_cmd: list[str], argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> str:
    target = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        done = subprocess.run([*heapscope_cmd, "attach", str(target.pid)], capture_output=True, text=True,
                              timeout=TIMEOUT, cwd=tmp_path, env={**os.environ, **(env or {})}, check=False)
        assert "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 3 and len(lines) == 1, done.stderr
        assert "--mode=exact" in lines[0], lines[0]
        target.communicate("x\n", timeout=TIMEOUT)
        assert target.returncode == 0  # untouched
        return lines[0]
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


def test_refuses_seccomp_an_executable_allocator_and_a_hidden_library(
    build: Callable[..., Path], heapscope_cmd: list[str], tmp_path: Path
) -> None:
    assert "seccomp" in _refusal(heapscope_cmd, [str(build("sampler_seccomp.c"))], tmp_path)
    assert "linked into its executable" in _refusal(heapscope_cmd, [str(build("sampler_own_malloc.c"))], tmp_path)
    # A target in its own mount namespace whose view of the sampler's folder is an empty tmpfs (a container), which
    # has no /proc to be handed the library through a memfd (a bare chroot), and in a network namespace of its own,
    # where no abstract socket of heapscope's reaches it to hand it the folder. (With a /proc, or in heapscope's
    # network namespace, it is handed over: tests/integration/test_containers.py, test_inject.py.)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    hide = f"mount -t tmpfs none {cache} && mount -t tmpfs none /proc && exec {build('sampler_wait.c')}"
    line = _refusal(heapscope_cmd, ["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", hide], tmp_path,
                    env={"HEAPSCOPE_CACHE_DIR": str(cache)})
    assert "cannot see the sampler library" in line and "another network namespace" in line


def test_refuses_a_target_already_traced(
    build: Callable[..., Path], heapscope_cmd: list[str], tmp_path: Path
) -> None:
    """ptrace forbidden: another tracer holds the target (yama's ptrace_scope=3 refuses the same way, and
    this kernel has no yama to set)."""
    target = subprocess.Popen([str(build("sampler_wait.c"))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    tracer = None
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        tracer = subprocess.Popen(["strace", "-q", "-o", os.devnull, "-p", str(target.pid)])
        deadline = time.monotonic() + 10
        while "TracerPid:\t0" in Path(f"/proc/{target.pid}/status").read_text():
            assert time.monotonic() < deadline, "strace did not attach"
            time.sleep(0.02)
        done = subprocess.run([*heapscope_cmd, "attach", str(target.pid)], capture_output=True, text=True,
                              timeout=TIMEOUT, cwd=tmp_path, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 3 and len(lines) == 1 and "already traced" in lines[0], done.stderr
    finally:
        if tracer is not None:
            tracer.terminate()
            tracer.wait()
        target.kill()
        target.wait()


# ---- the daemon -------------------------------------------------------------------------------------------


@pytest.fixture
def sampled_daemon(heapscope_cmd: list[str], tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--time-unit=B", "--sample-interval=0.02")
    yield d
    stop_daemon(d)


def _metric_info(text: str, pid: int) -> dict[str, str]:
    for line in text.splitlines():
        if line.startswith("heapscope_profile_info{") and f'pid="{pid}"' in line:
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    raise AssertionError(f"no heapscope_profile_info for {pid}:\n{text}")


def test_daemon_switches_a_live_target_between_modes_and_keeps_serving(
    sampled_daemon: Daemon, program: Path, build: Callable[..., Path], tmp_path: Path
) -> None:
    target = Program(program)
    try:
        with sampled_daemon.client() as c:
            r = c.post("/targets", json={"pid": target.pid, "sample_rate": 8192})
            assert r.status_code == 201, r.text
            t = r.json()
            assert (t["mode"], t["sample_rate"], t["estimate"]) == ("sampled", 8192, True)
            target.go()
            target.expect("allocated")

            def snapshots() -> MassifFile:
                return parse_massif(c.get("/all_snapshots", params={"pid": target.pid}).text)

            # The sampled series settled: "allocated" is said before the daemon has read every point.
            seen: list[list[int]] = []

            def settled() -> bool:
                got = snapshots().snapshots
                seen.append([s.time for s in got])
                return bool(got) and got[-1].heap_B > 0 and seen[-2:] == [seen[-1]] * 2

            wait_for(settled, 30, "the sampled series of the allocated heap, settled", interval=0.5)
            info = _metric_info(c.get("/metrics").text, target.pid)
            assert {k: info[k] for k in ("pid", "command", "mode", "sample_rate")} == {
                "pid": str(target.pid), "command": "modes_sites", "mode": "sampled", "sample_rate": "8192"}
            timeline = c.get(f"/targets/{target.pid}/timeline").json()
            assert timeline["estimate"] is True
            before = snapshots()
            assert "--mode=sampled" in before.desc and before.snapshots[-1].heap_B > 0

            r = c.post(f"/targets/{target.pid}/mode", json={"mode": "exact"})
            assert r.status_code == 200, r.text
            assert (r.json()["mode"], r.json()["sample_rate"], r.json()["estimate"]) == ("exact", 1, False)
            listed = {x["pid"]: x for x in c.get("/targets").json()}
            assert listed[target.pid]["mode"] == "exact" and listed[target.pid]["state"] == "profiling"
            assert _metric_info(c.get("/metrics").text, target.pid)["mode"] == "exact"
            # The sampled series' last snapshot (taken as it ends), then the exact profile's first, at its time or
            # later. Not a count: that last snapshot may fill the series and cull it to half, as Massif's does.
            last_sampled = before.snapshots[-1].time
            wait_for(lambda: [x for x in snapshots().snapshots[-2:] if x.time >= last_sampled][1:], 30,
                     "a snapshot in exact mode")
            after = c.get("/all_snapshots", params={"pid": target.pid}).text
            parsed = parse_massif(after)
            assert "--mode=exact" in parsed.desc
            # The history goes on: the sampled phase's snapshots come first, in time order.
            times = [s.time for s in parsed.snapshots]
            assert times == sorted(times) and times[0] == before.snapshots[0].time
            assert max(s.heap_B for s in parsed.snapshots) >= before.snapshots[-1].heap_B
            printed = run_ms_print(after, tmp_path)
            assert "--mode=exact" in printed

            # A refusal leaves the daemon serving and the target profiled in its mode.
            seccomp = subprocess.Popen([str(build("sampler_seccomp.c"))], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
            try:
                assert seccomp.stdout is not None and seccomp.stdout.readline().strip() == "ready"
                r = c.post("/targets", json={"pid": seccomp.pid})
                assert 400 <= r.status_code < 500 and "seccomp" in r.json()["detail"], r.text
            finally:
                seccomp.kill()
                seccomp.wait()

            r = c.post(f"/targets/{target.pid}/mode", json={"mode": "sampled", "sample_rate": 65536})
            assert r.status_code == 200 and r.json()["sample_rate"] == 65536, r.text
            assert httpx.get(f"{sampled_daemon.url}/healthz").status_code == 200
            assert c.get("/snapshot", params={"pid": target.pid}).status_code == 200
            r = c.delete(f"/targets/{target.pid}")
            assert r.status_code == 200 and r.json()["mode"] == "sampled", r.text
        target.truth()
    finally:
        target.kill()


def _thread_nices(pid: int) -> dict[int, int]:
    """The nice level of every thread of a process (/proc/PID/task/TID/stat's 19th field)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            out[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.parametrize("nice", [None, 10])
def test_the_daemon_runs_at_its_nice_level_and_profiles(
    nice: int | None, program: Path, heapscope_cmd: list[str], tmp_path: Path
) -> None:
    """`serve --nice 10`: every thread of the daemon, the target's own included, runs at 10, and the target is
    profiled as at the default (twin: no --nice, every thread as the daemon was started: 0 here)."""
    daemon = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", *(() if nice is None else (f"--nice={nice}",)))
    target = Program(program)
    try:
        with daemon.client() as c:
            r = c.post("/targets", json={"pid": target.pid})
            assert r.status_code == 201, r.text
            target.go()
            target.expect("allocated")
            wait_for(lambda: [s for s in parse_massif(c.get("/all_snapshots", params={"pid": target.pid}).text)
                              .snapshots[-1:] if s.heap_B > 0], 30, "a snapshot of the allocated heap")
            nices = _thread_nices(daemon.proc.pid)
            assert len(nices) > 3 and set(nices.values()) == {nice or 0}, nices
            assert c.delete(f"/targets/{target.pid}").status_code == 200
        target.truth()
    finally:
        target.kill()
        stop_daemon(daemon)


def run_ms_print(text: str, tmp: Path) -> str:
    f = tmp / "served.out"
    f.write_text(text)
    return subprocess.run(["ms_print", str(f)], capture_output=True, text=True, check=True).stdout
