"""Every BPF program of probes/heap.bpf.c passes the kernel's verifier in every mode a profile can ask for, and
counts a real target's calls there.

The modes are the -D switches agent/session/pipeline.py sets: the stack walk (.eh_frame tables or frame pointers),
MALT's statistics, the free stacks of `--xtree-memory=full`, the snapshot schedule's clock (B or ms), the target
stopped at events (`run`), thread stacks, and sampled mode's programs. The verifier's limit (1M instructions
processed per program) is near for some of them: a change in one mode has taken another past it before
(E2BIG at load), which only loading each of them shows.

attach_target.c allocates 4 x 1111 B, 2222 B and 3333 B (freed) after the attach, and frees two blocks it
allocated before: the heap the kernel keeps is 6666 B, from 6 allocations and 1 tracked free. With the schedule's
due time and interval left at 0, every accounted event reaches the due time, so the kernel sends one point per
event (and one peak point at the first free, its peak level being 0), the last with the heap after it.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.errors import HeapscopeError
from agent.kernel.abi import SCHED_PEAK
from agent.kernel.interface import ProbeSettings
from agent.kernel.probes import HeapProbes
from agent.model.options import MAX_WALKED_FRAMES
from agent.process.discovery import HOOK_KINDS, allocator_of_process
from agent.process.sampler import build_sampler
from tests.support.sampler_probes import sampler_points

pytestmark = pytest.mark.integration

SITE_BYTES = 4 * 1111 + 2222  # live after the attach (the 3333-byte block is freed by the target)
ALLOCS = 6
TRACKED_FREES = 1
UNTRACKED_FREES = 2  # blocks allocated before the attach

MODES = [
    pytest.param({"unwind": True, "schedule_ns": True, "stop_events": True}, id="cfi-ms-run"),
    pytest.param({"unwind": True, "schedule_ns": False, "malt": True}, id="cfi-B-malt"),
    pytest.param({"unwind": True, "schedule_ns": True, "malt": True, "free_stacks": True, "stacks": True,
                  "stop_events": True}, id="cfi-ms-malt-freestacks-stacks-run"),
    pytest.param({"unwind": True, "schedule_ns": False, "malt": True, "free_stacks": True, "stop_events": True},
                 id="cfi-B-malt-freestacks-run"),
    pytest.param({"unwind": False, "schedule_ns": True, "malt": True, "free_stacks": True}, id="fp-ms-malt-freestacks"),
    pytest.param({"unwind": False, "schedule_ns": False, "stacks": True, "stop_events": True}, id="fp-B-stacks-run"),
    pytest.param({"unwind": True, "schedule_ns": True, "malt": True, "free_stacks": True, "sampled": True},
                 id="cfi-ms-malt-freestacks-sampled"),
    pytest.param({"unwind": True, "schedule_ns": False, "sampled": True}, id="cfi-B-sampled"),
]


class Target:
    """attach_target.c with "hold": says "ready", allocates at a byte, says "allocated", waits for another."""

    def __init__(self, program: Path) -> None:
        self.proc = subprocess.Popen([str(program), "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        assert line == word, f"target said {line!r}, expected {word!r}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"x")
        self.proc.stdin.flush()

    def finish(self) -> int:
        self.go()
        self.expect("done")
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("mode", MODES)
def test_every_program_loads_and_counts(
    bpf_ready: None, build: Callable[..., Path], tmp_path: Path, mode: dict[str, Any]
) -> None:
    target = Target(build("attach_target.c"))
    try:
        target.expect("ready")
        points = allocator_of_process(target.proc.pid).points(run=False, heap=True)
        assert {p.kind for p in points} >= {"malloc", "free", "calloc", "realloc"}
        if mode.get("sampled"):
            # As the pipeline attaches sampled mode: the sampler's two probes and the loader's and exit's, none of
            # the allocation functions (the sampled program has none of their programs).
            os.chmod(tmp_path, 0o755)
            points = [p for p in points if p.kind in HOOK_KINDS] + sampler_points(build_sampler(tmp_path))
        settings = ProbeSettings(
            target_tgid=target.proc.pid, arm_on_exec=False, pages=True, max_depth=MAX_WALKED_FRAMES, **mode
        )
        # Attaching loads each point's programs (and alloc_return for those that return): one that the verifier
        # refuses raises here.
        with HeapProbes(settings, points) as probes:
            # The first reads come from several threads at once, as a daemon's sampling thread and its HTTP
            # threads read a new target: each sees whole counters (a reader made at the first read was seen
            # half made, and failed a profile).
            barrier = threading.Barrier(8)
            first: list[Any] = []

            def read() -> None:
                barrier.wait()
                first.append(probes.counters())

            readers = [threading.Thread(target=read) for _ in range(8)]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
            assert len(first) == 8 and len({(c.heap, c.n_allocs) for c in first}) == 1
            target.go()
            target.expect("allocated")
            counters = probes.counters()
            sched = probes.schedule_points()
        assert target.finish() == 7
        with pytest.raises(HeapscopeError, match="not loaded"):
            probes.activity()  # closed: an error, never the last figures read as if they were now
    finally:
        target.kill()

    if mode.get("sampled"):
        # The sampler is not in this target: its probes load, and nothing reaches them.
        assert (counters.heap, counters.n_allocs, counters.n_frees, len(sched)) == (0, 0, 0, 0)
        return
    assert (counters.heap, counters.n_allocs, counters.n_frees) == (SITE_BYTES, ALLOCS, TRACKED_FREES)
    assert counters.untracked_frees == UNTRACKED_FREES
    assert counters.sched_lost == 0
    normal = [p for p in sched if p[3] != SCHED_PEAK]
    peaks = [p for p in sched if p[3] == SCHED_PEAK]
    assert len(normal) == ALLOCS + TRACKED_FREES
    assert [heap for _, heap, _, _, _ in normal][-1] == SITE_BYTES
    assert len(peaks) == 1 and peaks[0][1] == SITE_BYTES + 3333  # before the target's one tracked free
    times = [t for t, _, _, _, _ in sched]
    assert times == sorted(times)
    assert [epoch for *_, epoch in sched] == list(range(len(sched)))  # numbered from 0: the snapshot log's epochs
