"""One loaded program for every target of a shape (agent/kernel/shapes.py): two targets of the same settings share
the program (one compile, one set of loaded programs), each counts only its own calls, and a target's detach leaves
the other recording, its figures unchanged."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.kernel.abi import CTL_UMAPS, UMAPS_ID_SHIFT
from agent.kernel.interface import ProbeSettings
from agent.kernel.links import uprobe_links_supported
from agent.kernel.probes import HeapProbes
from agent.kernel.shapes import PURGE_BATCH, ProgramShape
from agent.model.sampling import DEFAULT_KEEP_PROGRAMS
from agent.process.discovery import allocator_of_process
from agent.process.sampler import build_sampler, probe_points, read_map_lines
from agent.symbols.elf import open_elf
from tests.integration.test_probe_modes import ALLOCS, SITE_BYTES, TRACKED_FREES, UNTRACKED_FREES, Target
from tests.integration.test_sampled_probes import unwind_mappings
from tests.support.conversation import Conversation

pytestmark = pytest.mark.integration


class SameAddressTarget(Target):
    """attach_target.c without address randomization (setarch -R): two of them put their blocks at the same
    addresses, so the shared block table must tell them apart by target (probes/bpf/blocks.h block_key)."""

    def __init__(self, program: Path) -> None:
        self.proc = subprocess.Popen(["setarch", "-R", str(program), "hold"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)  # fmt: skip


def heap_of(pid: int) -> str:
    return next(line.split()[0] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "[heap]" in line)


def perf_event(fd: int) -> bool:
    """Whether this process's descriptor `fd` is open on a perf event (a tracepoint's attachment)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]"
    except FileNotFoundError:
        return False


def counted(probes: HeapProbes) -> tuple[int, int, int, int]:
    c = probes.counters()
    return c.heap, c.n_allocs, c.n_frees, c.untracked_frees


@pytest.mark.parametrize("kind", [Target, SameAddressTarget], ids=["randomized", "same-addresses"])
def test_two_targets_share_one_program_and_detach_alone(
    bpf_ready: None, build: Callable[..., Path], kind: type[Target]
) -> None:
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program = build("attach_target.c")
    first, second = kind(program), kind(program)
    try:
        for t in (first, second):
            t.expect("ready")
        if kind is SameAddressTarget:
            assert heap_of(first.proc.pid) == heap_of(second.proc.pid)
        before = len(ProgramShape.loaded())

        def probes_for(t: Target) -> HeapProbes:
            points = allocator_of_process(t.proc.pid).points(run=False, heap=True)
            return HeapProbes(ProbeSettings(target_tgid=t.proc.pid, arm_on_exec=False), points)

        with probes_for(first) as a:
            started = time.monotonic()
            with probes_for(second) as b:
                second_attach = time.monotonic() - started
                shapes = ProgramShape.loaded()
                assert len(shapes) == before + 1, "the second target compiled a program of its own"
                assert a._shape is b._shape and a.slot != b.slot
                # Only the first target's calls reach its counters, and the other way round.
                first.go()
                first.expect("allocated")
                assert counted(a) == (SITE_BYTES, ALLOCS, TRACKED_FREES, UNTRACKED_FREES)
                assert counted(b) == (0, 0, 0, 0)
                second.go()
                second.expect("allocated")
                assert counted(b) == (SITE_BYTES, ALLOCS, TRACKED_FREES, UNTRACKED_FREES)
                kept = counted(a)
            # The second's detach: the first still records, its figures as they were.
            assert counted(a) == kept
            assert first.finish() == 7  # 10,000 more malloc/free pairs while attached
            after = a.counters()
            assert after.n_allocs == ALLOCS + 10_000 and after.n_frees == TRACKED_FREES + 10_000
            assert after.heap == SITE_BYTES
        assert second.finish() == 7
        assert len(ProgramShape.loaded()) == before, "the program outlived its last target"
        # A further target of a loaded shape compiles nothing and verifies nothing: it takes a slot and links.
        print(f"second attach {second_attach * 1000:.1f} ms")
        assert second_attach < 1.0, f"the second target took {second_attach:.2f} s to attach"
    finally:
        first.kill()
        second.kill()


