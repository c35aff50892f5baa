"""agent.model.cgroup: unit, pod and container from the cgroup paths that systemd, the kubelet (both cgroup drivers)
and the container runtimes make, and /proc/PID/cgroup read on v2, hybrid and namespaced hosts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.model.cgroup import CgroupPlacement, normalize_path, parse_proc_cgroup, placement_of

CID = "4f1d0c8a9b7e6d5c4b3a29180716f5e4d3c2b1a09f8e7d6c5b4a3928171605f4"
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
UID_ = UID.replace("-", "_")


@pytest.mark.parametrize(
    ("path", "unit", "pod", "container", "runtime"),
    [
        ("/system.slice/nginx.service", "nginx.service", "", "", ""),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/gunicorn.service", "gunicorn.service", "", "", ""),
        ("/system.slice/postgresql@15-main.service", "postgresql@15-main.service", "", "", ""),
        # kubelet, systemd driver, burstable and guaranteed QoS, containerd and CRI-O
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
         f"cri-containerd-{CID}.scope", UID, CID, "containerd"),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", f"crio-{CID}.scope", UID, CID, "cri-o"),
        # kubelet, cgroupfs driver: dashes in the UID and a bare container ID
        (f"/kubepods/besteffort/pod{UID}/{CID}", "", UID, CID, ""),
        # docker (systemd and cgroupfs drivers), podman
        (f"/system.slice/docker-{CID}.scope", f"docker-{CID}.scope", "", CID, "docker"),
        (f"/docker/{CID}", "", "", CID, "docker"),
        (f"/machine.slice/libpod-{CID}.scope", f"libpod-{CID}.scope", "", CID, "podman"),
        # CRI-O's monitor is not the container
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope", f"crio-conmon-{CID}.scope", UID, "", ""),
        # a pod's own cgroup (its pause process, or a process the kubelet put there)
        (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice", "", UID, "", ""),
        ("/", "", "", "", ""),
        ("", "", "", "", ""),
    ],
)
def test_placement_of(path: str, unit: str, pod: str, container: str, runtime: str) -> None:
    p = placement_of(path)
    assert (p.unit, p.pod, p.container, p.runtime) == (unit, pod, container, runtime)
    assert p.path == (normalize_path(path) if path else "")


def test_a_namespaced_reader_sees_dotdot_components_which_are_dropped() -> None:
    inside = f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
    p = placement_of(inside)
    assert p.path == f"/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
    assert (p.pod, p.container) == (UID, CID)
    assert normalize_path("/../..") == "/"
    assert normalize_path("/system.slice/x.service/") == "/system.slice/x.service"


def test_a_hex_component_is_a_container_only_below_a_pod_or_docker() -> None:
    assert placement_of(f"/some/{CID}") == CgroupPlacement(path=f"/some/{CID}")


def test_proc_cgroup_v2_hybrid_and_v1() -> None:
    assert parse_proc_cgroup("0::/system.slice/nginx.service\n") == "/system.slice/nginx.service"
    hybrid = "12:memory:/x\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n"
    assert parse_proc_cgroup(hybrid) == "/system.slice/a.service"
    v1_only = "4:memory:/x\n1:name=systemd:/system.slice/b.service\n"
    assert parse_proc_cgroup(v1_only) == "/system.slice/b.service"
    assert parse_proc_cgroup("4:memory:/x\n") == ""
    assert parse_proc_cgroup("0::/../../kubepods.slice\n") == "/kubepods.slice"
