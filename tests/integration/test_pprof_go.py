"""heapscope's pprof profiles, read by the real `go tool pprof` (Debian's golang-go).

- `heapscope run --pprof-out-file` on pprof_known.c: `-raw` shows the four sample types, the stacks with their
  inlined call, the mapping with the program's build id (as readelf reads it); `-top` for inuse_space and
  alloc_space gives the bytes per function that follow from the program's marked lines, and equal heapscope's
  own xtree report (read by callgrind_annotate) and the final snapshot of its massif.out.
- The daemon's `/debug/pprof/heap` at three moments of daemon_target.c (before, after its allocations, after
  its frees): `-diff_base` shows exactly the growth and the shrinkage the program's source says; go tool pprof
  also fetches the profile itself over HTTP from the daemon.
- A sampled profile (no sampled mode runs yet: rendered from counters) read with its period and scaled values.

go runs offline: HOME, GOCACHE and GOPATH are temporary directories, GOTOOLCHAIN=local and GOPROXY=off.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.export.pprof import render_pprof
from agent.model.stack import Frame, SiteCounts
from tests.support.annotate import annotate_inclusive
from tests.support.capability import unavailable
from tests.support.daemon import Daemon, Target, start_daemon, stop_daemon
from tests.support.harness import PROGRAMS, Completed
from tests.support.massif_reader import parse_massif
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

KNOWN = PROGRAMS / "pprof_known.c"
DAEMON_TARGET = PROGRAMS / "daemon_target.c"


# ---- go tool pprof -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def go_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("go") is None:
        unavailable("go is not installed (Debian's golang-go)")
    home = tmp_path_factory.mktemp("gohome")
    return {
        **os.environ,
        "HOME": str(home),
        "GOCACHE": str(home / "cache"),
        "GOPATH": str(home / "gopath"),
        "GOTOOLCHAIN": "local",  # never fetch another toolchain
        "GOPROXY": "off",  # never reach for a module
        "GOFLAGS": "",
        "GOTELEMETRY": "off",
        "PPROF_TMPDIR": str(home / "pprof"),  # where pprof keeps the profiles it fetches
    }


def pprof(go_env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        ["go", "tool", "pprof", *args], capture_output=True, text=True, env=go_env, timeout=120, check=False
    )
    assert done.returncode == 0, f"go tool pprof {' '.join(args)}:\n{done.stderr}"
    return done.stdout


# flat flat% sum% cum cum% name; bytes are shown as 5000B (or 0), negative in diffs
_TOP_ROW = re.compile(r"^\s*(-?\d+)B?\s+-?[\d.]+%\s+-?[\d.]+%\s+(-?\d+)B?\s+-?[\d.]+%\s+(.+?)\s*$")


def top(go_env: dict[str, str], sample_index: str, *profile: str) -> dict[str, tuple[int, int]]:
    """`-top` in bytes with no node dropped: function -> (flat, cum)."""
    out = pprof(
        go_env, "-top", "-unit=B", "-nodefraction=0", "-edgefraction=0", f"-sample_index={sample_index}", *profile
    )
    assert f"Type: {sample_index}" in out, out
    rows = {}
    for line in out.splitlines():
        m = _TOP_ROW.match(line)
        if m:
            rows[m.group(3)] = (int(m.group(1)), int(m.group(2)))
    return rows


@dataclass
class Raw:
    """`go tool pprof -raw`: its sample types, samples (values, location ids) and locations (lines)."""

    sample_types: list[str]
    period: int
    samples: list[tuple[tuple[int, ...], tuple[int, ...]]]
    locations: dict[int, list[tuple[str, str, int]]]  # id -> (function, file, line), innermost first
    mappings: list[str]


def raw(go_env: dict[str, str], profile: str) -> Raw:
    out = pprof(go_env, "-raw", profile)
    lines = out.splitlines()
    period = int(next(line for line in lines if line.startswith("Period: ")).split()[1])
    header = lines.index("Samples:") + 1
    sample_types = lines[header].replace("[dflt]", "").split()
    samples: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    locations: dict[int, list[tuple[str, str, int]]] = {}
    mappings: list[str] = []
    section = "samples"
    current = 0
    for line in lines[header + 1 :]:
        if line in ("Locations", "Mappings"):
            section = line.lower()
            continue
        if section == "samples" and ":" in line and not line.strip().startswith("bytes:"):
            values, ids = line.split(":", 1)
            samples.append((tuple(int(v) for v in values.split()), tuple(int(i) for i in ids.split())))
        elif section == "locations":
            m = re.match(r"^\s*(\d+): 0x[0-9a-f]+ M=\d+ (\S+) (\S+):(\d+) s=\d+$", line)
            if m:
                current = int(m.group(1))
                locations[current] = [(m.group(2), Path(m.group(3)).name, int(m.group(4)))]
                continue
            m = re.match(r"^\s+(\S+) (\S+):(\d+) s=\d+$", line)
            assert m, f"unexpected location line {line!r}"
            locations[current].append((m.group(1), Path(m.group(2)).name, int(m.group(3))))
        elif section == "mappings" and line.strip():
            mappings.append(line)
    return Raw(sample_types, period, samples, locations, mappings)


# ---- what the programs' sources say --------------------------------------------------------------------------


def line_of(source: Path, text: str) -> int:
    hits = [n for n, line in enumerate(source.read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1, f"{text!r} is on {len(hits)} lines of {source}"
    return hits[0]


@dataclass(frozen=True)
class Site:
    function: str
    line: int  # of the allocation call
    main_line: int  # of main's call of the function
    count: int
    size: int
    live: int  # blocks live at exit

    @property
    def values(self) -> tuple[int, int, int, int]:
        """alloc_objects, alloc_space, inuse_objects, inuse_space"""
        return (self.count, self.count * self.size, self.live, self.live * self.size)


def known_sites() -> dict[str, Site]:
    """From pprof_known.c's marked lines: `MARK: N x S B`, and what stays live (`live at exit`, `all freed`,
    `the first K freed`)."""
    sites = {}
    for marker, function, caller in (
        ("KEEP:", "keep_blocks", "keep_blocks"),
        ("CHURN:", "churn", "churn"),
        ("INLINED:", "grow_buffer", "fill_buffers"),
        ("HALF:", "half_freed", "half_freed"),
    ):
        line = line_of(KNOWN, marker)
        text = KNOWN.read_text().splitlines()[line - 1]
        m = re.search(r"(\d+) x (\d+) B, (.*) \*/", text)
        assert m, text
        count, size, fate = int(m.group(1)), int(m.group(2)), m.group(3)
        freed = re.search(r"the first (\d+) freed", fate)
        live = (
            count
            if "live at exit" in fate
            else 0
            if "all freed" in fate
            else count - int(freed.group(1))
            if freed
            else -1
        )
        assert live >= 0, f"cannot tell what stays live from {fate!r}"
        sites[function] = Site(function, line, line_of(KNOWN, f"    {caller}();"), count, size, live)
    return sites


# ---- heapscope run --pprof-out-file on pprof_known.c -----------------------------------------------------------


@dataclass
class KnownRun:
    run: Completed
    program: Path
    profile: Path


@pytest.fixture(scope="module")
def known(build: Callable[..., Path], run_heapscope: Callable[..., Completed]) -> KnownRun:
    program = build("pprof_known.c")
    done = run_heapscope(program, (), ("--pprof-out-file=heap.%p.pb.gz",), xtree=True)
    assert done.returncode == 0, done.stderr
    written = list(done.massif_out.parent.glob("heap.*.pb.gz"))
    assert len(written) == 1, f"no pprof file written; stderr:\n{done.stderr}"
    assert f"wrote {written[0].name}" in done.stderr
    return KnownRun(done, program, written[0])


def test_raw_shows_the_four_sample_types_and_the_stacks(known: KnownRun, go_env: dict[str, str]) -> None:
    r = raw(go_env, str(known.profile))
    assert r.sample_types == ["alloc_objects/count", "alloc_space/bytes", "inuse_objects/count", "inuse_space/bytes"]
    assert r.period == 1
    got = {tuple(loc for i in ids for loc in r.locations[i]): values for values, ids in r.samples}
    expected = {}
    for s in known_sites().values():
        if s.function == "grow_buffer":  # inlined: two lines of one location, the inlined function first
            call = line_of(KNOWN, "INLINE_CALL:")
            stack = (("grow_buffer", KNOWN.name, s.line), ("fill_buffers", KNOWN.name, call))
        else:
            stack = ((s.function, KNOWN.name, s.line),)
        expected[(*stack, ("main", KNOWN.name, s.main_line))] = s.values
    assert got == expected
    # the inlined call and the function it is inlined into share one location (one address)
    [inlined] = [ids for values, ids in r.samples if r.locations[ids[0]][0][0] == "grow_buffer"]
    assert [f for f, _, _ in r.locations[inlined[0]]] == ["grow_buffer", "fill_buffers"]


def test_the_mapping_carries_the_programs_build_id(known: KnownRun, go_env: dict[str, str]) -> None:
    notes = subprocess.run(["readelf", "-n", str(known.program)], capture_output=True, text=True, check=True).stdout
    build_id = re.search(r"Build ID: ([0-9a-f]+)", notes)
    assert build_id, notes
    r = raw(go_env, str(known.profile))
    main = r.mappings[0]  # mapping[0] is the main executable
    assert f" {known.program} {build_id.group(1)} " in main, r.mappings
    assert main.endswith("[FN][FL][LN][IN]"), main  # symbolized already: pprof trusts the functions and lines
    header = pprof(go_env, "-top", str(known.profile))
    assert f"File: {known.program.name}" in header and f"Build ID: {build_id.group(1)}" in header


def annotate(xtree: Path) -> dict[str, tuple[int, int]]:
    """callgrind_annotate --inclusive=yes on heapscope's xtree: function -> (curB, totB)."""
    return {fn: (row[0], row[2]) for (_, fn), row in annotate_inclusive(xtree).items()}