@pytest.mark.parametrize("keep", [DEFAULT_KEEP_PROGRAMS, 1.0], ids=["serve-default", "one-second"])
def test_a_daemons_program_outlives_its_last_target_for_the_next_one(
    bpf_ready: None, build: Callable[..., Path], keep: float
) -> None:
    """serve --keep-programs: a shape stays loaded after its last target, so that the next target of the same
    settings (a recycled worker, the same service attached again) compiles and verifies nothing; once kept that
    long without a target it is unloaded. Kept, it leaves its tracepoints (the system calls' cost every process's
    calls) and takes them again with its next target."""
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program = build("attach_target.c")
    before = len(ProgramShape.loaded())
    shape = None
    try:
        for _ in range(2):
            t = Target(program)
            try:
                t.expect("ready")
                points = allocator_of_process(t.proc.pid).points(run=False, heap=True)
                settings = ProbeSettings(target_tgid=t.proc.pid, arm_on_exec=False, keep_programs=keep)
                with HeapProbes(settings, points) as probes:
                    assert shape is None or probes._shape is shape, "the next target compiled its program again"
                    shape = probes._shape
                    tracepoints = dict(shape.bpf.tracepoint_fds)
                    assert tracepoints and all(map(perf_event, tracepoints.values())), tracepoints
                    t.go()
                    t.expect("allocated")
                    assert counted(probes) == (SITE_BYTES, ALLOCS, TRACKED_FREES, UNTRACKED_FREES)
            finally:
                t.kill()
            assert shape in ProgramShape.loaded(), "the program was unloaded with its last target"
            assert not shape.bpf.tracepoint_fds and not any(map(perf_event, tracepoints.values())), tracepoints
        if keep == DEFAULT_KEEP_PROGRAMS:
            return
        deadline = time.monotonic() + keep + 10
        while shape in ProgramShape.loaded() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(ProgramShape.loaded()) == before, "the program outlived --keep-programs"
    finally:
        ProgramShape.unload_kept()


def test_a_sampled_targets_slot_and_maps_are_free_at_its_detach(bpf_ready: None, build: Callable[..., Path]) -> None:
    """Sampled mode has no shared block table to purge (its blocks are in the target's own maps): a detached target's
    slot is free at once, with its maps kept, and the next target takes them emptied instead of making new ones, as
    a prefork server's replaced workers do one after another (exact mode's slots wait for a purge: the test above)."""
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program = build("attach_target.c")
    points = probe_points(build_sampler())
    slots: list[int] = []
    maps: list[object] = []  # each target's maps
    shape = None
    try:
        for _ in range(3):
            t = Target(program)
            try:
                t.expect("ready")
                settings = ProbeSettings(target_tgid=t.proc.pid, arm_on_exec=False, sampled=True, keep_programs=60.0)
                with HeapProbes(settings, points) as probes:
                    shape = probes._shape
                    assert shape is not None
                    slots.append(probes.slot)
                    maps.append(probes._maps)
            finally:
                t.kill()
            assert not shape._dirty and (slots[-1] == 0 or slots[-1] in shape._free), "the slot waits for a purge"
        # slot 0 holds bcc's own maps and is not used again; the second target's maps are kept and the third gets them
        assert slots[0] == 0 and slots[2] == slots[1] != 0, slots
        assert maps[2] is maps[1], "the third target did not take the kept maps"
    finally:
        ProgramShape.unload_kept()


class SlotReuseTarget(Target):
    """slot_reuse.c without address randomization: every process puts its three 5000-byte blocks at the same
    addresses, allocated after the attach ("leave") or before it and freed after ("free")."""

    def __init__(self, program: Path, how: str) -> None:
        self.proc = subprocess.Popen(["setarch", "-R", str(program), how], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)  # fmt: skip


def test_a_slot_used_again_finds_none_of_its_last_targets_blocks(bpf_ready: None, build: Callable[..., Path]) -> None:
    """A detached target's blocks stay in the shared block table until a batch of detaches is purged at once
    (ProgramShape.give_back, PURGE_BATCH); its slot is not used again before. One kept program; PURGE_BATCH targets
    each leave three tracked blocks live at the same addresses; then targets that freed nothing tracked, taking the
    slots as they come round again, free three blocks at those addresses that they allocated before the attach:
    untracked frees, each, and no tracked one (a block of the slot's last target would have been found)."""
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program = build("slot_reuse.c")
    slots: dict[str, list[int]] = {"leave": [], "free": []}
    try:
        for how in ["leave"] * PURGE_BATCH + ["free"] * 3:
            t = SlotReuseTarget(program, how)
            try:
                t.expect("ready")
                points = allocator_of_process(t.proc.pid).points(run=False, heap=True)
                settings = ProbeSettings(target_tgid=t.proc.pid, arm_on_exec=False, keep_programs=60.0)
                with HeapProbes(settings, points) as probes:
                    slots[how].append(probes.slot)
                    t.go()
                    t.expect("allocated")
                    want = (15000, 3, 0, 0) if how == "leave" else (100, 1, 0, 3)
                    assert counted(probes) == want, (how, slots)
            finally:
                t.kill()
        assert set(slots["free"]) <= set(slots["leave"]), f"the later targets did not use the slots again: {slots}"
    finally:
        ProgramShape.unload_kept()


