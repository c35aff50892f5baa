"""heapscope across the container wall, with real containers (tests/support/containers.py): Debian 12 and Debian 11
roots made by debootstrap from the package registry, a musl-only root, each program started as a runtime starts
it (its own mount and PID namespaces, its own /proc, pivot_root), and a chroot in its own mount namespace.

- exact mode reads the container's own files: the tree of a program in a container is the tree of the same
  program on the host, every frame unwound by table;
- sampled mode (the default) gets in without touching the container's filesystem (a memfd), into glibc 2.36
  and 2.31, and the container's own redis-server answers its benchmark while sampled, after a detach and after
  heapscope's SIGKILL;
- a chroot'ed process is profiled in both modes; a musl program in exact mode, and refused in sampled mode with
  one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.annotate import annotate_inclusive
from tests.support.armed import sampler_state
from tests.support.capability import unavailable
from tests.support.containers import (
    Container,
    Unavailable,
    build_against,
    build_runner,
    debian_root,
    musl_root,
    pod_cgroups,
    remove_cgroups,
    wait_redis,
)
from tests.support.daemon import free_port, start_daemon, stop_daemon
from tests.support.massif_reader import paths, read_massif
from tests.support.sampled_sites import SCALE, SITES, check_estimates, sampling_rate
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

PROGRAM_DIR = "/opt/heapscope-test"  # where a test's own program goes inside a root


def _root(release: str) -> Path:
    try:  # libc6-dev: the tests build programs against the root's own glibc (build_against)
        return debian_root(release, ("redis-server", "libc6-dev"))
    except Unavailable as exc:
        unavailable(str(exc))
        raise


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_runner(tmp_path_factory.mktemp("runner"))


@pytest.fixture(scope="session")
def bookworm(bpf_ready: None) -> Path:
    return _root("bookworm")


@pytest.fixture(scope="session")
def bullseye(bpf_ready: None) -> Path:
    return _root("bullseye")


def put(root: Path, program: Path) -> str:
    """Copy one of the tests' programs into the root; its path inside."""
    inside = Path(PROGRAM_DIR) / program.name
    (root / inside.relative_to("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(program, root / inside.relative_to("/"))
    return str(inside)


class Profile:
    """`heapscope attach` on a PID, its log read line by line; ended by SIGINT (files written) or SIGKILL."""

    def __init__(self, cli: list[str], pid: int, cwd: Path, *args: str) -> None:
        self.proc = subprocess.Popen([*cli, "attach", *args, str(pid)], cwd=cwd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 120) -> None:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stderr:
            self.lines.append(line)
            if text in line:
                return
            assert time.monotonic() < deadline, "".join(self.lines)
        raise AssertionError(f"heapscope ended before {text!r}:\n{''.join(self.lines)}")

    def end(self, sig: int = signal.SIGINT) -> str:
        self.proc.send_signal(sig)
        rest = self.proc.communicate(timeout=120)[1]
        log = "".join(self.lines) + (rest or "")
        assert "Traceback" not in log, log
        return log


def drive(stdin: object, stdout: object) -> None:
    """daemon_target's two steps: allocate, then free the small blocks."""
    for step, answer in ((b"\n", b"allocated"), (b"\n", b"freed")):
        stdin.write(step)  # type: ignore[attr-defined]
        stdin.flush()  # type: ignore[attr-defined]
        assert answer in stdout.readline()  # type: ignore[attr-defined]


def exact_tree(cli: list[str], pid: int, stdin: object, stdout: object, tmp: Path) -> tuple[dict, str]:  # type: ignore[type-arg]
    out = tmp / f"massif.out.{pid}"
    prof = Profile(cli, pid, tmp, "--mode=exact", f"--massif-out-file={out}")
    prof.wait_for("probes attached")
    drive(stdin, stdout)  # every call made: the profile's end reads them all (Session.finish)
    log = prof.end()
    last = read_massif(out).last_detailed
    assert last is not None and last.tree is not None
    return paths(last.tree), log


@pytest.fixture
def target_program(build: Callable[..., Path]) -> Path:
    return build("daemon_target.c")


def test_exact_mode_in_a_container_gives_the_tree_of_the_same_program_on_the_host(
    heapscope_cmd: list[str], runner: Path, bookworm: Path, target_program: Path, tmp_path: Path
) -> None:
    inside = put(bookworm, target_program)
    box = Container(runner, bookworm, [inside])
    host = subprocess.Popen([str(target_program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert box.in_own_namespaces()
        assert box.proc.stdout is not None and b"ready" in box.proc.stdout.readline()
        assert host.stdout is not None and b"ready" in host.stdout.readline()
        in_box, box_log = exact_tree(heapscope_cmd, box.pid, box.proc.stdin, box.proc.stdout, tmp_path)
        on_host, host_log = exact_tree(heapscope_cmd, host.pid, host.stdin, host.stdout, tmp_path)
    finally:
        box.stop()
        host.kill()
        host.wait()
    assert in_box == on_host and any("site_big (daemon_target.c:" in "/".join(p) for p in in_box), (in_box, on_host)
    for log in (box_log, host_log):
        assert "no table for" not in log and " 0 with no rule" in log, log


@pytest.mark.parametrize(
    "options", [(), ("--sample-rate=1",), ("--mode=exact",)], ids=["default", "sampled-every-call", "exact"]
)
def test_a_container_program_that_has_ended_keeps_its_global_variables_in_malt(
    heapscope_cmd: list[str], runner: Path, bookworm: Path, target_program: Path, tmp_path: Path,
    options: tuple[str, ...],
) -> None:  # fmt: skip
    """A container's files are opened through its /proc/PID/root, which goes when it ends, and its profile is
    symbolized and written then (sampled mode, the default): its root is held open, and its files read through it.
    MALT's global variables and maps, and pprof's mappings, name its files as the container does. At the default
    rate its few small blocks are likely not sampled; sampling every call, or in exact mode, its stacks, made just
    before it ends, are named in both files too."""
    inside = put(bookworm, target_program)
    box = Container(runner, bookworm, [inside])
    malt = tmp_path / "malt.json"
    try:
        assert box.proc.stdout is not None and b"ready" in box.proc.stdout.readline()
        pprof = tmp_path / "heap.pb.gz"
        prof = Profile(heapscope_cmd, box.pid, tmp_path, f"--malt-out-file={malt}", f"--pprof-out-file={pprof}",
                       *options)  # fmt: skip
        prof.wait_for("probes attached" if "--mode=exact" in options else "sampler armed")
        drive(box.proc.stdin, box.proc.stdout)
        assert box.proc.stdin is not None
        box.proc.stdin.close()  # the program's EOF: it exits, and the profile ends with it
        assert prof.proc.wait(120) == 0, "".join(prof.lines)
        assert not os.path.exists(f"/proc/{box.pid}/root/{inside}")
    finally:
        box.stop()
    doc = json.loads(malt.read_text())
    variables = doc["memStats"]["globalVariables"]
    ours = {v["name"]: v["size"] for v in variables[inside]}  # under its name in the container
    assert ours.get("small") == 5 * 8 and ours.get("big") == 3 * 8, ours
    assert any("libc.so.6" in name and found for name, found in variables.items()), list(variables)
    files = {row["file"] for row in doc["sites"]["map"]}
    assert inside in files and not any(f.startswith("/proc/") for f in files), files
    if options:  # every call recorded
        names = doc["sites"]["strings"]
        functions = {names[e["function"]] for e in doc["sites"]["instr"].values() if "function" in e}
        assert {"site_small", "site_big", "malloc", "free"} <= functions, sorted(functions)
        raw = subprocess.run(["go", "tool", "pprof", "-raw", str(pprof)], capture_output=True, text=True, timeout=120,
                             check=True).stdout  # fmt: skip
        assert "site_big" in raw, raw[:2000]
        mapped = raw[raw.index("Mappings") :]
        assert inside in mapped and "/proc/" not in mapped, mapped  # its files by their names in the container


def snapshot_of(root: Path) -> dict[str, tuple[int, int]]:
    """Every path of a root with its size and mtime, /proc and /dev aside."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == str(root):
            dirnames[:] = [d for d in dirnames if d not in ("proc", "dev", "sys")]
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def benchmark(port: int) -> float:
    done = subprocess.run(["redis-benchmark", "-p", str(port), "-q", "-n", "20000", "-t", "set,get"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "requests per second" in done.stdout, done.stdout + done.stderr
    rates = [float(r) for r in re.findall(r"[A-Z]+: ([\d.]+) requests per second", done.stdout)]
    assert len(rates) == 2, done.stdout
    return min(rates)


@pytest.mark.parametrize("release", ["bookworm", "bullseye"])
def test_sampled_mode_gets_into_a_containers_redis_through_a_memfd_and_leaves_nothing(
    heapscope_cmd: list[str], runner: Path, request: pytest.FixtureRequest, release: str, tmp_path: Path
) -> None:
    root: Path = request.getfixturevalue(release)
    port = free_port()
    box = Container(runner, root, ["/usr/bin/redis-server", "--port", str(port), "--save", "", "--appendonly", "no"])
    try:
        before = snapshot_of(root)
        wait_redis(port)
        prof = Profile(heapscope_cmd, box.pid, tmp_path, "--sample-rate", "4096")  # sampled: the default
        prof.wait_for("sampler armed")
        assert any("handed over in a memfd" in line for line in prof.lines), prof.lines
        assert any("/memfd:libhs_sampler-" in line for line in Path(f"/proc/{box.pid}/maps").read_text().splitlines())
        benchmark(port)  # no error while sampled
        log = prof.end()
        samples = [line for line in log.splitlines() if "samples," in line]
        assert samples and " 0 samples" not in samples[0], log
        benchmark(port)  # and after the detach
        again = Profile(heapscope_cmd, box.pid, tmp_path)
        again.wait_for("sampler armed")
        assert any("already loaded" in line for line in again.lines)  # the memfd's library, reused
        again.end(signal.SIGKILL)
        wait_for(lambda: sampler_state(box.pid) != "armed", 5, "the sampler to go inert after its controller's end")
        benchmark(port)
        assert box.proc.poll() is None
        assert snapshot_of(root) == before  # nothing written into the container's filesystem
    finally:
        box.stop()


@pytest.mark.parametrize("mode,with_proc", [("exact", False), ("sampled", True), ("sampled", False)],
                         ids=["exact", "sampled-memfd", "sampled-folder"])
def test_a_chrooted_process_is_profiled_in_both_modes(
    heapscope_cmd: list[str], bookworm: Path, target_program: Path, tmp_path: Path, mode: str, with_proc: bool
) -> None:
    """In its own mount namespace, chroot'ed: its maps show the host's paths, its root is the chroot directory.
    Sampled mode hands the sampler over through the chroot's /proc, mounted as schroot does; in a bare chroot (no
    /proc inside, as haproxy's worker has it) through the library's folder, made the working directory of the
    loading thread alone for the dlopen and put back after; exact mode needs neither."""
    inside = put(bookworm, target_program)
    setup = f'mount -t proc proc "{bookworm}/proc" && ' if with_proc else ""
    proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", f'{setup}exec chroot "{bookworm}" {inside}'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline()
        pid = proc.pid  # unshare, sh and chroot exec the program in turn
        assert os.readlink(f"/proc/{pid}/root") == str(bookworm)
        assert os.path.ismount(f"{bookworm}/proc") is False  # its /proc is in its own mount namespace only
        cwd = os.readlink(f"/proc/{pid}/cwd")
        before = snapshot_of(bookworm)
        out = tmp_path / "chroot.out"
        rate = ("--sample-rate", "1") if mode == "sampled" else ()  # every byte: the tree is exact
        prof = Profile(heapscope_cmd, pid, tmp_path, f"--mode={mode}", *rate, f"--massif-out-file={out}")
        prof.wait_for("sampler armed" if mode == "sampled" else "probes attached")
        if mode == "sampled" and not with_proc:
            assert any("from its folder, handed over" in line for line in prof.lines), prof.lines
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "/libhs_sampler-bare-" in maps, maps
            assert os.readlink(f"/proc/{pid}/cwd") == cwd  # its working directory put back
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            assert not [f for f in fds if f.startswith("socket:") or "heapscope" in f], fds
        drive(proc.stdin, proc.stdout)
        log = prof.end()
        assert "cannot read" not in log and "no table for" not in log, log
        peak = read_massif(out).peak
        assert peak is not None and peak.tree is not None
        labels = "\n".join("/".join(p) for p in paths(peak.tree))
        assert "site_big (daemon_target.c:" in labels and "site_small (daemon_target.c:" in labels, labels
        assert snapshot_of(bookworm) == before  # nothing written into its root
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def musl_program(tmp_path: Path) -> Path:
    if shutil.which("musl-gcc") is None:
        unavailable("musl-gcc (musl-tools) is not installed")
    out = tmp_path / "musl_target"
    from tests.support.harness import PROGRAMS

    subprocess.run(["musl-gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-o", str(out),
                    str(PROGRAMS / "daemon_target.c")], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_a_musl_program_in_a_musl_root_is_profiled_in_both_modes(
    heapscope_cmd: list[str], runner: Path, musl_program: Path, tmp_path: Path, mode: str
) -> None:
    """musl's libc is its loader: discovery finds malloc there, and sampled mode loads the musl build of the
    sampler (global-dynamic TLS, no glibc unwinder) through musl's dlopen, from a memfd."""
    root = musl_root(tmp_path / "musl-root", {"musl_target": musl_program})
    box = Container(runner, root, ["/bin/musl_target"])
    out = tmp_path / "musl.out"
    try:
        assert box.proc.stdout is not None and b"ready" in box.proc.stdout.readline()
        rate = ("--sample-rate", "1") if mode == "sampled" else ()
        prof = Profile(heapscope_cmd, box.pid, tmp_path, f"--mode={mode}", *rate, f"--massif-out-file={out}")
        prof.wait_for("sampler armed" if mode == "sampled" else "probes attached")
        drive(box.proc.stdin, box.proc.stdout)
        log = prof.end()
    finally:
        box.stop()
    assert "allocator: musl (" in log, log
    if mode == "sampled":
        assert "sampler (musl build) loaded into" in log and "handed over in a memfd" in log, log
    peak = read_massif(out).peak
    assert peak is not None and peak.tree is not None
    labels = "\n".join("/".join(p) for p in paths(peak.tree))
    assert "site_big (daemon_target.c:" in labels and "site_small (daemon_target.c:" in labels, labels


def test_the_sampler_asks_for_no_glibc_newer_than_2_17(build: Callable[..., Path]) -> None:
    """Its dynamic symbol table: every glibc version it needs is 2.17 or older, and it names the libraries that
    held dlsym and pthread_create before glibc 2.34 (so it loads into Debian 11's glibc 2.31, tested above), and
    not libm."""
    from agent.process.sampler import build_sampler

    library = build_sampler()
    symbols = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    versions = set(re.findall(r"\(GLIBC_([\d.]+)\)", symbols))
    assert versions and "2.2.5" in versions
    too_new = [v for v in versions if tuple(int(x) for x in v.split(".")) > (2, 17)]
    assert not too_new, [line for line in symbols.splitlines() if any(f"GLIBC_{v})" in line for v in too_new)]
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "[libdl.so.2]" in needed and "[libpthread.so.0]" in needed, needed
    # libm, loaded into a prefork server's master, changed how its workers' heaps grew (test_inject.py).
    assert "[libm.so.6]" not in needed, needed


def test_the_daemon_profiles_containers_started_after_it_in_sampled_mode_with_their_pod_and_container(
    heapscope_cmd: list[str], runner: Path, bookworm: Path, bullseye: Path, tmp_path: Path
) -> None:
    """Its defaults (sampled mode), a selector by pod, three containers in that pod started after the daemon (two
    of one image, Debian 12, and one of Debian 11, whose files have the same paths): each profiled, with its pod
    and container in /targets, the sampler handed over in a memfd. The two of one image share their unwind
    tables in the kernel (said in each one's summary); the Debian 11 one, the same paths but other files, shares
    none."""
    pod = str(uuid.uuid4())
    ids = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(3)]
    cgroups = pod_cgroups(pod, ids)
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--attach-cgroup", f"pod:{pod}")
    boxes: list[Container] = []
    try:
        for cg, root in zip(cgroups, (bookworm, bookworm, bullseye), strict=True):
            port = free_port()
            boxes.append(Container(runner, root, ["/usr/bin/redis-server", "--port", str(port), "--save", "",
                                                  "--appendonly", "no"], cgroup=cg))

        def held() -> dict[int, dict]:  # type: ignore[type-arg]
            with d.client() as c:
                return {t["pid"]: t for t in c.get("/targets").json()}

        wait_for(lambda: all(held().get(b.pid, {}).get("state") == "profiling" for b in boxes), 240,
                 "the three containers profiled")
        targets = held()
        for box, container in zip(boxes, ids, strict=True):
            t = targets[box.pid]
            assert t["mode"] == "sampled" and t["error"] is None and t["sampler"] == "glibc build, memfd", t
            assert t["allocator"] == "jemalloc"  # Debian's redis-server
            placement = t["origin"]["placement"]
            assert (placement["pod"], placement["container"], placement["runtime"]) == (pod, container, "containerd")
    finally:
        stop_daemon(d)  # each target's summary goes to the log
        for b in boxes:
            b.stop()
        remove_cgroups(cgroups)
    log = d.stderr()
    assert log.count("handed over in a memfd") == 3, log
    rows = {b.pid: rows_said(log, b.pid) for b in boxes}  # (rows used, rows already in the kernel)
    # Each object's rows are loaded once for the two of one image: by whichever target's attach reached it first
    # (the attaches run side by side), so what one loaded the other found in the kernel.
    first, second = (rows[b.pid] for b in boxes[:2])
    assert first[0] == second[0] and first[1] + second[1] == first[0], rows
    used, shared = rows[boxes[2].pid]
    # Debian 11's objects have the paths of Debian 12's, and none of its rows: it shares only the sampler's (the
    # same library in all three, handed over in each one's memfd).
    assert 0 < shared < used / 100, rows


def rows_said(log: str, pid: int) -> tuple[int, int]:
    """A target's unwind rows in its summary: (rows used, rows that were in the kernel already)."""
    used = re.search(rf"heapscope: {pid}: unwind: (\d+) table rows", log)
    shared = re.search(rf"heapscope: {pid}: unwind: (\d+) of those rows were in the kernel already", log)
    assert used is not None, log
    return int(used.group(1)), int(shared.group(1)) if shared else 0


@pytest.mark.parametrize("where", ["bookworm", "bullseye", "musl"])
def test_sampled_estimates_in_a_container_are_within_10_percent_of_the_truth(
    heapscope_cmd: list[str], runner: Path, build: Callable[..., Path], request: pytest.FixtureRequest,
    tmp_path: Path, where: str
) -> None:
    """modes_sites.c (its sites' live bytes known) in a Debian 12 container, a Debian 11 one (glibc 2.31, built
    against it) and a musl root: each site of 10% of the heap or more estimated within 10%, with 1,600 samples
    or more expected per site."""
    if where == "musl":
        if shutil.which("musl-gcc") is None:
            unavailable("musl-gcc (musl-tools) is not installed")
        program = tmp_path / "modes_sites"
        from tests.support.harness import PROGRAMS

        subprocess.run(["musl-gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-pthread", "-o", str(program),
                        str(PROGRAMS / "modes_sites.c")], check=True, capture_output=True)
        root = musl_root(tmp_path / "musl-root", {"modes_sites": program})
        inside = "/bin/modes_sites"
    elif where == "bullseye":
        root = request.getfixturevalue("bullseye")
        from tests.support.harness import PROGRAMS

        program = build_against(root, PROGRAMS / "modes_sites.c", tmp_path / "modes_sites",
                                ("-g", "-O0", "-fno-omit-frame-pointer"))
        inside = put(root, program)
    else:
        root = request.getfixturevalue("bookworm")
        inside = put(root, build("modes_sites.c"))
    rate = sampling_rate(SCALE)
    out = tmp_path / "sampled.out"
    xtree = tmp_path / "sampled.kcg"
    box = Container(runner, root, [inside, str(SCALE), "wait"])
    try:
        assert box.proc.stdin is not None and box.proc.stdout is not None
        assert box.proc.stdout.readline().strip() == b"ready"
        # judged at its rate, as test_modes' sampled run: no budget to raise it for its burst of samples
        prof = Profile(heapscope_cmd, box.pid, tmp_path, f"--sample-rate={rate}", "--max-samples=0", "--time-unit=B",
                       "--threshold=0.0",
                       "--detailed-freq=1", f"--massif-out-file={out}", "--xtree-memory=allocs",
                       f"--xtree-memory-file={xtree}")
        prof.wait_for("sampler armed")
        box.proc.stdin.write(b"go\n")
        box.proc.stdin.flush()
        assert box.proc.stdout.readline().strip() == b"allocated"
        log = prof.end()
        box.proc.stdin.write(b"go\n")
        box.proc.stdin.flush()
        truth = {name: int(value) for _, name, value in
                 (line.split() for line in box.proc.stdout.read().decode().splitlines())}
    finally:
        box.stop()
    assert set(truth) == set(SITES) and "handed over in a memfd" in log, (truth, log)
    assert read_massif(out).last_detailed is not None
    # The end state (a massif.out ends at its last snapshot, as Massif's): the xtree report's live bytes.
    end = {fn: v[0] for (src, fn), v in annotate_inclusive(xtree).items() if src == "modes_sites.c"}
    check_estimates(end, truth, rate)


def test_a_daemon_in_its_own_container_profiles_host_and_container_processes_in_sampled_mode(
    heapscope_cmd: list[str], runner: Path, bookworm: Path, build: Callable[..., Path], tmp_path: Path
) -> None:
    """As the DaemonSet runs it (deploy/kubernetes: hostPID, its own image): the daemon in a mount namespace of
    its own whose files no target sees (its sampler cache on a private tmpfs). A process on the host and one in
    a container both get the sampler through a memfd, and their files are read through their own roots."""
    cache = tmp_path / "daemon-cache"
    cache.mkdir(mode=0o755)
    own = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs -o mode=755 none {cache} && HEAPSCOPE_CACHE_DIR={cache} exec "$@"', "sh", *heapscope_cmd]
    host = subprocess.Popen([str(build("daemon_target.c"))], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    box = Container(runner, bookworm, ["/usr/bin/redis-server", "--port", str(free_port()), "--save", "",
                                       "--appendonly", "no"])
    d = start_daemon(own, tmp_path, "--mode=sampled")  # the daemon's default, said explicitly
    try:
        assert host.stdout is not None and b"ready" in host.stdout.readline()
        with d.client() as c:
            # daemon_target is single-threaded, kept so (threadless); redis-server has its threads
            for pid, how in ((host.pid, "glibc build, memfd, threadless"), (box.pid, "glibc build, memfd")):
                r = c.post("/targets", json={"pid": pid, "mode": "sampled"}, timeout=180)
                assert r.status_code == 201, r.text
                assert r.json()["sampler"] == how, r.json()
        drive(host.stdin, host.stdout)
        assert not list(cache.iterdir())  # the daemon's cache is its own: empty from here
    finally:
        stop_daemon(d)
        box.stop()
        host.kill()
        host.wait()
    log = d.stderr()
    assert "no table for" not in log and log.count("handed over in a memfd") == 2, log


def test_a_process_the_daemon_cannot_sample_shows_as_refused_in_targets_with_why(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    """A static program chosen by a selector in sampled mode: no libc to dlopen the sampler with. It is in
    /targets as refused, with the reason, not only in the log, and it runs on untouched."""
    static = tmp_path / "hs-static-prog"
    shutil.copy2(build("sampler_wait.c", flags=("-g", "-O0", "-static")), static)
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--attach-comm", "^hs-static-prog$")
    proc = subprocess.Popen([str(static)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        def refused() -> dict | None:  # type: ignore[type-arg]
            with d.client() as c:
                return next((t for t in c.get("/targets").json() if t["pid"] == proc.pid), None)

        # Listed as attaching while the daemon tries it (its first target compiles the program), then refused.
        wait_for(lambda: (refused() or {}).get("state") not in (None, "attaching"), 60,
                 "the static program in /targets, tried")
        t = refused()
        assert t is not None and t["state"] == "refused" and "a static program" in t["error"], t
        with d.client() as c:
            assert "heapscope_targets_waiting 0.0" in c.get("/metrics").text
        assert proc.poll() is None
    finally:
        stop_daemon(d)
        proc.kill()
        proc.wait()