def test_top_bytes_per_function(known: KnownRun, go_env: dict[str, str]) -> None:
    """inuse_space and alloc_space per function: what the source says, and what heapscope's xtree says."""
    sites = known_sites()
    inuse = top(go_env, "inuse_space", str(known.profile))
    alloc = top(go_env, "alloc_space", str(known.profile))
    for s in sites.values():
        name = "grow_buffer (inline)" if s.function == "grow_buffer" else s.function
        live, total = s.live * s.size, s.count * s.size
        if live:
            assert inuse[name] == (live, live), name
        else:
            assert inuse.get(name, (0, 0)) == (0, 0), name
        assert alloc[name] == (total, total), name
    assert inuse["main"][1] == sum(s.live * s.size for s in sites.values())
    assert alloc["main"][1] == sum(s.count * s.size for s in sites.values())
    # heapscope's xtree, inclusive per function: pprof's cum. The xtree names an address by its real function,
    # so the inlined grow_buffer's bytes are fill_buffers' there, as they are its cum in pprof.
    assert known.run.xtree_out is not None
    xtree = annotate(known.run.xtree_out)
    assert set(xtree) == {"main", "keep_blocks", "churn", "fill_buffers", "half_freed"}
    for fn, (cur_b, tot_b) in xtree.items():
        assert (inuse.get(fn, (0, 0))[1], alloc[fn][1]) == (cur_b, tot_b), fn
    assert inuse["grow_buffer (inline)"][0] == xtree["fill_buffers"][0]
    assert inuse["fill_buffers"][0] == 0 and alloc["fill_buffers"][0] == 0


