"""The Dockerfile's image, run as deploy/kubernetes/heapscope.yaml's DaemonSet runs it, profiles a process of
another container in sampled mode (the daemon's default).

The image is built from the Dockerfile unchanged by buildah, offline but for the Debian archive and PyPI, and
cached (tests/support/image.py). It runs with the pod's settings read from the manifest: the host's PID namespace
(hostPID), its arguments with the ConfigMap's serve.args, the token from an environment variable, its hostPath and
configMap volumes, only the capabilities it adds, a read-only sysfs, a cgroup namespace of its own in a pod's
cgroup. Only two things differ, each said where it is done: the address (the pod has a network namespace of its
own; here the host's loopback stands in for it) and the output hostPath (a directory of the test's). The node is
one without kernel headers: any hostPath at /lib/modules or /usr/src would be an empty folder of the test's, and
the daemon compiles against the image's own headers, linked by its entry point for the running kernel.

The target is redis-server in a Debian 12 container (tests/support/containers.py) in another pod, started after
the daemon and chosen by a selector added to the ConfigMap's serve.args, as an operator would.

The same image is also run as the Dockerfile's comment says (`docker run --privileged --pid=host`): its own
command, none of the host's files, its own kernel headers, tracefs mounted by its entry point.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.errors import TargetError
from agent.process.sampler import SamplerControl, read_map_lines
from tests.support.armed import LIBRARY
from tests.support.capability import unavailable
from tests.support.containers import (
    Container,
    Unavailable,
    build_runner,
    debian_root,
    pod_cgroups,
    remove_cgroups,
    wait_redis,
)
from tests.support.daemon import AUTH, TOKEN, free_port
from tests.support.image import (
    Built,
    ImageContainer,
    PodSpec,
    build_image,
    config_map,
    image_config,
    pod_spec,
    working_container,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

SELECTORS = "heapscope-selectors"  # the ConfigMap the DaemonSet reads its selectors from
# How long the daemon may take to answer /healthz, and a target to be profiled: the first attach in a fresh
# container builds the sampler with the image's gcc and compiles the BPF programs (tens of seconds on 2 cores).
START_TIMEOUT = 120.0
ATTACH_TIMEOUT = 240.0
# The load on redis: keys of a value size well below the daemon's sampling rate (each sampled at random), enough
# of them for some hundreds of samples at the default rate, so the estimate's own spread is a few percent.
KEYS, VALUE_BYTES = 200_000, 1000
DOCKER_STOP_GRACE = 10.0  # `docker stop`'s default time between SIGTERM and SIGKILL


@pytest.fixture(scope="session")
def image(bpf_ready: None) -> Built:
    try:
        built = build_image()
    except Unavailable as exc:
        unavailable(str(exc))
    print(f"image {built.name}: " + (f"built in {built.seconds:.0f} s" if built.seconds else "already built"))
    return built


@pytest.fixture(scope="session")
def image_runner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_runner(tmp_path_factory.mktemp("runner"))


@pytest.fixture(scope="session")
def redis_root(bpf_ready: None) -> Path:
    try:  # the packages of test_containers.py's roots: the same cached root
        return debian_root("bookworm", ("redis-server", "libc6-dev"))
    except Unavailable as exc:
        unavailable(str(exc))


def redis(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def used_memory(port: int) -> int:
    """redis's own count of its heap (zmalloc's used_memory)."""
    info = dict(line.split(":", 1) for line in redis(port, "info", "memory").splitlines() if ":" in line)
    return int(info["used_memory"])


def listen_on(args: list[str], address: str) -> list[str]:
    """The DaemonSet's arguments with --http's address replaced: the pod listens on 0.0.0.0 in a network namespace
    of its own; sharing the host's here, the daemon listens on a free loopback port instead."""
    i = args.index("--http")
    assert args[i + 1].startswith("0.0.0.0:"), args
    return [*args[: i + 1], address, *args[i + 2 :]]


