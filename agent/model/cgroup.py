"""Where a process runs, from its cgroup v2 path alone: the systemd unit, the Kubernetes pod and the container.

No call to the API server or the container runtime: the names come from the path's components, as systemd, the
kubelet and the runtimes make them:

    /system.slice/nginx.service                                            unit nginx.service
    /kubepods.slice/kubepods-burstable.slice/
        kubepods-burstable-pod<uid, _ for ->.slice/cri-containerd-<id>.scope  pod <uid>, container <id> (containerd)
    /kubepods/burstable/pod<uid>/<id>                                      the kubelet's cgroupfs driver
    /system.slice/docker-<id>.scope, /docker/<id>                          docker
    /machine.slice/libpod-<id>.scope                                       podman
    crio-<id>.scope                                                        CRI-O (crio-conmon-<id>.scope is its monitor)

A reader inside a cgroup namespace (a container) sees paths relative to its own cgroup, with leading `/..`
components: those are dropped, the rest is parsed the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_POD = re.compile(r"^(?:kubepods-(?:besteffort-|burstable-|guaranteed-)?)?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}"
                  r"[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_SCOPE = re.compile(r"^(cri-containerd|crio|docker|libpod)-([0-9a-f]{64})\.scope$")
_BARE_ID = re.compile(r"^[0-9a-f]{64}$")
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", "libpod": "podman"}
_UNIT_SUFFIXES = (".service", ".scope")


@dataclass(frozen=True)
class CgroupPlacement:
    """A process's cgroup and what its path tells. Empty strings where the path does not say."""

    path: str = ""  # the cgroup v2 path, as /proc/PID/cgroup gives it (leading /.. dropped)
    unit: str = ""  # the innermost systemd unit (.service or .scope)
    pod: str = ""  # the Kubernetes pod's UID, with dashes
    container: str = ""  # the container's full ID (64 hex digits)
    runtime: str = ""  # containerd, cri-o, docker or podman, when the path names it


def normalize_path(path: str) -> str:
    """A cgroup path without the `/..` a cgroup namespace puts in front, nor a trailing slash."""
    parts = [p for p in path.strip().split("/") if p]
    while parts and parts[0] == "..":
        parts.pop(0)
    return "/" + "/".join(parts)


def parse_proc_cgroup(text: str) -> str:
    """The cgroup v2 path from the text of /proc/PID/cgroup (`0::/path`); on a cgroup v1 host, the path of
    systemd's named hierarchy (`N:name=systemd:/path`); "" when neither is there."""
    v1 = ""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return normalize_path(path)
        if controllers == "name=systemd":
            v1 = normalize_path(path)
    return v1


def placement_of(path: str) -> CgroupPlacement:
    """Unit, pod and container from a cgroup path (see the module's text for the forms understood)."""
    path = normalize_path(path) if path else ""
    unit = pod = container = runtime = ""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        m = _POD.match(part)
        if m:
            pod = m.group(1).replace("_", "-")
            continue
        m = _SCOPE.match(part)
        if m:
            runtime, container = _RUNTIMES[m.group(1)], m.group(2)
            continue
        # cgroupfs drivers: the bare ID below a pod (kubelet) or below /docker.
        if _BARE_ID.match(part) and i > 0 and (pod or parts[i - 1] == "docker"):
            container = part
            runtime = runtime or ("docker" if parts[i - 1] == "docker" else "")
            continue
        if part.endswith(_UNIT_SUFFIXES):
            unit = part
    # A container's own scope is its unit too, as systemctl shows it.
    if container and not unit:
        unit = next((p for p in reversed(parts) if p.endswith(".scope")), "")
    return CgroupPlacement(path=path, unit=unit, pod=pod, container=container, runtime=runtime)
