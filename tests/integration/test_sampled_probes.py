"""Sampled mode's kernel side (probes/bpf/sampled.h): uprobes on the sampler's probe functions walk the stack
and aggregate per stack at each sample's weight. Judged by the sites program's own record of its blocks:
the live bytes the kernel keeps per call site are within 10% of the truth for every site holding 10% or
more of the heap, and exactly zero for a site once all its blocks are freed."""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.kernel.interface import ProbeSettings, UnwindMapping
from agent.kernel.probes import HeapProbes
from agent.model.options import MassifOptions
from agent.model.sampling import ProfileMode
from agent.process.sampler import SamplerControl, build_sampler, read_map_lines
from agent.process.target import attach_to
from agent.session.pipeline import Profile, ProfileSettings
from agent.symbols.elf import open_elf
from agent.symbols.unwind import load_table
from tests.support.conversation import Conversation
from tests.support.sampler_probes import sampler_points
from tests.support.sampler_sites import EXPECTED_SITE_BYTES, site_rate

pytestmark = pytest.mark.integration

SITE_FUNCTIONS = {"site_tiny": 0, "site_medium": 1, "site_large": 2, "site_calloc": 3}


@pytest.fixture(scope="session")
def sampler_lib(tmp_path_factory: pytest.TempPathFactory, bpf_ready: None) -> Path:
    directory = tmp_path_factory.mktemp("sampler-cache")
    os.chmod(directory, 0o755)
    return build_sampler(directory)


def site_of(stack: tuple[int, ...], ranges: dict[int, tuple[int, int]]) -> int | None:
    for ip in stack:
        for site, (lo, hi) in ranges.items():
            if lo <= ip - 1 < hi:
                return site
    return None


def unwind_mappings(pid: int) -> list[UnwindMapping]:
    """The unwind tables of the target's executable mappings, as the session publishes them."""
    out = []
    for m in read_map_lines(pid):
        if "x" not in m.perms or not m.path.startswith("/"):
            continue
        path = f"/proc/{pid}/root{m.path}"
        table = load_table(path)
        vaddr = open_elf(path).file_offset_to_vaddr(m.offset)
        if vaddr is None:
            continue
        key = table.build_id or f"{m.path}:{os.stat(path).st_mtime_ns}"
        out.append(UnwindMapping(m.start, m.end, m.start - vaddr, key, table.rows, table.n_rows))
    return out


@pytest.mark.parametrize("unwind", [False, True], ids=["frame-pointers", "eh-frame"])
def test_kernel_aggregates_sampled_bytes_per_site(
    sampler_lib: Path, build: Callable[..., Path], tmp_path: Path, unwind: bool
) -> None:
    program = build("sampler_sites.c")
    rate = site_rate({k: int(v) for k, v in EXPECTED_SITE_BYTES.items()}, 1600)
    log = tmp_path / "blocks.bin"
    conv = Conversation([str(program), str(log), str(sampler_lib)])
    try:
        conv.expect("ready")
        base = next(m.start for m in read_map_lines(conv.pid) if m.offset == 0 and os.path.samefile(m.path, program))
        exe = open_elf(str(program))
        ranges = {}
        for fn, site in SITE_FUNCTIONS.items():
            value, size = exe.find_symbol(fn)  # type: ignore[misc]
            ranges[site] = (base + value, base + value + size)
        ctl = SamplerControl(conv.pid, sampler_lib)
        settings = ProbeSettings(target_tgid=conv.pid, arm_on_exec=False, unwind=unwind, sampled=True)
        with HeapProbes(settings, sampler_points(sampler_lib)) as probes:
            if unwind:
                probes.publish_unwind(unwind_mappings(conv.pid))
            ctl.arm(rate)
            conv.say("go")
            conv.expect("allocated")

            lib_maps = [m for m in read_map_lines(conv.pid) if m.inode == os.stat(sampler_lib).st_ino]
            lib_lo, lib_hi = min(m.start for m in lib_maps), max(m.end for m in lib_maps)
            shapes: collections.Counter[str] = collections.Counter()

            def live_per_site() -> collections.Counter[int | None]:
                counts = probes.counters()
                sites = probes.sites(counts.peak_gen)
                stacks = probes.stacks(sites.keys())
                live: collections.Counter[int | None] = collections.Counter()
                for key, c in sites.items():
                    stack = stacks.get(key, ())
                    site = site_of(stack, ranges)
                    live[site] += c.cur_bytes
                    if site is not None:
                        # The sampler's own frames lead (to be trimmed), then the program's call site.
                        inside = [lib_lo <= ip < lib_hi for ip in stack]
                        first_out = inside.index(False)
                        shapes["ok" if first_out >= 1 and not any(inside[first_out:])
                               and site_of(stack[first_out : first_out + 1], ranges) == site else "other"] += 1
                return live

            allocated = live_per_site()
            conv.say("free")
            conv.expect("freed")
            after_free = live_per_site()
            counters = probes.counters()
            ctl.disarm()
        conv.say("exit")
        assert conv.finish() == 0
    finally:
        conv.kill()
    truth: collections.Counter[int] = collections.Counter()
    for _, site, size in struct.iter_unpack("<QII", log.read_bytes()):
        truth[site] += size
    total = sum(truth.values())
    assert counters.dropped_blocks == 0 and counters.dropped_stacks == 0
    for site, true_bytes in sorted(truth.items()):
        print(f"site {site} ({'cfi' if unwind else 'fp'}): {true_bytes / total:.0%} of the heap, kernel estimate / "
              f"truth = {allocated[site] / true_bytes:.4f} at rate {rate}")
        if true_bytes >= total / 10:
            assert abs(allocated[site] / true_bytes - 1) <= 0.10, (site, allocated[site], true_bytes)
    assert shapes["ok"] > 0 and shapes["other"] == 0, shapes
    # Every sampled block of site 0 was freed, and each free took back exactly the weight it was recorded at.
    assert allocated[0] > 0 and after_free[0] == 0
    for site in (1, 2, 3):
        assert after_free[site] == allocated[site]


