"""Bringing the sampler into running processes with ptrace (agent/process/inject.py): a busy multi-threaded
program checks its own results through call cycles on every thread, an injection and arm/disarm cycles;
estimates through an injected sampler; and the refusals."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.errors import TargetError
from agent.process import inject as inject_module
from agent.process.inject import (
    HOLDING_NICE,
    XSTATE_MAX,
    call_function,
    call_sampler,
    inject,
    load_stub,
    single_threaded,
)
from agent.process.sampler import SamplerControl, build_sampler, build_stub, mapped_base
from tests.support.capability import require, unavailable
from tests.support.conversation import Conversation
from tests.support.sampler_sites import check_sites, run_sites
from tests.support.services import Apache

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def sampler_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("root")  # ptrace
    directory = tmp_path_factory.mktemp("sampler-cache")
    os.chmod(directory, 0o755)
    return build_sampler(directory)


def finish_stress(conv: Conversation) -> str:
    conv.say("exit")
    assert conv.proc.stdout is not None
    out = conv.proc.stdout.read()
    rc = conv.finish()
    assert rc == 0 and out.strip().endswith("ok"), out
    return out


def test_calls_on_every_thread_and_arm_cycles_change_nothing(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """Threads in malloc storms, in read/nanosleep/futex/epoll_wait, spinning on loaded vector registers and
    churning dlopen/dlclose: 45 injected calls rotating over all of them, the injection, and 10 arm/disarm
    cycles (half by request, half by dropping the lease) leave 0 EINTR, 0 wrong results, no crash."""
    program = build("sampler_stress.c", flags=("-g", "-O2"))
    plugin = build("plugin.c", shared=True)
    conv = Conversation([str(program), str(plugin)])
    try:
        conv.expect("ready")
        time.sleep(0.2)  # every thread reaches its blocking call or loop
        used: Counter[int] = Counter()
        for i in range(45):
            rax, tid = call_function(conv.pid, "getpid", rotate=i)
            assert rax == conv.pid
            used[tid] += 1
        threads = len(os.listdir(f"/proc/{conv.pid}/task"))
        assert len(used) == threads  # every thread ran a call (none is ever inside the allocator for long)
        injected = inject(conv.pid, sampler_lib)
        assert not injected.reused
        assert not injected.was_single_threaded and not injected.warnings
        assert inject(conv.pid, sampler_lib).reused  # never loaded twice
        last_samples = 0
        for cycle in range(10):
            ctl = SamplerControl(conv.pid, sampler_lib)
            armed = ctl.arm(4096)
            assert armed.state == "armed" and armed["slots_patched"] > 0
            # the statistics start again at arming: read at once, fewer than the last cycle's 0.1 s of samples
            assert cycle == 0 or armed["samples"] < last_samples, (armed["samples"], last_samples)
            time.sleep(0.1)
            if cycle % 2:
                st = ctl.disarm()
                assert st.state == "idle" and st.disarm_reason == "requested"
            else:
                ctl.close()  # the lease goes: the sampler disarms itself
                watch = SamplerControl(conv.pid, sampler_lib)
                deadline = time.monotonic() + 1.0
                while (st := watch.read()).state == "armed":
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
                watch.close()
                assert st.disarm_reason == "controller gone"
            assert st["slots_patched"] == 0
            last_samples = st["samples"]
        final = SamplerControl(conv.pid, sampler_lib).read()
        assert final["samples"] > 0 and final["sampled_frees"] > 0
        assert final["arm_count"] == 10
        finish_stress(conv)
    finally:
        conv.kill()


def test_a_seized_thread_is_held_at_a_raised_priority_and_the_priority_given_back(
    build: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a thread of the target is seized, the injecting thread runs at HOLDING_NICE (on cores the service keeps
    busy it does not wait its turn with the thread stopped); afterwards at its own nice again, whatever it was. A
    thread at the idle policy (a heapscope started under `chrt --idle 0`) holds at the normal policy, and is idle
    again afterwards."""
    require("root")
    conv = Conversation([str(build("attach_target.c"))])
    me = threading.get_native_id()
    seen: list[tuple[int, int]] = []
    judge = inject_module._verdict

    def watched(*args: object, **kw: object) -> object:
        # the target's thread is stopped now
        seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, me)))
        return judge(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(inject_module, "_verdict", watched)
    own = os.getpriority(os.PRIO_PROCESS, me)
    try:
        conv.expect("ready")
        for policy, nice in ((os.SCHED_OTHER, 5), (os.SCHED_IDLE, own), (os.SCHED_OTHER, own)):
            os.sched_setscheduler(0, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, me, nice)
            rax, _ = call_function(conv.pid, "getpid")
            assert rax == conv.pid
            assert seen[-1] == (os.SCHED_OTHER, HOLDING_NICE), (policy, seen)
            assert os.sched_getscheduler(0) == policy and os.getpriority(os.PRIO_PROCESS, me) == nice
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, me, own)
        conv.kill()


