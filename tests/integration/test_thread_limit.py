"""A process that may start no thread (its RLIMIT_NPROC reached, as haproxy's workers set it after dropping to a
user of their own) gets the sampler threadless: no control thread, its requests made by calls on the program's
own thread at safe points, its hooks watching heapscope's lease. Sampled attach arms it at the default rate, its
samples reach the profile, detaching restores every slot, and a heapscope killed with SIGKILL leaves hooks that
pass everything through, which the next heapscope arms again and restores."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.process.sampler import SamplerControl
from tests.support.armed import loaded_sampler
from tests.support.conversation import Conversation
from tests.support.massif_reader import parse_massif
from tests.support.target_memory import got_slot, libc_function, read_word

pytestmark = pytest.mark.integration

NOBODY = "65534"
BLOCKS, BLOCK = 20000, 1000  # threadless_target.c: what "alloc" keeps
TIMEOUT = 60


@pytest.fixture
def limited(build: Callable[..., Path]) -> Iterator[tuple[Conversation, Path]]:
    """threadless_target as nobody, whose RLIMIT_NPROC of 1 lets it start no thread, with plugin.c to load; and its
    program."""
    with tempfile.TemporaryDirectory() as shared:  # world-readable: the target runs as nobody
        Path(shared).chmod(0o755)
        exe = Path(shutil.copy(build("threadless_target.c"), shared))
        plugin = Path(shutil.copy(build("plugin.c", shared=True), shared))
        for f in (exe, plugin):
            f.chmod(0o755)
        conv = Conversation(["prlimit", "--nproc=1:1", "--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                             "--clear-groups", str(exe), str(plugin)])
        try:
            conv.expect("ready")
            yield conv, exe
        finally:
            conv.kill()


def attach(heapscope_cmd: list[str], pid: int, out: Path) -> tuple[subprocess.Popen[str], str]:
    """`heapscope attach PID` (sampled, the default rate), once its probes are on; and what it said till then."""
    profiler = subprocess.Popen([*heapscope_cmd, "attach", str(pid), f"--massif-out-file={out}"],
                                stderr=subprocess.PIPE, text=True)
    assert profiler.stderr is not None
    fd = profiler.stderr.fileno()  # read unbuffered up to the line, so that communicate() gets the rest
    said = b""
    deadline = time.monotonic() + TIMEOUT
    while b"probes attached" not in said or not said.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 1) if ready else b""
        assert chunk, f"heapscope stopped or stalled before its probes were on:\n{said.decode()}"
        said += chunk
    return profiler, said.decode()


def detach(profiler: subprocess.Popen[str], said: str) -> None:
    """SIGINT: heapscope detaches and ends cleanly."""
    profiler.send_signal(signal.SIGINT)
    _, err = profiler.communicate(timeout=TIMEOUT)
    assert profiler.returncode == 0 and "Traceback" not in err, said + err


def ended(profiler: subprocess.Popen[str]) -> None:
    """Killed if it still runs (a test's `finally`)."""
    if profiler.poll() is None:
        profiler.kill()
        profiler.wait()


def control_of(pid: int) -> SamplerControl:
    library = loaded_sampler(pid)
    assert library is not None, f"no sampler in {pid}"
    return SamplerControl(pid, library)


def malloc_slot_restored(pid: int, exe: Path) -> bool:
    return read_word(pid, got_slot(pid, exe, "malloc")) == libc_function(pid, "malloc")


def test_sampled_attach_to_a_process_at_its_thread_limit_runs_threadless(
    heapscope_cmd: list[str], limited: tuple[Conversation, Path], tmp_path: Path
) -> None:
    conv, exe = limited
    out = tmp_path / "massif.out"
    profiler, said = attach(heapscope_cmd, conv.pid, out)
    try:
        why = [line for line in said.splitlines() if "without a thread of its own" in line]
        assert len(why) == 1 and "RLIMIT_NPROC, Max processes 1" in why[0], said
        watch = control_of(conv.pid)
        st = watch.read()
        assert st.state == "armed" and st["control_tid"] == 0 and st["slots_patched"] > 0, st.fields
        conv.say("alloc")
        conv.expect("allocated")
        assert watch.counts()["allocs"] >= BLOCKS
        assert watch.read()["samples"] > 0
        time.sleep(1.5)  # a profile tick or more: the samples are in its snapshots
        detach(profiler, said)
        # Detached by a call: every slot restored, idle and threadless, its last disarm asked for.
        st = watch.read()
        assert (st.state, st.disarm_reason, st["slots_patched"]) == ("threadless", "requested", 0), st.fields
        assert malloc_slot_restored(conv.pid, exe)
        watch.close()
        conv.say("free")
        conv.expect("freed")
        conv.say("exit")
        assert conv.finish() == 7
    finally:
        ended(profiler)
    # The kept blocks, estimated from the samples: about BLOCKS * BLOCK bytes at the end (no free came after the
    # highest point: as with Massif, no peak snapshot), nearly all at site_block in the last detailed snapshot.
    profile = parse_massif(out.read_text())
    assert 0.5 * BLOCKS * BLOCK < profile.snapshots[-1].heap_B < 1.5 * BLOCKS * BLOCK, said
    last = profile.detailed[-1]
    assert last.tree is not None
    at_site = sum(n.bytes for n in last.tree.walk() if n.depth == 1 and "site_block" in n.label)
    assert at_site >= 0.9 * last.heap_B > 0, (at_site, last.heap_B)


def test_an_object_loaded_while_armed_threadless_is_patched_by_a_rescan(
    heapscope_cmd: list[str], limited: tuple[Conversation, Path], tmp_path: Path
) -> None:
    """No control thread polls the loader: heapscope sees the new code in the process's maps and asks for a rescan
    by a call, after which the object's own calls of malloc go through the hooks (counted)."""
    conv, _ = limited
    profiler, said = attach(heapscope_cmd, conv.pid, tmp_path / "massif.out")
    try:
        watch = control_of(conv.pid)
        scans = watch.read()["scans"]
        conv.say("load")
        conv.expect("loaded")
        deadline = time.monotonic() + 15
        while watch.read()["scans"] == scans:
            assert time.monotonic() < deadline, "no rescan after a library was loaded"
            time.sleep(0.1)
        before = watch.counts()["allocs"]
        conv.say("plugin")
        conv.expect("plugged")
        assert watch.counts()["allocs"] - before >= BLOCKS  # plugin_alloc's own malloc calls, through its GOT
        detach(profiler, said)
    finally:
        ended(profiler)
    watch.close()
    conv.say("exit")
    assert conv.finish() == 7


def test_threadless_sampler_lets_go_when_heapscope_is_killed(
    heapscope_cmd: list[str], limited: tuple[Conversation, Path], tmp_path: Path
) -> None:
    conv, exe = limited
    profiler, said = attach(heapscope_cmd, conv.pid, tmp_path / "massif.out")
    profiler.kill()  # SIGKILL: nobody disarms, and no thread of the sampler's sees the lease close
    profiler.wait()
    watch = control_of(conv.pid)
    assert watch.read().state == "armed"
    conv.say("alloc")  # its first sample sees the lease gone: from then on every hook passes through
    conv.expect("allocated")
    st = watch.read()
    assert (st.state, st.disarm_reason) == ("threadless", "controller gone"), st.fields
    samples = st["samples"]
    conv.say("free")
    conv.expect("freed")
    assert watch.read()["samples"] == samples, "a hook went on sampling with heapscope gone"
    # The next heapscope arms it again (a fresh lease) and its detach restores the slots the first one left.
    again, said = attach(heapscope_cmd, conv.pid, tmp_path / "again.out")
    try:
        st = watch.read()
        assert (st.state, st["arm_count"]) == ("armed", 2), st.fields
        detach(again, said)
    finally:
        ended(again)
    st = watch.read()
    assert (st.state, st["slots_patched"]) == ("threadless", 0), st.fields
    assert malloc_slot_restored(conv.pid, exe)
    watch.close()
    conv.say("exit")
    assert conv.finish() == 7


def test_a_forked_child_that_may_start_no_thread_gets_its_parents_sampler_threadless(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    """The parent had the sampler (with its control thread); its child, forked after, drops to nobody with
    RLIMIT_NPROC 0: attaching the child starts its inherited copy again (hs_sampler_revive), threadless."""
    conv = Conversation([str(build("fork_limited.c"))])
    try:
        conv.expect("ready")
        first, said = attach(heapscope_cmd, conv.pid, tmp_path / "parent.out")
        detach(first, said)
        conv.say("fork")
        assert conv.proc.stdout is not None
        child = int(conv.proc.stdout.readline().removeprefix("child "))
        watch = control_of(child)
        assert watch.read().state == "broken"  # a fork's copy: no control thread, its hooks inert
        profiler, said = attach(heapscope_cmd, child, tmp_path / "child.out")
        try:
            assert "inherited by" in said, said
            why = [line for line in said.splitlines() if "without a thread of its own" in line]
            assert len(why) == 1 and "RLIMIT_NPROC, Max processes 0" in why[0], said
            st = watch.read()
            assert st.state == "armed" and st["control_tid"] == 0, st.fields
            conv.say("alloc")
            conv.expect("allocated")
            assert watch.read()["samples"] > 0
            detach(profiler, said)
        finally:
            ended(profiler)
        st = watch.read()
        assert (st.state, st.disarm_reason, st["slots_patched"]) == ("threadless", "requested", 0), st.fields
        watch.close()
        conv.say("exit")
        assert conv.finish() == 7
    finally:
        conv.kill()
