"""Real containers for the tests, made offline and started as runtimes start them.

Root filesystems:
- `debian_root(release, packages)`: debootstrap --variant=minbase of a Debian release from the Debian package
  registry this machine's apt uses (nothing else is fetched), cached under ROOTS (one build per machine).
- `musl_root()`: a root with musl's loader and libc only, and programs built with musl-gcc.

`Container(runner, root, argv)` runs a program the way runc or crun does for one process (podman's crun refuses
this VM's hybrid cgroups), through container_run.c: new mount and PID namespaces, the root bind-mounted onto
itself with a fresh /proc mounted inside it, `pivot_root` into it and the old root unmounted, then exec. The
program is PID 1 inside; `pid` is its PID on the host. Its stdin and stdout are pipes the test holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil

ROOTS = Path(os.environ.get("HEAPSCOPE_TEST_ROOTS", "/var/cache/heapscope-tests/roots"))
DEBOOTSTRAP_TIMEOUT = 900

RUNNER_SOURCE = Path(__file__).with_name("container_run.c")


class Unavailable(Exception):
    """A root filesystem cannot be made here (no debootstrap, no registry)."""


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 sources or sources.list)."""
    for path in [*Path("/etc/apt/sources.list.d").glob("*.sources"), Path("/etc/apt/sources.list")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s*)?)(\S+)", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
    return "http://deb.debian.org/debian"


def debian_root(release: str, packages: tuple[str, ...] = ()) -> Path:
    """A Debian `release` root with `packages`, built once per machine (a finished build leaves a stamp)."""
    key = hashlib.sha256(" ".join((release, *sorted(packages))).encode()).hexdigest()[:12]
    root = ROOTS / f"{release}-{key}"
    stamp = root / ".hs-complete"
    if stamp.exists():
        return root
    if shutil.which("debootstrap") is None:
        raise Unavailable("debootstrap is not installed")
    if root.exists():
        shutil.rmtree(root)  # a build that was interrupted
    root.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["debootstrap", "--variant=minbase"]
    if packages:
        cmd.append("--include=" + ",".join(packages))
    done = subprocess.run([*cmd, release, str(root), debian_mirror()], capture_output=True, text=True,
                          timeout=DEBOOTSTRAP_TIMEOUT, check=False)
    if done.returncode != 0:
        raise Unavailable(f"debootstrap {release} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    stamp.write_text(release + "\n")
    return root


MUSL_LIBC = Path("/usr/lib/x86_64-linux-musl/libc.so")  # musl-tools: musl's libc, which is also its loader


def musl_root(directory: Path, programs: dict[str, Path]) -> Path:
    """A root whose only libc is musl's (as Alpine's: /lib/ld-musl-x86_64.so.1 is the libc and the loader),
    with `programs` (name -> a musl-gcc build) in /bin."""
    if not MUSL_LIBC.exists():
        raise Unavailable("musl-tools is not installed")
    for sub in ("lib", "bin", "proc", "tmp"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(MUSL_LIBC, directory / "lib" / "ld-musl-x86_64.so.1")
    for name, program in programs.items():
        shutil.copy2(program, directory / "bin" / name)
    return directory


def pod_cgroups(pod: str, containers: list[str]) -> list[Path]:
    """cgroup v2 directories laid out as the kubelet (systemd driver) and containerd make them, one per container
    of `pod`; made if missing. (AssertionError where no cgroup v2 hierarchy is mounted.)"""
    mounts = [ln.split() for ln in Path("/proc/self/mounts").read_text().splitlines()]
    roots = [m[1] for m in mounts if m[2] == "cgroup2"]
    assert roots, "no cgroup v2 hierarchy is mounted"
    pod_dir = Path(roots[0], "kubepods.slice", "kubepods-burstable.slice",
                   f"kubepods-burstable-pod{pod.replace('-', '_')}.slice")
    out = []
    for c in containers:
        d = pod_dir / f"cri-containerd-{c}.scope"
        d.mkdir(parents=True, exist_ok=True)
        out.append(d)
    return out


def remove_cgroups(dirs: list[Path]) -> None:
    """The cgroups of pod_cgroups, once their processes are gone (the pod's own directory too)."""
    for d in [*dirs, *{d.parent for d in dirs}]:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def build_against(root: Path, source: Path, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """`source` built on this machine against the libc of a Debian root with libc6-dev (its headers, start files
    and libraries), so that it runs there: a program built against this machine's glibc asks for versions an
    older one lacks. The root's loader paths are absolute links, so the link is spelled out."""
    lib, gcc_dir = root / "usr/lib/x86_64-linux-gnu", Path(subprocess.run(
        ["gcc", "-print-libgcc-file-name"], capture_output=True, text=True, check=True).stdout.strip()).parent
    loader = next(lib.glob("ld-2.*.so"), None) or lib / "ld-linux-x86-64.so.2"
    obj = out.with_suffix(".o")
    subprocess.run(["gcc", "-nostdinc", "-isystem", str(gcc_dir / "include"), "-isystem",
                    str(root / "usr/include/x86_64-linux-gnu"), "-isystem", str(root / "usr/include"), "-fPIE",
                    *flags, "-c", "-o", str(obj), str(source)], check=True, capture_output=True)
    subprocess.run(["gcc", "-nostdlib", "-pie", "-o", str(out), str(lib / "Scrt1.o"), str(lib / "crti.o"),
                    str(gcc_dir / "crtbeginS.o"), str(obj), str(lib / "libc.so.6"), str(lib / "libc_nonshared.a"),
                    str(lib / "libpthread.so.0"), str(loader), "-Wl,--dynamic-linker=/lib64/ld-linux-x86-64.so.2",
                    str(gcc_dir / "libgcc.a"), str(gcc_dir / "crtendS.o"), str(lib / "crtn.o")],
                   check=True, capture_output=True)
    return out


def wait_redis(port: int, timeout: float = 20) -> None:
    """Until a redis-server on `port` answers PING (AssertionError after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False)
        if done.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise AssertionError(f"redis on {port} does not answer")


def build_runner(directory: Path) -> Path:
    """container_run.c, built static (nothing of the host is needed once it is inside the root)."""
    out = directory / "container_run"
    if not out.exists():
        subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(RUNNER_SOURCE)], check=True,
                       capture_output=True)
    return out


class Container:
    """One program in a root filesystem, in its own mount and PID namespaces."""

    def __init__(self, runner: Path, root: Path, argv: list[str], cgroup: Path | None = None) -> None:
        self.root = root
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **({"HS_CGROUP": str(cgroup)} if cgroup else {})}
        self.proc = subprocess.Popen([str(runner), str(root), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.pid = self._program_pid(argv[0])

    def _program_pid(self, program: str, timeout: float = 10.0) -> int:
        """The host PID of the program: the runner's child, once it has exec'ed the program."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runner = os.readlink(f"/proc/{self.proc.pid}/exe")
            for child in psutil.Process(self.proc.pid).children():
                try:
                    if os.readlink(f"/proc/{child.pid}/exe") != runner:  # exec'ed (maybe through a link)
                        return child.pid
                except OSError:
                    continue
            if self.proc.poll() is not None:
                raise AssertionError(f"the container ended with {self.proc.returncode} before {program} started")
            time.sleep(0.02)
        raise AssertionError(f"{program} did not start in its container within {timeout:.0f} s")

    def in_own_namespaces(self) -> bool:
        return all(os.readlink(f"/proc/{self.pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
                   for ns in ("mnt", "pid"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)  # PID 1 of its namespace: the namespace goes with it
            self.proc.kill()
            self.proc.wait(30)
