"""The Dockerfile's image, built offline with buildah and run as the DaemonSet in deploy/kubernetes runs it.

Building: no image registry is reachable, so `FROM debian:bookworm-slim` is replaced (`buildah bud --from`) by a
local base made the same way: a debootstrap'd Debian 12 root (tests/support/containers.py's debian_root, from the
package registry this machine's apt uses) with an empty /dev, no package lists and no .debs, plus the CA
certificates this machine adds to Debian's (/usr/local/share/ca-certificates: the registries are reached through
them here, and the image's `ca-certificates` picks them up as it would a company's CA). The Dockerfile itself
builds unchanged (`--isolation chroot`: podman's crun refuses this VM's hybrid cgroups), its apt step from the
Debian archive named in the base's sources.list (the same as the host's) and its pip step from PyPI.

Caching: buildah's storage is the tests' own, beside debian_root's roots (ROOTS/../buildah), so nothing of the
machine's container storage is used or changed. The image is tagged with a hash of the Dockerfile, .dockerignore
and every file its COPY lines name: a run whose files are the same finds it built, and `--layers` keeps the apt
layer while only the code changes. The older tags are removed after a build.

Running: `ImageContainer` starts the image's entry point and arguments with container_run.c in the host's PID
namespace, with a read-only sysfs, the runtimes' default devices, the pod's hostPath and configMap volumes bound
where the manifest mounts them, only the capabilities the manifest adds, and a cgroup namespace of its own, from
a working container (`buildah from` + `buildah mount`: an overlay of the image, thrown away afterwards, as a
container's writable layer is).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from tests.support.containers import ROOTS, Container, Unavailable, debian_root

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
MANIFEST = REPO / "deploy" / "kubernetes" / "heapscope.yaml"
STORAGE = ROOTS.parent / "buildah"  # the tests' own container storage (images, layers)
RUNROOT = Path("/run/heapscope-tests/buildah")  # its state (locks, mounts): gone at a reboot, as it should be
IMAGE = "localhost/heapscope-test"
BASE = "localhost/heapscope-test-base"
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
BUILD_TIMEOUT = 1800  # a first build: ~80 Debian packages and the venv from PyPI
# The devices a runtime gives a container that is not privileged (runc's defaults, without the terminal ones).
DEFAULT_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
CAPABILITY_HEADER = Path("/usr/include/linux/capability.h")


def buildah(*args: str, timeout: float = 300, log: IO[str] | None = None) -> str:
    """buildah on the tests' own storage; its standard output (or, with `log`, written there as it runs)."""
    if shutil.which("buildah") is None:
        raise Unavailable("buildah is not installed (Debian: buildah)")
    cmd = ["buildah", "--root", str(STORAGE), "--runroot", str(RUNROOT), *args]
    if log is not None:
        log.write(f"+ {' '.join(cmd)}\n")
        log.flush()
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=True)
        return ""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


def image_exists(name: str) -> bool:
    try:
        buildah("inspect", "--type", "image", name)
    except subprocess.CalledProcessError:
        return False
    return True


def _hash_tree(h: Any, path: Path) -> None:
    """Every file below `path` (names and contents, in order), as COPY takes it less what .dockerignore drops
    below the folders it copies (compiled Python)."""
    skip = re.compile(r"(^|/)__pycache__(/|$)|\.pyc$")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if skip.search(rel):
            continue
        h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")


def image_key() -> str:
    """A hash of what the build reads: the base, the Dockerfile, .dockerignore and the sources of its COPY lines."""
    h = hashlib.sha256(base_name().encode())
    text = DOCKERFILE.read_text()
    h.update(text.encode())
    ignore = REPO / ".dockerignore"
    if ignore.exists():
        h.update(ignore.read_bytes())
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        sources = [w for w in line.split()[:-1] if not w.startswith("--")]
        for source in sources:
            _hash_tree(h, REPO / source.rstrip("/"))
    return h.hexdigest()[:16]


