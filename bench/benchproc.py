"""What the daemon benchmarks share: building their C programs, a free port, heapscope's command, and a process's
CPU time and RSS from /proc. Imported by the scripts beside it (a script's own folder is on its import path)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def build(source: Path, out: Path, opt: str = "-O0") -> Path:
    """gcc -g with frame pointers, again only when the source is newer than the program."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["gcc", "-g", opt, "-fno-omit-frame-pointer", "-o", str(out), str(source)], check=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def heapscope_cmd() -> list[str]:
    exe = REPO / ".venv" / "bin" / "heapscope"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def wait_idle(pid: int, limit: float = 30.0) -> None:
    """Until heapscope uses under 5% of a CPU over half a second: its one-time work after the attach (symbolizing
    the stacks it meets first) is done, and what follows is its steady cost."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.025:
            return


def rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


def daemon_client(port: int, timeout: float = 300) -> httpx.Client:
    """A client of the daemon on loopback at port, once its /healthz answers (a minute at most)."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout)
    for _ in range(600):
        try:
            if client.get("/healthz").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return client


def stop_all(daemon: subprocess.Popen[bytes], targets: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the daemon (killed after 300 s: it writes every target's files first), then kill the targets."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(300)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    for p in targets:
        p.kill()
        p.wait()