def memfd_sampler(pid: int, cache: Path) -> str:
    """The state of the sampler handed over to `pid` in a memfd, read from its control block (the library's
    symbols from the daemon's cache, `cache`): "armed", "idle"...; "not loaded" without one."""
    try:
        for m in read_map_lines(pid):
            name = m.path.removesuffix(" (deleted)").removeprefix("/memfd:")
            if m.offset == 0 and m.path.startswith("/memfd:") and LIBRARY.fullmatch(name):
                control = SamplerControl(pid, cache / name)
                try:
                    return control.read().state
                finally:
                    control.close()
    except TargetError:
        return "gone"
    return "not loaded"


def assert_own_headers(run: Run) -> None:
    """The kernel headers are the image's: the entry point linked /lib/modules/$(uname -r)/build to a folder of the
    image's own /usr/src, and nothing of the host is mounted at /lib/modules or /usr/src."""
    log = run.daemon.log.read_text()
    linked = re.search(rf"/lib/modules/{re.escape(os.uname().release)}/build -> (\S+)", log)
    assert linked and (run.root / linked.group(1).lstrip("/")).is_dir(), log
    mounts = [m.split()[4] for m in Path(f"/proc/{run.daemon.pid}/mountinfo").read_text().splitlines()]
    assert not [m for m in mounts if m.startswith(("/lib/modules", "/usr/src"))], mounts


def cap_mask(numbers: list[int]) -> int:
    return sum(1 << n for n in numbers)


def proc_caps(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")), 16)


@dataclass
class Run:
    """The image's daemon started in a container, then a redis-server in another one."""

    daemon: ImageContainer
    root: Path  # the daemon's container's root (its cache, and /var/lib/heapscope without a volume)
    url: str
    up: float  # seconds from its start to /healthz answering
    box: Container | None = None
    redis_port: int = 0

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=30)

    def start_redis(self, runner: Path, root: Path, cgroup: Path | None = None, port: int = 0) -> int:
        self.redis_port = port or free_port()
        argv = ["/usr/bin/redis-server", "--port", str(self.redis_port), "--save", "", "--appendonly", "no"]
        self.box = Container(runner, root, [*argv, "--enable-debug-command", "local"], cgroup=cgroup)
        wait_redis(self.redis_port)
        assert self.box.in_own_namespaces()
        return self.box.pid

    def target(self) -> dict[str, Any] | None:
        assert self.box is not None
        with self.client() as c:
            return next((t for t in c.get("/targets").json() if t["pid"] == self.box.pid), None)

    def profiled(self) -> dict[str, Any]:
        """The redis target once profiled, its sampler armed (read from its control block, with the library's
        symbols from the daemon's cache in the image's root, not the host's)."""
        assert self.box is not None
        pid, started = self.box.pid, time.monotonic()

        def profiling() -> dict[str, Any] | None:
            t = self.target()
            assert t is None or t["state"] in ("attaching", "profiling", "waiting"), t
            return t if t is not None and t["state"] == "profiling" else None

        t = wait_for(profiling, ATTACH_TIMEOUT, "redis in /targets, profiled")
        assert t is not None
        wait_for(lambda: memfd_sampler(pid, self.cache()) == "armed", 30, "the sampler armed in redis")
        print(f"daemon answering {self.up:.1f} s after its start; redis armed {time.monotonic() - started:.1f} s later")
        assert t["mode"] == "sampled" and t["estimate"] and t["sampler"] == "glibc build, memfd", t
        return t

    def cache(self) -> Path:
        return self.root / "var/cache/heapscope"

    def load(self, t: dict[str, Any]) -> None:
        """redis fills KEYS keys: the target's heap estimate in /targets grows as redis's own count does, within
        the sampling's spread; /snapshot shows a heap."""
        assert self.box is not None
        port = self.redis_port
        before, heap_before = used_memory(port), int(t["heap"]["useful_bytes"])
        assert redis(port, "debug", "populate", str(KEYS), "key", str(VALUE_BYTES)) == "OK"
        grown = used_memory(port) - before
        rate = t["sample_rate"]
        # The estimate's spread: about 1/sqrt(samples) of the growth; five times that leaves chance out. (redis
        # counts the sizes its allocator rounds up to, heapscope the sizes asked for: a few percent, well inside.)
        spread = 5 * (rate / grown) ** 0.5

        def estimate() -> int:
            t = self.target()
            assert t is not None
            return int(t["heap"]["useful_bytes"]) - heap_before

        got = wait_for(lambda: (e := estimate()) > grown * (1 - spread) and e, 30, "the heap's growth in /targets")
        print(f"redis grew by {grown} bytes (used_memory); heapscope's estimate {got} at 1 in {rate} bytes")
        assert abs(got - grown) <= grown * spread, (got, grown, spread)
        with self.client() as c:
            snapshot = c.get("/snapshot", params={"pid": self.box.pid}).text
        heap = int(re.findall(r"^mem_heap_B=(\d+)$", snapshot, re.M)[-1])
        assert heap >= grown * (1 - spread), snapshot

    def stop(self, grace: float, out: Path) -> None:
        """SIGTERM, as a runtime ends a container: the daemon exits 0 within `grace` seconds, having written the
        target's files to `out`; the sampler in redis goes inert, and redis runs on with its data."""
        assert self.box is not None
        pid = self.box.pid
        status = self.daemon.terminate(grace)
        log = self.daemon.log.read_text()
        assert status == 0 and "Traceback" not in log, log
        assert (out / f"massif.out.{pid}").exists(), sorted(p.name for p in out.iterdir())
        wait_for(lambda: memfd_sampler(pid, self.cache()) == "idle", 10, "the sampler to go inert after the end")
        assert redis(self.redis_port, "dbsize") == str(KEYS) and self.box.proc.poll() is None


