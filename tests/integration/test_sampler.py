"""The in-process sampler (probes/sampler/hs_sampler.c), loaded by the program's own dlopen (no LD_PRELOAD)
and driven through its control block as heapscope drives it. The judge of its estimates is the program's own
record of every block it allocated (address, site, size); samples are read by a tracefs uprobe on the
sampler's probe functions, in a private trace instance."""

from __future__ import annotations

import errno
import fcntl
import math
import os
import struct
import subprocess
import termios
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.contract import HEAP_H
from agent.model.callcounts import total
from agent.model.sampling import weight_hint
from agent.process import sampler as sampler_module
from agent.process.sampler import (
    CONTROL_FIELDS,
    CONTROL_SIZE,
    COUNT_FIELDS,
    COUNT_SLOTS,
    COUNTS,
    FORKED_ARMED,
    FORKED_CLAIMED,
    OFFSETS,
    PROBE_FUNCTIONS,
    SamplerControl,
    build_sampler,
)
from agent.symbols.elf import open_elf
from tests.support.capability import require
from tests.support.conversation import Conversation
from tests.support.sampler_probes import sample_trace
from tests.support.sampler_sites import check_sites, run_sites
from tests.support.target_memory import got_slot, libc_function, read_word

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def sampler_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("root")  # ptrace, /proc/PID/mem, tracefs
    directory = tmp_path_factory.mktemp("sampler-cache")
    os.chmod(directory, 0o755)
    return build_sampler(directory)


def test_probe_functions_start_with_the_optimizable_nop(sampler_lib: Path) -> None:
    """Linux 6.18 optimizes a uprobe only on `0f 1f 44 00 00`: it must be the first instruction."""
    elf = open_elf(str(sampler_lib))
    for name in PROBE_FUNCTIONS:
        found = elf.find_symbol(name)
        assert found is not None, name
        assert elf.code_bytes(found[0], 5) == bytes.fromhex("0f1f440000"), name


def test_control_layout_and_weights_match_python(sampler_lib: Path, build: Callable[..., Path]) -> None:
    program = build("sampler_layout.c")
    rate = 65536
    sizes = [1, 8, 100, 4096, 65535, 65536, 100_000, 10**6, 10**9]
    out = subprocess.run(
        [str(program), str(sampler_lib), str(rate), *map(str, sizes)], capture_output=True, text=True, check=True
    ).stdout
    fields = {}
    weights = {}
    drawn: dict[int, int] = {}
    counts: dict[str, int] = {}
    fns: dict[str, int] = {}
    forked: list[int] = []
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "field":
            fields[rest[0]] = int(rest[1])
        elif kind == "size":
            assert int(rest[0]) == CONTROL_SIZE
        elif kind == "count":
            counts[rest[0]] = int(rest[1])
        elif kind == "counts":
            assert [int(x) for x in rest] == [COUNTS.size, COUNT_SLOTS]
        elif kind == "fn":
            fns[f"HS_{rest[0]}"] = int(rest[1])
        elif kind == "forked":
            forked = [int(x) for x in rest]
        elif kind == "weight":
            weights[int(rest[0])] = int(rest[1])
        elif kind == "drawn":
            drawn[int(rest[0])] = int(rest[1])
    assert fields == OFFSETS
    assert forked == [FORKED_ARMED, FORKED_CLAIMED]  # enum hs_forked
    assert list(fields) == [name for name, _ in CONTROL_FIELDS]
    # struct hs_counts as COUNT_FIELDS reads it (C's plural names), and the allocation functions the sampler
    # names to its probe are exact mode's enum hs_fn.
    assert list(counts.values()) == [8 * i for i in range(len(COUNT_FIELDS))]
    plural = {"calloc": "callocs", "realloc": "reallocs", "memalign": "memaligns",
              "posix_memalign": "posix_memaligns", "valloc": "vallocs", "pvalloc": "pvallocs"}  # fmt: skip
    assert list(counts) == [plural.get(f, f) for f in COUNT_FIELDS]
    hs_fn = HEAP_H.enum("hs_fn")
    assert fns and all(hs_fn[name] == value for name, value in fns.items()), (fns, hs_fn)
    for size in sizes:
        assert abs(weights[size] - weight_hint(size, rate)) <= 1, size  # C's exp/log vs Python's: one byte
        # Drawn at `rate`, sampled once the budget has raised the rate in force: p = 1 - e^(-s/rate) at any size
        # (at or above `rate` too, where hs_weight says p = 1).
        expected = size / -math.expm1(-size / rate)
        assert abs(drawn[size] - expected) <= max(1.0, expected * 1e-12), (size, drawn[size], expected)
    assert drawn[65536] > weights[65536] == 65536 and drawn[10**9] == 10**9  # e^-15258 is 0