def test_inuse_space_equals_the_final_massif_snapshot(known: KnownRun, go_env: dict[str, str]) -> None:
    final = parse_massif(known.run.massif_text).snapshots[-1]
    assert final.tree is not None
    inuse = top(go_env, "inuse_space", str(known.profile))
    assert inuse["main"][1] == final.heap_B
    # the tree's first level is the allocation site: bytes per function there are pprof's flat bytes
    by_function: dict[str, int] = {}
    for child in final.tree.children:
        fn = re.sub(r"^0x[0-9A-F]+: ", "", child.label).split(" (")[0]
        by_function[fn] = by_function.get(fn, 0) + child.bytes
    shown = {("grow_buffer" if k == "grow_buffer (inline)" else k): flat for k, (flat, _) in inuse.items() if flat}
    assert shown == {k: v for k, v in by_function.items() if v}


# ---- the daemon: two moments and -diff_base ------------------------------------------------------------------


@pytest.fixture
def daemon(heapscope_cmd: list[str], tmp_path: Path) -> Iterator[Daemon]:
    # loopback: no token, so go tool pprof can fetch; each target's profile is also written when it ends
    d = start_daemon(heapscope_cmd, tmp_path, "--pprof-out-file=heap.%p.pb.gz", token=None)
    yield d
    stop_daemon(d)


def daemon_target_growth() -> dict[str, int]:
    """daemon_target.c: site_small allocates `for (i < N) malloc(S)`, as does site_big."""
    text = DAEMON_TARGET.read_text()
    out = {}
    for fn, var in (("site_small", "small"), ("site_big", "big")):
        m = re.search(
            rf"void {fn}\(void\)\s*\{{\s*for \(int i = 0; i < (\d+); i\+\+\) \{{\s*{var}\[i\] = malloc\((\d+)\);", text
        )
        assert m, fn
        out[fn] = int(m.group(1)) * int(m.group(2))
    return out


