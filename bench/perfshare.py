"""Where a followed service's CPU goes, from the whole machine sampled by `perf record -a -g` (the cpu-clock event):
the service's samples, those taken inside heapscope's probes (the uprobe's way into the kernel and the BPF programs
under it, which kernel.bpf_stats_enabled does not see whole: it times the programs alone), and those in the injected
sampler's own code. bench/request_cost.py --perf uses it; the daemon's CPU it reads from /proc."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HZ = 999  # samples a second and a CPU: not a multiple of the timer tick, so not in step with it
# A sampled call's way into the kernel: the uprobe system call of an optimized probe (Linux 6.18's trampoline for a
# probe on a 5-byte nop, as the sampler's two probe functions start), or the breakpoint's trap otherwise.
PROBE_ENTRIES = ("__x64_sys_uprobe", "uprobe_notify_resume", "handle_swbp")
SAMPLER_OBJECT = "hs_sampler"  # the library's file is libhs_sampler-<hash>.so


@dataclass
class Shares:
    """Samples, each 1/HZ s of one CPU."""

    service: int = 0  # the service's processes' (by their command name)
    probes: int = 0  # of the service's, inside a probe's entry (PROBE_ENTRIES)
    bpf: int = 0  # of those, in a BPF program or a helper it called
    sampler: int = 0  # of the service's, in the sampler's own code (its object at the top of the stack)

    def us(self, samples: int, requests: float) -> float:
        """Samples as µs of CPU a request."""
        return 1e6 * samples / HZ / requests if requests else 0.0


def available() -> str | None:
    """Why perf cannot be used here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian's linux-perf, in scripts/apt-packages-dev.txt)"
    return None


def record(seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """Start sampling every CPU for `seconds`, into `out`; wait() on what it returns."""
    return subprocess.Popen(
        ["perf", "record", "-a", "-g", "-F", str(HZ), "-o", str(out), "--", "sleep", f"{seconds:.3f}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def attribute(data: Path, service_comm: str) -> Shares:
    """Count `perf record -g`'s samples in `data` by where they were taken."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,ip,sym,dso"],
        capture_output=True, text=True, check=True,
    ).stdout
    return count_samples(text, service_comm)


def count_samples(text: str, service_comm: str) -> Shares:
    """`perf script -F comm,pid,ip,sym,dso` output: a sample is a line `comm pid` and its stack below it, leaf first,
    one frame a line (`ip symbol (object)`), and a blank line after."""
    s = Shares()
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        if not lines:
            continue
        head = lines[0].rsplit(None, 1)
        if len(head) != 2 or not head[1].isdigit() or head[0].strip() != service_comm:
            continue
        s.service += 1
        frames = [line.strip() for line in lines[1:]]
        if any(entry in frame for frame in frames for entry in PROBE_ENTRIES):
            s.probes += 1
            if any("bpf_prog_" in frame for frame in frames):
                s.bpf += 1
        elif frames and SAMPLER_OBJECT in frames[0]:
            s.sampler += 1
    return s
