"""Can this machine run heapscope's probes? One check, used by the CLI and by the integration tests."""

from __future__ import annotations

import importlib.util
import os
import platform


def check_environment(
    proc_root: str = "/proc", sys_root: str = "/sys", modules_root: str = "/lib/modules"
) -> list[str]:
    """Problems that stop BPF uprobes from working here; empty when all is well."""
    problems = []
    if os.geteuid() != 0:
        problems.append("heapscope needs root (CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE) to load probes")
    if not os.path.isdir(f"{sys_root}/bus/event_source/devices/uprobe"):
        problems.append("this kernel has no uprobe PMU (CONFIG_UPROBE_EVENTS)")
    if not os.path.isfile(f"{proc_root}/sys/kernel/unprivileged_bpf_disabled") and not os.path.isdir(
        f"{sys_root}/fs/bpf"
    ):
        problems.append("this kernel has no BPF support (CONFIG_BPF_SYSCALL)")
    if not os.path.isdir(f"{sys_root}/kernel/tracing/events") and not os.path.isdir(
        f"{sys_root}/kernel/debug/tracing/events"
    ):
        problems.append("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")
    build = f"{modules_root}/{platform.release()}/build"
    if not os.path.isdir(build) or not os.path.isdir(f"{modules_root}/{platform.release()}/source"):
        problems.append(f"kernel headers missing: {build} and .../source must exist (run `make setup`)")
    if importlib.util.find_spec("bcc") is None:
        problems.append("the bcc Python module is not importable (python3-bpfcc; run `make setup`)")
    return problems