def test_sampled_bytes_per_site_via_dlopen(
    sampler_lib: Path, build: Callable[..., Path], tmp_path: Path
) -> None:
    program = build("sampler_sites.c")
    seen = run_sites(program, sampler_lib, tmp_path, lambda pid: SamplerControl(pid, sampler_lib))
    check_sites(seen)


def test_sampler_goes_inert_when_its_controller_is_killed(
    sampler_lib: Path, build: Callable[..., Path], tmp_path: Path
) -> None:
    """A controller process arms the sampler and is SIGKILLed: the lease closes, the sampler restores every
    slot by itself within a second, and the program runs on."""
    program = build("sampler_sites.c")
    conv = Conversation([str(program), str(tmp_path / "blocks.bin"), str(sampler_lib)])
    try:
        conv.expect("ready")
        script = (
            "import sys, time\n"
            "from pathlib import Path\n"
            "from agent.process.sampler import SamplerControl\n"
            f"c = SamplerControl({conv.pid}, Path({str(sampler_lib)!r}))\n"
            "c.arm(4096)\n"
            "print('armed', flush=True)\n"
            "time.sleep(600)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        controller = subprocess.Popen(
            [os.sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
        )
        assert controller.stdout is not None
        assert controller.stdout.readline().strip() == "armed"
        watcher = SamplerControl(conv.pid, sampler_lib)
        assert watcher.read().state == "armed"
        assert watcher.read()["slots_patched"] > 0
        controller.kill()
        controller.wait()
        killed_at = time.monotonic()
        while watcher.read().state == "armed":
            assert time.monotonic() - killed_at < 1.0, "the sampler stayed armed after its controller died"
            time.sleep(0.005)
        st = watcher.read()
        assert st.disarm_reason == "controller gone"
        assert st["slots_patched"] == 0
        assert read_word(conv.pid, got_slot(conv.pid, program, "malloc")) == libc_function(conv.pid, "malloc")
        # The program runs on, and a new controller can arm the same library again.
        assert st["lease_fd"] >= 0
        conv.say("go")
        conv.expect("allocated")
        again = watcher.arm(65536)
        assert again.state == "armed" and again["arm_count"] == 2
        watcher.disarm()
        free_and_exit(conv)
    finally:
        conv.kill()


def test_cxx_operators_and_libraries_loaded_after_arming(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """new, new[], aligned and nothrow new are sampled once each (not again through the malloc they call); a
    bad_alloc thrown through the hook leaves the thread sampling; a library dlopened while armed is patched;
    the matching deletes (sized and aligned ones included) report the frees."""
    program = build("sampler_cxx.cpp")
    plugin = build("plugin.c", shared=True)
    conv = Conversation([str(program), str(sampler_lib), str(plugin)])
    try:
        conv.expect("ready")
        ctl = SamplerControl(conv.pid, sampler_lib)
        with sample_trace(sampler_lib) as read:
            ctl.arm(65536)
            conv.say("go")
            addresses = {}
            assert conv.proc.stdout is not None
            while (line := conv.proc.stdout.readline().strip()) != "done":
                assert line, "the program ended early"
                name, value = line.split()
                addresses[name] = int(value, 16)
            conv.say("exit")
            assert conv.finish() == 0
            samples = read()
        ctl.close()
    finally:
        conv.kill()
    assert addresses.pop("threw") == 1
    sampled = Counter(p for p, _, _ in samples.allocs)
    sizes = {p: (s, w) for p, s, w in samples.allocs}
    for name, ptr in addresses.items():
        assert sampled[ptr] == 1, f"{name} sampled {sampled[ptr]} times"
        assert sizes[ptr] == (1 << 20, 1 << 20), name
    freed = Counter(samples.frees)
    for name in ("new[]", "new", "aligned_new", "nothrow_new", "after_throw"):
        assert freed[addresses[name]] == 1, name
    # As exact mode sees them through libstdc++: operator new calls malloc, the aligned one aligned_alloc.
    hs_fn = HEAP_H.enum("hs_fn")
    fn_of = dict(zip((p for p, _, _ in samples.allocs), samples.alloc_fns, strict=True))
    for name, ptr in addresses.items():
        assert fn_of[ptr] == hs_fn["HS_MEMALIGN" if name == "aligned_new" else "HS_MALLOC"], name


def test_program_closing_the_lease_and_forking_is_left_alone(sampler_lib: Path, build: Callable[..., Path]) -> None:
    """A program that closes all its descriptors (the sampler's lease among them) and reuses the numbers:
    the sampler notices the lease is gone and disarms, without ever reading or closing the program's new
    descriptors; a child forked while armed runs on (armed, reporting no sample: no heapscope claimed it)."""
    program = build("sampler_fds.c")
    conv = Conversation([str(program), str(sampler_lib)])
    try:
        conv.expect("ready")
        ctl = SamplerControl(conv.pid, sampler_lib)
        armed = ctl.arm(4096)
        lease_fd = ctl.read()["lease_fd"]
        assert armed.state == "armed" and lease_fd == -1  # heapscope holds the only write end
        conv.say("go")
        conv.expect("checked 0")
        st = ctl.read()
        assert st.state == "idle"
        assert st.disarm_reason == "lease descriptor lost"
        assert st["slots_patched"] == 0
        conv.say("exit")
        assert conv.finish() == 0
        ctl.close()
    finally:
        conv.kill()


def test_lazy_slot_with_two_definers_is_patched_once_bound(sampler_lib: Path, build: Callable[..., Path]) -> None:
    """With a second object defining malloc, an unbound lazy slot is not redirected (the loader might bind it
    elsewhere); it is counted, and patched within a second of its first call binding it."""
    second = build("second_malloc.c", shared=True)
    program = build("sampler_lazy.c", flags=("-g", "-O0", "-Wl,-z,lazy"))
    conv = Conversation([str(program), str(sampler_lib), str(second)])
    try:
        conv.expect("ready")
        ctl = SamplerControl(conv.pid, sampler_lib)
        with sample_trace(sampler_lib) as read:
            armed = ctl.arm(65536)
            assert armed["lazy_skipped"] > 0
            conv.say("go")
            first = conv.proc.stdout.readline().split()  # type: ignore[union-attr]
            second_line = conv.proc.stdout.readline().split()  # type: ignore[union-attr]
            samples = read()
            conv.say("exit")
            assert conv.finish() == 0
        ctl.close()
    finally:
        conv.kill()
    sampled = {p for p, _, _ in samples.allocs}
    assert first[0] == "first" and second_line[0] == "second"
    assert int(first[1], 16) not in sampled  # the call that bound the slot went straight to malloc
    assert int(second_line[1], 16) in sampled  # patched since


def test_every_c_allocation_function_is_sampled_and_freed_once(sampler_lib: Path, build: Callable[..., Path]) -> None:
    """1 MiB through each C allocation function at a 64 KiB rate (always sampled): each block is reported
    once at its size, each free once, and a growing realloc reports the old block's free and the new block."""
    program = build("sampler_allfns.c")
    conv = Conversation([str(program), str(sampler_lib)])
    try:
        conv.expect("ready")
        ctl = SamplerControl(conv.pid, sampler_lib)
        with sample_trace(sampler_lib) as read:
            ctl.arm(65536)
            conv.say("go")
            addresses = {}
            assert conv.proc.stdout is not None
            while (line := conv.proc.stdout.readline().strip()) != "done":
                assert line, "the program ended early"
                name, value = line.split()
                addresses[name] = int(value, 16)
            samples = read()
            counts = ctl.counts()
            calls = total(ctl.thread_calls())
            conv.say("exit")
            assert conv.finish() == 0
        ctl.close()
    finally:
        conv.kill()
    allocs = Counter(p for p, _, _ in samples.allocs)
    sizes: dict[int, list[int]] = {}
    for p, size, _ in samples.allocs:
        sizes.setdefault(p, []).append(size)
    frees = Counter(samples.frees)
    mib = 1 << 20
    # An address can come back (a 1 MiB block is its own mapping: the one realloc gives up may be the next
    # one's), so the judge is per address: how many blocks the program had there, and how many it freed.
    made = Counter(ptr for name, ptr in addresses.items() if name != "realloc_old")
    freed = Counter(ptr for name, ptr in addresses.items() if name != "malloc")  # realloc_old: by the realloc
    for name, ptr in addresses.items():
        if name != "realloc_old":
            assert (4 * mib if name == "realloc" else mib) in sizes.get(ptr, []), f"{name} was not sampled"
    assert allocs == made
    assert frees == freed
    assert counts["allocs"] >= len(addresses) - 1 and counts["frees"] >= len(addresses) - 1
    # Each sample names its function as exact mode records the call (probes/heap.h enum hs_fn).
    hs_fn = HEAP_H.enum("hs_fn")
    # gcc compiles realloc(NULL, n) as malloc(n): exact mode sees a malloc too.
    kind_of = {"malloc": "HS_MALLOC", "calloc": "HS_CALLOC", "realloc_null": "HS_MALLOC", "realloc": "HS_REALLOC",
               "reallocarray": "HS_REALLOCARRAY", "posix_memalign": "HS_POSIX_MEMALIGN",
               "aligned_alloc": "HS_MEMALIGN", "memalign": "HS_MEMALIGN", "valloc": "HS_VALLOC",
               "pvalloc": "HS_PVALLOC"}  # fmt: skip
    # In call order (an address can come back): each block's sample is the next one at its address.
    ordered = [(p, fn) for (p, size, _), fn in zip(samples.allocs, samples.alloc_fns, strict=True) if size >= mib]
    at = 0
    for name in (n for n in addresses if n != "realloc_old"):
        while ordered[at][0] != addresses[name]:
            at += 1
        assert ordered[at][1] == hs_fn[kind_of[name]], (name, ordered[at][1])
        at += 1
    # The exact counts per function: the program's calls since arming, one each (stdio allocates inside libc,
    # through no hooked slot); free's are its frees less the old block the growing realloc gave up.
    assert calls.by_kind() == {"malloc": 2, "calloc": 1, "realloc": 2, "memalign": 2, "posix_memalign": 1,
                               "valloc": 1, "pvalloc": 1, "free": len(addresses) - 2}, calls  # fmt: skip
    assert calls.realloc_frees == 1


def test_an_idle_sampler_woken_through_its_lease_reads_the_byte_and_does_not_spin(
    sampler_lib: Path, build: Callable[..., Path], tmp_path: Path
) -> None:
    """heapscope writes a byte into the lease after each request, which an idle control thread also waits on (so
    an arm is answered at once, not at its next 500 ms tick). A request the sampler refuses leaves it idle: the
    byte must have been read, or the thread would wake on it again and again."""
    program = build("sampler_sites.c")
    conv = Conversation([str(program), str(tmp_path / "blocks.bin"), str(sampler_lib)])
    try:
        conv.expect("ready")
        ctl = SamplerControl(conv.pid, sampler_lib)
        st = ctl.wait_ready()
        pidfd = os.pidfd_open(conv.pid)
        try:
            lease = sampler_module._pidfd_getfd(pidfd, st["lease_fd"])
        finally:
            os.close(pidfd)
        os.set_blocking(lease, False)
        ctl._lease = lease  # as arm() holds it
        refused = ctl._request(99)  # no such request
        assert refused["result"] == -errno.EINVAL and refused.state == "idle"
        deadline = time.monotonic() + 5
        while _unread(lease) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _unread(lease) == 0, "the control thread left the wake byte in the lease"
        tid = refused["control_tid"]
        before = _cpu_ticks(conv.pid, tid)
        time.sleep(1.0)
        assert _cpu_ticks(conv.pid, tid) - before <= 2, "the idle control thread spins"
        assert ctl.arm(4096).state == "armed"  # the same lease arms it
        conv.say("go")
        conv.expect("allocated")
        assert ctl.read()["samples"] > 0
        ctl.disarm()
        ctl.close()
        free_and_exit(conv)
    finally:
        conv.kill()


def free_and_exit(conv: Conversation) -> None:
    """sampler_sites.c's last steps: it frees site 0's blocks, then exits 0."""
    conv.say("free")
    conv.expect("freed")
    conv.say("exit")
    assert conv.finish() == 0


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def _cpu_ticks(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime
