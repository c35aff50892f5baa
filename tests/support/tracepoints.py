"""The tracepoints a process has BPF programs attached to, as the kernel lists them (`bpftool perf list`)."""

from __future__ import annotations

import json
import subprocess


def syscall_tracepoints(pid: int) -> set[str]:
    """The system call tracepoints (sys_enter_*, sys_exit_*) process `pid` has a program attached to: any one of them
    sends every system call on the machine through the kernel's slower path."""
    done = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True, timeout=60, check=True)
    return {
        e["tracepoint"]
        for e in json.loads(done.stdout or "[]")
        if e.get("pid") == pid and e.get("fd_type") == "tracepoint" and e.get("tracepoint", "").startswith("sys_")
    }