def test_diff_base_shows_the_known_growth_and_shrinkage(
    daemon: Daemon, build: Callable[..., Path], go_env: dict[str, str], tmp_path: Path
) -> None:
    growth = daemon_target_growth()
    target = Target(build("daemon_target.c"))
    try:
        with daemon.client() as client:
            assert client.post("/targets", json={"pid": target.pid}, timeout=120).status_code == 201
            moments = {}

            def take(name: str, path: str = f"/debug/pprof/heap?pid={target.pid}") -> str:
                r = client.get(path)
                assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
                file = tmp_path / f"{name}.pb.gz"
                file.write_bytes(r.content)
                moments[name] = str(file)
                return str(file)

            take("before", f"/pprof?pid={target.pid}")
            target.step("allocated")
            take("allocated", "/debug/pprof/heap")  # one target: no pid needed
            target.step("freed")
            take("freed", f"/targets/{target.pid}/debug/pprof/heap")
            # go tool pprof fetches the profile itself too, from Go's allocs path
            fetched = pprof(go_env, "-top", "-unit=B", f"{daemon.url}/debug/pprof/allocs?pid={target.pid}")
            assert "Type: alloc_space" in fetched
        grown = top(go_env, "inuse_space", f"-diff_base={moments['before']}", moments["allocated"])
        assert grown["site_small"] == (growth["site_small"],) * 2
        assert grown["site_big"] == (growth["site_big"],) * 2
        assert grown["main"][1] == growth["site_small"] + growth["site_big"]
        shrunk = top(go_env, "inuse_space", f"-diff_base={moments['allocated']}", moments["freed"])
        assert shrunk["site_small"] == (-growth["site_small"],) * 2
        assert shrunk.get("site_big", (0, 0)) == (0, 0)
        # freeing allocates nothing: no alloc_space between those two moments
        assert all(
            v == (0, 0)
            for v in top(go_env, "alloc_space", f"-diff_base={moments['allocated']}", moments["freed"]).values()
        )
        allocated = top(go_env, "alloc_space", f"-diff_base={moments['before']}", moments["freed"])
        assert allocated["main"][1] == growth["site_small"] + growth["site_big"]
    finally:
        target.end()
    # --pprof-out-file: the daemon writes the target's final profile under its output directory when it exits
    written = daemon.out_dir / f"heap.{target.pid}.pb.gz"
    wait_for(lambda: f"wrote {written}" in daemon.stderr(), 60, f"the daemon to write {written}")
    final = top(go_env, "inuse_space", str(written))
    assert final["site_big"] == (growth["site_big"],) * 2 and "site_small" not in final


# ---- a sampled profile -------------------------------------------------------------------------------------


def test_a_sampled_profile_reads_with_its_period_and_estimates(go_env: dict[str, str], tmp_path: Path) -> None:
    """No sampled mode runs yet: the counters of 4 samples of 64 B and 2 of 1 MiB at a 512 KiB rate."""
    rate = 512 * 1024
    small = (Frame(0x1000, "small_allocs", "s.c", 5), Frame(0x2000, "main", "s.c", 20))
    large = (Frame(0x1100, "large_allocs", "s.c", 9), Frame(0x2010, "main", "s.c", 21))
    sites = {
        small: SiteCounts(cur_bytes=256, cur_blocks=4, tot_bytes=256, tot_blocks=4),
        large: SiteCounts(cur_bytes=2 << 20, cur_blocks=2, tot_bytes=2 << 20, tot_blocks=2),
    }
    file = tmp_path / "sampled.pb.gz"
    file.write_bytes(render_pprof(sites, sample_rate=rate))
    r = raw(go_env, str(file))
    assert r.period == rate
    estimate_small = int(256 / (1 - math.exp(-64 / rate)))  # each 64-byte sample stands for ~8192 blocks
    estimate_large = int((2 << 20) / (1 - math.exp(-(1 << 20) / rate)))
    inuse = top(go_env, "inuse_space", str(file))
    assert inuse["small_allocs"][0] == estimate_small
    assert inuse["large_allocs"][0] == estimate_large
    assert 8192 * 256 * 0.99 < estimate_small < 8192 * 256 * 1.01