def test_sampled_bytes_per_site_via_injection(sampler_lib: Path, build: Callable[..., Path], tmp_path: Path) -> None:
    program = build("sampler_sites.c")

    def bring_in(pid: int) -> SamplerControl:
        done = inject(pid, sampler_lib)
        assert not done.reused and done.tid == pid  # the main thread, blocked in read(), was a safe point
        # Its threads start later: single-threaded, it is kept so (no control thread; the loader's thread joined,
        # glibc's flags put back), and its sampler is armed by calls.
        assert not done.was_single_threaded and not done.warnings
        assert os.listdir(f"/proc/{pid}/task") == [str(pid)] and single_threaded(pid, "/proc")
        return SamplerControl(pid, sampler_lib, call=lambda request, arg: call_sampler(pid, sampler_lib, request, arg))

    check_sites(run_sites(program, sampler_lib, tmp_path, bring_in, load_itself=False))


def refused(argv: list[str], lib: Path) -> str:
    conv = Conversation(argv)
    try:
        conv.expect("ready")
        with pytest.raises(TargetError) as info:
            inject(conv.pid, lib)
        assert mapped_base(conv.pid, lib) is None
        conv.say("x")
        assert conv.finish() == 0  # the program ran on untouched
        assert info.value.exit_code == 3
        return str(info.value)
    finally:
        conv.kill()


def test_refuses_a_seccomp_target(sampler_lib: Path, build: Callable[..., Path]) -> None:
    assert "seccomp" in refused([str(build("sampler_seccomp.c"))], sampler_lib)


def test_refuses_a_static_program(sampler_lib: Path, build: Callable[..., Path]) -> None:
    program = build("sampler_wait.c", flags=("-g", "-O0", "-static"))
    assert "no libc with a dlopen (a static program" in refused([str(program)], sampler_lib)


def test_refuses_an_allocator_linked_into_the_executable(sampler_lib: Path, build: Callable[..., Path]) -> None:
    assert "linked into its executable" in refused([str(build("sampler_own_malloc.c"))], sampler_lib)