@contextlib.contextmanager
def running(
    image: Built, runner: Path, spec: PodSpec, args: list[str], env: dict[str, str], log: Path, cgroup: Path | None
) -> Iterator[Run]:
    """The image's daemon in a container of its own, listening on a free loopback port, answering /healthz."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with working_container(image.name) as root:
        started = time.monotonic()
        daemon = ImageContainer(
            runner, root, image_config(image.name), spec, listen_on(args, f"127.0.0.1:{port}"), env, log, cgroup
        )
        run: Run | None = None
        try:

            def healthy() -> bool:
                assert daemon.proc.poll() is None, daemon.log.read_text()
                try:
                    return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(healthy, START_TIMEOUT, "the daemon in the image to answer /healthz")
            run = Run(daemon, root, url, time.monotonic() - started)
            yield run
        finally:
            if run is not None and run.box is not None:
                run.box.stop()
            daemon.stop()


def test_the_daemonsets_image_profiles_a_redis_in_another_pod_in_sampled_mode(
    image: Built, image_runner: Path, redis_root: Path, tmp_path: Path
) -> None:
    """As deploy/kubernetes/heapscope.yaml runs it (the module's text): the container is what the pod's spec says,
    and redis, started later in another pod, is profiled through the ConfigMap's selector, with its pod and
    container in /targets and in the metrics."""
    target_pod, daemon_pod = str(uuid.uuid4()), str(uuid.uuid4())
    target_id, daemon_id = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    cgroups = [*pod_cgroups(target_pod, [target_id]), *pod_cgroups(daemon_pod, [daemon_id])]
    selectors, out = tmp_path / "selectors", tmp_path / "var-lib-heapscope"
    selectors.mkdir()
    for name, text in config_map(SELECTORS).items():
        extra = f"--attach-cgroup=pod:{target_pod}\n" if name == "serve.args" else ""
        (selectors / name).write_text(text + extra)
    # A node without kernel headers for its kernel: its /lib/modules and /usr/src empty, wherever the pod would
    # mount them (the manifest mounts neither: the image brings its own).
    node = {path: tmp_path / "node" / path.strip("/") for path in ("/lib/modules", "/usr/src")}
    for folder in node.values():
        folder.mkdir(parents=True)
    spec = pod_spec({SELECTORS: selectors}, {"/var/lib/heapscope": out, **node})
    assert spec.host_pid and spec.caps is not None  # what this test is about: hostPID, not privileged
    env = {name: TOKEN for name in spec.env_from_secrets}  # the Secret's token
    try:
        with running(image, image_runner, spec, spec.args, env, tmp_path / "daemon.log", cgroups[1]) as run:
            pid = run.daemon.pid
            # The host's PID namespace, a mount and a cgroup namespace of its own, and exactly the capabilities
            # the manifest adds (of those this machine has: a runtime cannot give more than its own bounding set,
            # and a sandbox may lack some, as this one lacks SYS_RESOURCE).
            for ns, shared in (("pid", True), ("mnt", False), ("cgroup", False)):
                assert (os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}")) == shared, ns
            granted = cap_mask(spec.caps) & proc_caps(os.getpid(), "CapBnd")
            assert proc_caps(pid, "CapEff") == proc_caps(pid, "CapBnd") == granted
            assert httpx.get(f"{run.url}/targets", timeout=10).status_code == 401  # the token is asked for
            assert_own_headers(run)

            box_pid = run.start_redis(image_runner, redis_root, cgroups[0])
            t = run.profiled()
            placement = t["origin"]["placement"]
            assert (placement["pod"], placement["container"], placement["runtime"]) == (
                target_pod,
                target_id,
                "containerd",
            ), placement
            assert t["origin"]["selector"] is not None, t  # chosen by the ConfigMap's selector
            run.load(t)
            with run.client() as c:
                metrics = c.get("/metrics").text
            line = next(
                m
                for m in metrics.splitlines()
                if m.startswith("heapscope_heap_useful_bytes{") and f'pid="{box_pid}"' in m
            )
            assert f'pod="{target_pod}"' in line and f'container="{target_id}"' in line, line
            run.stop(spec.grace_seconds, out)  # the pod's end, within its grace period; files on the hostPath
    finally:
        remove_cgroups(cgroups)


def test_the_image_run_as_the_dockerfile_says_profiles_a_redis_in_another_container(
    image: Built, image_runner: Path, redis_root: Path, tmp_path: Path
) -> None:
    """`docker run -d --privileged --pid=host -e HEAPSCOPE_TOKEN=... heapscope`: the image's own command, nothing
    of the host mounted (its own kernel headers, linked by the entry point, which also mounts tracefs in the
    container's fresh sysfs), a selector posted to the API by command line."""
    config = image_config(image.name)
    spec = PodSpec(args=config.cmd, env_from_secrets=[], host_pid=True, caps=None, grace_seconds=DOCKER_STOP_GRACE)
    with running(
        image, image_runner, spec, spec.args, {"HEAPSCOPE_TOKEN": TOKEN}, tmp_path / "daemon.log", None
    ) as run:
        assert_own_headers(run)  # the image's (/usr/src in it, not the host's), linked for the host's kernel
        # Its sysfs is a fresh one with nothing mounted below: the entry point mounted tracefs there.
        mounts = Path(f"/proc/{run.daemon.pid}/mountinfo").read_text().splitlines()
        assert any(m.split()[4] == "/sys/kernel/tracing" and " - tracefs " in m for m in mounts), mounts
        port = free_port()
        with run.client() as c:  # redis's command line, as it shows it: "/usr/bin/redis-server *:PORT"
            r = c.post("/targets", json={"cmdline": rf"redis-server \*:{port}$"})
        assert r.status_code == 201, r.text
        run.start_redis(image_runner, redis_root, port=port)
        t = run.profiled()
        assert t["origin"]["selector"] == r.json()["id"], t
        run.load(t)
        run.stop(spec.grace_seconds, run.root / "var/lib/heapscope")  # docker stop; the files in its volume
