"""The daemon in tests: `heapscope serve` started on a free loopback port with a token, its log in a file, stopped
with SIGTERM (no traceback allowed in its log); daemon_target.c driven line by line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.wait import wait_for as wait_for  # a name some tests still import from here

TOKEN = "integration-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    url: str
    out_dir: Path
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=30.0)

    def stderr(self) -> str:
        return self.log.read_text()


def start_daemon(heapscope_cmd: list[str], tmp: Path, *extra: str, token: str | None = TOKEN) -> Daemon:
    port = free_port()
    out_dir = tmp / "out"
    log = tmp / "daemon.log"
    env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
    if token is not None:
        env["HEAPSCOPE_TOKEN"] = token
    if not any(a.startswith("--mode") for a in extra):
        extra = ("--mode=exact", *extra)  # exact figures; the daemon's sampled default has test_modes.py
    cmd = [*heapscope_cmd, "serve", "--http", f"127.0.0.1:{port}", "--output-dir", str(out_dir), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return Daemon(proc, url, out_dir, log)
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the daemon did not answer within {START_TIMEOUT} s:\n{log.read_text()}")


def stop_daemon(d: Daemon) -> int:
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(90)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
    assert "Traceback" not in d.stderr(), d.stderr()
    return d.proc.returncode


class Target:
    """daemon_target, driven line by line."""

    def __init__(self, program: Path) -> None:
        self.proc = subprocess.Popen([str(program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.read() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip()

    def step(self, expect: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()
        assert self.read() == expect

    def end(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def attach(client: httpx.Client, pid: int) -> dict:  # type: ignore[type-arg]
    r = client.post("/targets", json={"pid": pid})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def run_tool(args: list[str], text: str, tmp: Path, name: str) -> str:
    f = tmp / name
    f.write_text(text)
    done = subprocess.run([*args, str(f)], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, f"{args[0]} failed on {name}:\n{done.stderr}\n--- input:\n{text}"
    return done.stdout


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