def base_name() -> str:
    """The base's name: a hash of how it is made and of the certificates it adds."""
    key = hashlib.sha256(
        b"bookworm minbase, /dev empty, lists and .debs removed\0"
        + b"".join(c.name.encode() + c.read_bytes() for c in sorted(LOCAL_CAS.glob("*.crt")))
    ).hexdigest()[:12]
    return f"{BASE}:{key}"


def base_image(log: IO[str]) -> str:
    """The stand-in for debian:bookworm-slim, made once from a debootstrap'd root (see the module's text)."""
    cas = sorted(LOCAL_CAS.glob("*.crt"))
    name = base_name()
    if image_exists(name):
        return name
    root = debian_root("bookworm")
    box = buildah("from", "scratch").strip()
    try:
        mnt = Path(buildah("mount", box).strip())
        subprocess.run(["cp", "-a", f"{root}/.", str(mnt)], check=True)
        # What the slim image leaves out of a debootstrap'd root: device nodes (a runtime provides /dev), the
        # package lists, the downloaded .debs; and debian_root's stamp.
        for pattern in ("dev/*", "proc/*", "var/lib/apt/lists/*", "var/cache/apt/archives/*.deb", ".hs-complete"):
            for p in mnt.glob(pattern):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        (mnt / "usr/local/share/ca-certificates").mkdir(parents=True, exist_ok=True)
        for c in cas:
            shutil.copy2(c, mnt / "usr/local/share/ca-certificates" / c.name)
        buildah("umount", box)
        buildah("config", "--cmd", "bash", box)
        buildah("commit", "--rm", box, name, log=log)
    except BaseException:
        with contextlib.suppress(subprocess.CalledProcessError):
            buildah("rm", box)
        raise
    return name


@dataclass
class Built:
    name: str
    seconds: float  # the build's time, 0 when it was found built
    log: Path


def build_image() -> Built:
    """The Dockerfile's image for the files as they are, built unless it already is (see the module's text)."""
    STORAGE.mkdir(parents=True, exist_ok=True)
    RUNROOT.mkdir(parents=True, exist_ok=True)
    name = f"{IMAGE}:{image_key()}"
    log_path = STORAGE / "build.log"
    if image_exists(name):
        return Built(name, 0.0, log_path)
    start = time.monotonic()
    with log_path.open("w") as log:
        base = base_image(log)
        try:
            buildah(
                "bud",
                "--isolation",
                "chroot",
                "--pull=never",
                "--from",
                base,
                "--layers",
                "--format",
                "docker",
                "-f",
                str(DOCKERFILE),
                "-t",
                name,
                str(REPO),
                timeout=BUILD_TIMEOUT,
                log=log,
            )
        except subprocess.CalledProcessError as exc:
            raise AssertionError(
                f"the image did not build: the end of {log_path}:\n{log_path.read_text()[-4000:]}"
            ) from exc
    seconds = time.monotonic() - start
    # The older builds: their own layers go with them, the ones shared with this one (the apt layer) stay.
    for old in buildah("images", "--noheading", "--format", "{{.Name}}:{{.Tag}}").split():
        if old.startswith(f"{IMAGE}:") and old != name:
            with contextlib.suppress(subprocess.CalledProcessError):
                buildah("rmi", old)
    return Built(name, seconds, log_path)


@dataclass(frozen=True)
class ImageConfig:
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]


def image_config(name: str) -> ImageConfig:
    config = json.loads(buildah("inspect", "--type", "image", name))["OCIv1"]["config"]
    env = dict(e.split("=", 1) for e in config.get("Env", []))
    return ImageConfig(env, config.get("Entrypoint") or [], config.get("Cmd") or [])


@contextlib.contextmanager
def working_container(name: str) -> Iterator[Path]:
    """A writable root of the image (an overlay, as a container's), removed on the way out."""
    box = buildah("from", "--pull=never", name).strip()
    try:
        yield Path(buildah("mount", box).strip())
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            buildah("umount", box)
        buildah("rm", box)


def daemonset() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return next(d for d in docs if d["kind"] == "DaemonSet")