def test_a_library_the_target_cannot_see_is_handed_over_in_a_memfd(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """A target in its own mount namespace with the sampler's folder hidden under a tmpfs (as in a container
    that does not share it): the library goes in through a memfd it makes, and its descriptor is closed after."""
    program = build("sampler_wait.c")
    hide = f"mount -t tmpfs none {sampler_lib.parent} && exec {program}"
    conv = Conversation(["unshare", "-m", "--propagation", "private", "sh", "-c", hide])
    try:
        conv.expect("ready")
        injection = inject(conv.pid, sampler_lib)
        assert injection.memfd and not injection.reused
        maps = Path(f"/proc/{conv.pid}/maps").read_text()
        assert f"/memfd:{sampler_lib.name} (deleted)" in maps and mapped_base(conv.pid, sampler_lib) is not None
        fds = [os.readlink(f"/proc/{conv.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{conv.pid}/fd")]
        assert not [f for f in fds if "memfd:" in f], fds  # its descriptor is closed: the mapping holds the file
        assert inject(conv.pid, sampler_lib).reused  # found again by its memfd's name
        conv.say("x")
        assert conv.finish() == 0
    finally:
        conv.kill()


def test_a_hidden_library_where_the_target_has_no_proc_is_loaded_from_its_folder_handed_over(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """No /proc in its root (a bare chroot) and the folder hidden: the folder is handed over (a descriptor through an
    abstract socket) and made the loading thread's working directory for the dlopen, then put back. Nothing of it
    stays in the process: no descriptor, the same working directory."""
    program = build("sampler_wait.c")
    hide = f"mount -t tmpfs none {sampler_lib.parent} && mount -t tmpfs none /proc && exec {program}"
    conv = Conversation(["unshare", "-m", "--propagation", "private", "sh", "-c", hide])
    try:
        conv.expect("ready")
        cwd = os.readlink(f"/proc/{conv.pid}/cwd")
        fds_before = sorted(os.listdir(f"/proc/{conv.pid}/fd"))
        injection = inject(conv.pid, sampler_lib)
        assert injection.folder and not injection.memfd and not injection.reused
        assert mapped_base(conv.pid, sampler_lib) is not None
        assert os.readlink(f"/proc/{conv.pid}/cwd") == cwd
        new = [os.readlink(f"/proc/{conv.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{conv.pid}/fd")
               if fd not in fds_before]
        assert len(new) == 2 and all(f.startswith("pipe:") for f in new), new  # the sampler's lease, no more
        assert inject(conv.pid, sampler_lib).reused
        conv.say("x")
        assert conv.finish() == 0
    finally:
        conv.kill()


def test_refuses_a_hidden_library_where_the_target_has_no_proc_and_another_network(
    sampler_lib: Path, build: Callable[..., Path]
) -> None:
    """The same in a network namespace of its own: no abstract socket of ours reaches it. One line that says so."""
    program = build("sampler_wait.c")
    hide = f"mount -t tmpfs none {sampler_lib.parent} && mount -t tmpfs none /proc && exec {program}"
    msg = refused(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", hide], sampler_lib)
    assert "has no /proc there" in msg and "another network namespace" in msg


def test_refusal_is_one_line_and_an_exit_code(sampler_lib: Path, build: Callable[..., Path]) -> None:
    """The error carries one line and the target's exit code, as the CLI prints it."""
    conv = Conversation([str(build("sampler_seccomp.c"))])
    try:
        conv.expect("ready")
        script = (
            "import sys\n"
            "from pathlib import Path\n"
            "from agent.errors import HeapscopeError\n"
            "from agent.process.inject import inject\n"
            "try:\n"
            f"    inject({conv.pid}, Path({str(sampler_lib)!r}))\n"
            "except HeapscopeError as e:\n"
            "    print(f'heapscope: error: {e}', file=sys.stderr)\n"
            "    sys.exit(e.exit_code)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        done = subprocess.run([os.sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
        assert done.returncode == 3
        assert len(done.stderr.strip().splitlines()) == 1 and "seccomp" in done.stderr
        conv.say("x")
        assert conv.finish() == 0
    finally:
        conv.kill()


def test_controller_killed_in_the_middle_of_the_injected_call(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    """heapscope lets the thread go before the call runs; the stub puts the thread back by itself. Killing
    the injecting process while dlopen is still inside a 1.5 s constructor leaves the program running
    correctly, and the call completes."""
    require("root")  # ptrace
    program = build("sampler_stress.c", flags=("-g", "-O2"))
    plugin = build("plugin.c", shared=True)
    slow = build("slow_init.c", shared=True)
    conv = Conversation([str(program), str(plugin)])
    try:
        conv.expect("ready")
        time.sleep(0.2)
        script = (
            "from pathlib import Path\n"
            "from agent.process.inject import inject\n"
            f"inject({conv.pid}, Path({str(slow)!r}))\n"
            "print('returned', flush=True)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        controller = subprocess.Popen([os.sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 10
        while mapped_base(conv.pid, slow) is None:  # the loader has mapped it: dlopen is under way
            assert time.monotonic() < deadline and controller.poll() is None
            time.sleep(0.002)
        controller.kill()
        controller.wait()
        assert controller.stdout is not None and controller.stdout.read() == ""  # killed before the call returned
        # The constructor finishes, the thread resumes by itself, and the program never notices.
        time.sleep(2.0)
        finish_stress(conv)
    finally:
        conv.kill()


def heap_top_moved(program: Path, lib: Path) -> int:
    """By how many bytes inject() shrank the program's main heap's top chunk."""
    conv = Conversation([str(program)])
    try:
        conv.expect("ready")

        def top() -> int:
            conv.say("?")
            assert conv.proc.stdout is not None
            return int(conv.proc.stdout.readline().split()[1])

        top()  # stdout's buffer is made at the first line
        before = top()
        done = inject(conv.pid, lib)
        assert not done.reused
        return before - top()
    finally:
        conv.kill()


def test_the_loader_runs_on_a_thread_of_its_own_and_leaves_the_main_heap(
    sampler_lib: Path, build: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """dlopen and the library's start on a thread heapscope makes (with a stack of its own): their allocations
    come from that thread's arena, and the main heap, which a prefork server's workers inherit, keeps its top but
    for the new thread's TLS vector (one chunk, freed at the join). Twin: with no thread to make (glibc before
    2.34), the loader runs on the program's thread and takes kilobytes of the main heap."""
    program = build("main_heap.c")
    moved = heap_top_moved(program, sampler_lib)
    assert 0 <= moved <= 1024, moved
    monkeypatch.setattr("agent.process.inject._call_thread", lambda pid, proc_root: None)
    moved_on_its_thread = heap_top_moved(program, sampler_lib)
    assert moved_on_its_thread > 2048, moved_on_its_thread


def test_the_stub_holds_any_xsave_area_the_kernel_hands_over() -> None:
    """The stub keeps the thread's whole XSAVE area: as much as heapscope reads of it (on a CPU with AMX, 11,008
    bytes, past the two pages it once had)."""
    stub = load_stub(build_stub())
    assert stub.xsave_room >= XSTATE_MAX
    assert stub.xsave % 64 == 0  # XRSTOR's alignment


def test_a_thread_holding_amx_tiles_gets_them_back(sampler_lib: Path, build: Callable[..., Path]) -> None:
    """A thread with live AMX tile data, waiting in read(), runs the injection and then finds its tile as it was."""
    conv = Conversation([str(build("amx_tiles.c", flags=("-g", "-O1")))])
    try:
        assert conv.proc.stdout is not None
        first = conv.proc.stdout.readline().strip()
        if first == "noamx":
            conv.finish()
            pytest.skip("no AMX on this CPU or kernel")
        assert first == "ready"
        time.sleep(0.1)  # in read()
        injected = inject(conv.pid, sampler_lib)
        assert not injected.reused
        rax, _ = call_function(conv.pid, "getpid")
        assert rax == conv.pid
        conv.say("check")
        conv.expect("ok")
        conv.say("exit")
        assert conv.finish() == 0
    finally:
        conv.kill()


def _faults_a_request(svc: Apache) -> float:
    """Page faults of apache2's processes a request over a short load (reaped workers' included)."""
    before = svc.minor_faults()
    got = svc.load(2.0)
    assert got.ok and got.requests, got
    return (svc.minor_faults() - before) / got.requests


def test_a_prefork_servers_workers_allocate_as_before_the_injection(sampler_lib: Path) -> None:
    """The sampler loaded into apache2's master changes nothing in the workers it forks: their heap grows and
    shrinks as before. With libm loaded, glibc's malloc placed the workers' blocks otherwise, and each request
    trimmed and grew the heap again: 35 page faults a request instead of 3, for good."""
    if Apache.missing():
        unavailable(f"apache2 is not installed ({', '.join(Apache.missing())}): scripts/setup.sh apt")
    with Apache() as svc:
        svc.load(1.0)
        untraced = _faults_a_request(svc)
        assert not inject(svc.main_pid, sampler_lib).reused
        svc.recycle_workers()  # every worker forked from the master with the sampler in it
        loaded = _faults_a_request(svc)
        assert loaded <= 1.5 * untraced + 1.0, (untraced, loaded)