class FillerTarget(Target):
    """modes_sites.c: dozens of sites, thousands of sizes, two threads: a target that leaves something in every
    per-target map of a MALT shape."""

    def __init__(self, program: Path) -> None:
        self.proc = subprocess.Popen([str(program), "1", "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")  # it reads a line
        self.proc.stdin.flush()


def reads(probes: HeapProbes) -> dict[str, object]:
    """What a target's maps say once it has allocated, but for thread ids and times (another process's)."""
    per_fn: dict[int, tuple[int, int]] = {}
    for (_, fn), (count, nbytes, _) in probes.thread_stats().items():
        c, b = per_fn.get(fn, (0, 0))
        per_fn[fn] = (c + count, b + nbytes)
    sites = {k: (m.fn, m.tot_bytes, m.tot_blocks, m.cur_bytes, m.alloc_min, m.alloc_max)
             for k, m in probes.malt_sites().items()}
    return {
        "counted": counted(probes),
        "site_count": probes.site_count(),
        "sites": sites,
        "stacks": {k: probes._read_stack(k) for k in sites},
        "sizes": probes.size_map(),
        "jumps": probes.realloc_jumps(),
        "per_fn": per_fn,
        "size_histogram": probes.size_histogram(),
        "lifetimes": sum(probes.life_histogram()),
        "window": probes.take_window(0),
        "snapshot_log": len(probes.snapshot_log()),
    }


def test_a_slot_used_again_finds_its_maps_empty(bpf_ready: None, build: Callable[..., Path]) -> None:
    """A detached target's maps are kept for its slot's next target and emptied then (agent.kernel.emptying), not
    made again: a target in the slot of one that filled every per-target map (sites and their stacks, MALT's
    sizes, threads and histograms, the snapshot log) reads what the same program reads in a slot of its own."""
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program, filler = build("attach_target.c"), build("modes_sites.c")

    def attached(t: Target) -> HeapProbes:
        points = allocator_of_process(t.proc.pid).points(run=False, heap=True)
        settings = ProbeSettings(target_tgid=t.proc.pid, arm_on_exec=False, keep_programs=60.0, malt=True)
        return HeapProbes(settings, points)

    def profiled(t: Target) -> tuple[int, dict[str, object]]:
        try:
            t.expect("ready")
            with attached(t) as probes:
                t.go()
                t.expect("allocated")
                return probes.slot, reads(probes)
        finally:
            t.kill()

    try:
        own_slot, own = profiled(SameAddressTarget(program))
        f = FillerTarget(filler)
        try:
            f.expect("ready")
            with attached(f) as probes:
                shape, filled_slot = probes._shape, probes.slot
                f.go()
                f.expect("allocated")
                assert probes.site_count() > 5 and len(probes.size_map()) > 100, "the filler filled too little"
        finally:
            f.kill()
        assert shape is not None
        assert filled_slot in shape._kept, "the filler's maps were not kept for its slot"
        shape._purge_dirty()  # the slot free again now, not after PURGE_BATCH detaches
        again_slot, again = profiled(SameAddressTarget(program))
        assert again_slot == filled_slot != own_slot
        assert again == own
        assert again["counted"] == (SITE_BYTES, ALLOCS, TRACKED_FREES, UNTRACKED_FREES)
    finally:
        ProgramShape.unload_kept()


def test_forked_workers_share_the_rule_cache_and_keep_their_own_stacks(
    bpf_ready: None, build: Callable[..., Path]
) -> None:
    """Workers forked from one program (fork_ring.c: three of them taking turns, as a prefork server's take
    requests) map the same objects at the same places, so they publish one mapping set, and the stack walk's
    per-CPU rule cache serves each the rules another found (probes/bpf/unwind.h rule_cache). Keyed by target, each
    walk evicted the rules of the worker before it and searched the tables for every frame. Each worker's stacks
    are still its own, every frame unwound by table."""
    if not uprobe_links_supported():
        pytest.skip("targets share a program only through uprobe_multi links (Linux 6.10+)")
    program = build("fork_ring.c")
    ring = Conversation([str(program)])
    try:
        line = ring.proc.stdout.readline().split() if ring.proc.stdout else []
        assert line[:1] == ["ready"], line
        workers = [int(pid) for pid in line[1:]]
        value, size = open_elf(str(program)).find_symbol("chain")  # type: ignore[misc]
        with contextlib.ExitStack() as stack:
            probes = []
            for pid in workers:
                points = allocator_of_process(pid).points(run=False, heap=True)
                p = stack.enter_context(HeapProbes(ProbeSettings(target_tgid=pid, arm_on_exec=False), points))
                p.publish_unwind(unwind_mappings(pid))
                probes.append(p)
            bases = [next(m.start for m in read_map_lines(pid) if m.offset == 0 and m.path == str(program))
                     for pid in workers]
            words = {p._control(CTL_UMAPS) >> UMAPS_ID_SHIFT for p in probes}
            assert len(words) == 1 and 0 not in words, "forked workers published different mapping sets"
            ring.say("go")
            ring.expect("done")
            counters = [p.counters() for p in probes]
            chains = []
            for pid, base, p in zip(workers, bases, probes, strict=True):
                sites = p.sites(p.counters().peak_gen)
                stacks = p.stacks([k for k, s in sites.items() if s.tot_blocks >= 3000])
                assert stacks, f"worker {pid}: no site of its 3,000 allocations"
                chains += [sum(base + value < ip <= base + value + size for ip in s) for s in stacks.values()]
        assert ring.finish() == 0
    finally:
        ring.kill()
    frames = sum(c.unwind_frames for c in counters)
    searched = sum(c.unwind_searched for c in counters)
    print(f"{frames} frames by table, {searched} rules searched in the tables; chains {chains}")
    assert all(c.unwind_fp == 0 and c.unwind_no_rule == 0 and c.unwind_bad_read == 0 for c in counters)
    assert set(chains) == {11}, "a worker's stack lost or gained a frame of its chain of calls"  # DEPTH + 1
    # 18,000 walks (malloc's and free's) of some 14 frames: a worker that finds the rules of the one before it
    # searches only what no worker met yet on that CPU.
    assert frames > 100_000 and searched < frames / 50, (frames, searched)