def config_map(name: str) -> dict[str, str]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return dict(next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)["data"])


def capability_numbers(names: list[str]) -> list[int]:
    """CAP_<NAME> numbers, from the kernel's header (Python has no table of them)."""
    text = CAPABILITY_HEADER.read_text()
    out = []
    for name in names:
        m = re.search(rf"^#define\s+CAP_{name}\s+(\d+)", text, re.M)
        assert m, f"CAP_{name} is not in {CAPABILITY_HEADER}"
        out.append(int(m.group(1)))
    return out


@dataclass
class PodSpec:
    """What the runner needs of the DaemonSet's pod: its container's arguments, environment variables, mounts
    and capabilities, and whether it shares the host's PID namespace."""

    args: list[str]
    env_from_secrets: list[str]
    binds: list[str] = field(default_factory=list)  # container_run.c's HS_BINDS items
    caps: list[int] | None = None  # None: privileged (all)
    host_pid: bool = False
    grace_seconds: float = 30  # Kubernetes' default terminationGracePeriodSeconds


def pod_spec(config_dirs: dict[str, Path], host_paths: dict[str, Path]) -> PodSpec:
    """The DaemonSet's first container as container_run.c runs it: configMap volumes are the directories in
    `config_dirs` (by ConfigMap name, filled by the caller), hostPath volumes are bound from the host, or from
    `host_paths[path]` where given (the output directory, not the host's own)."""
    pod = daemonset()["spec"]["template"]["spec"]
    c = pod["containers"][0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    binds = []
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "hostPath" in v:
            source = host_paths.get(v["hostPath"]["path"], Path(v["hostPath"]["path"]))
            source.mkdir(parents=True, exist_ok=True)  # DirectoryOrCreate, and what a missing path becomes
        elif "configMap" in v:
            source = config_dirs[v["configMap"]["name"]]
        else:
            raise AssertionError(f"volume {m['name']}: only hostPath and configMap are run here")
        binds.append(f"{source}:{m['mountPath']}" + (":ro" if m.get("readOnly") else ""))
    sc = c.get("securityContext", {})
    caps = None
    if not sc.get("privileged"):
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], "only drop: [ALL] is run here"
        caps = capability_numbers(sc["capabilities"].get("add", []))
    secrets = [e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    return PodSpec(
        args=list(c.get("args", [])),
        env_from_secrets=secrets,
        binds=binds,
        caps=caps,
        host_pid=bool(pod.get("hostPID")),
        grace_seconds=float(pod.get("terminationGracePeriodSeconds", 30)),
    )


class ImageContainer(Container):
    """The image's entry point with `args`, run as the pod runs it (see the module's text); its log (standard
    output and error) in `log`. `pid` is its host PID: the entry point execs heapscope, so it is the daemon's."""

    def __init__(
        self,
        runner: Path,
        root: Path,
        config: ImageConfig,
        spec: PodSpec,
        args: list[str],
        env: dict[str, str],
        log: Path,
        cgroup: Path | None = None,
    ) -> None:
        settings = {
            "HS_SYSFS": "1" if spec.caps is None else "ro",  # a runtime's sysfs is read-only unless privileged
            "HS_BINDS": " ".join([*(f"{d}:{d}" for d in DEFAULT_DEVICES), *spec.binds]),
            **({"HS_HOST_PID": "1"} if spec.host_pid else {}),
            **({"HS_CAPS": " ".join(map(str, spec.caps))} if spec.caps is not None else {}),
            **({"HS_CGROUP": str(cgroup), "HS_CGROUPNS": "1"} if cgroup else {}),
        }
        argv = [*config.entrypoint, *args]
        self.root = root
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(runner), str(root), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**config.env, **env, **settings},
            )
        self.pid = self._program_pid(argv[0])

    def terminate(self, grace: float) -> int:
        """SIGTERM, as the kubelet ends a pod; SIGKILL after `grace` seconds. The runner's status: the daemon's."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 15)
            try:
                return self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.stop()
        return self.proc.returncode