def test_sampled_mode_reads_the_maps_again_only_when_a_walk_meets_unread_code(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """Sampled mode traces no page call, so nothing says when code is mapped; the loader's mappings come as events.
    The maps are read again at a look only when a stack walk met code outside every published table (the count
    HeapProbes.code_outside): a served process's maps, which do not change, are read once, not at every look. Code
    mapped without the loader (code_remap.c maps itself again, as a JIT or a hand-made loader would) is found at the
    next look, its table published, and its frames unwound by table from then on, though the symbolizer read the
    maps first (Session.sync_mappings publishes by the maps' version)."""
    program = build("code_remap.c")
    conv = Conversation([str(program), "2500", "4500"])
    stop = threading.Event()
    profile: Profile | None = None
    failed: list[BaseException] = []
    try:
        conv.expect("ready")
        settings = ProfileSettings(MassifOptions(), mode=ProfileMode("sampled", 1))  # every allocation a sample
        profile = Profile(settings, attach_to(conv.pid))
        ready = threading.Event()

        def run() -> None:
            try:
                profile.run(stop, ready=ready.set)  # type: ignore[union-attr]
            except BaseException as exc:
                failed.append(exc)
                ready.set()

        thread = threading.Thread(target=run)
        thread.start()
        assert ready.wait(60) and not failed, failed
        session = profile.session
        assert session is not None
        conv.say("go")
        time.sleep(0.5)  # the loop's first read of the maps, and its first look
        at_start = session.maps.reads
        line = conv.proc.stdout.readline().split() if conv.proc.stdout else []
        assert line[:1] == ["remapped"], line
        before_remap = session.maps.reads  # 2 s more of allocations: looks at 0.75 and 1.75 s
        moved = int(line[1], 16)
        deadline = time.monotonic() + 10
        while session.maps.reads == before_remap and time.monotonic() < deadline:
            time.sleep(0.05)
        after_remap = session.maps.reads
        known = [m for m in session.maps.current if m.start <= moved < m.end]
        # A look more (frames met between that read and the publication move the count once more); then, the
        # target still allocating through the copy, no frame of it goes by frame pointer.
        time.sleep(1.3)
        outside, calls = session.probes.code_outside(), session.probes.counters().n_allocs
        time.sleep(1.0)
        still_outside, calls_after = session.probes.code_outside(), session.probes.counters().n_allocs
        conv.expect("done")
        conv.say("exit")
        assert conv.finish() == 0
    finally:
        stop.set()
        conv.kill()
    thread.join(30)
    assert not failed, failed
    print(f"maps read: {at_start} at the start, {before_remap} before the copy, {after_remap} after it")
    assert before_remap == at_start, "the maps were read again though every walk stayed in published code"
    assert after_remap > before_remap, "code mapped without the loader was never read"
    assert known and known[0].path == str(program) and "x" in known[0].perms
    assert calls_after > calls and still_outside == outside, "the copy's frames were not unwound by table"
