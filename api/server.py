"""Serving the app with uvicorn on a socket bound here, so that a bad address is a one-line error, port 0
gives a free port, and the caller knows the address before the server runs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from agent.errors import UsageError


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT`, or `:PORT` (loopback)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise UsageError(f"--http wants HOST:PORT, got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--http: bad port {port!r}") from None
    if not 0 <= number <= 65535:
        raise UsageError(f"--http: port {number} is out of range")
    return host, number


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host}: {exc.strerror}") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, its loop woken once a second rather than ten times to see whether to stop (each wake of an
    idle daemon's loop cost CPU beside the service it profiles: some 4 ms a second here), and at once when told to
    stop: by a signal, or by `stop()` from another thread."""

    TICK = 1.0  # seconds between the looks at should_exit; also how often the Date header is refreshed

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None] | None) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._woken: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_signal is not None:
            self._on_signal(sig)
        super().handle_exit(sig, frame)
        self._wake()

    def stop(self) -> None:
        self.should_exit = True
        self._wake()

    def _wake(self) -> None:
        if self._woken is not None:
            loop, event = self._woken
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        event = asyncio.Event()
        self._woken = (asyncio.get_running_loop(), event)
        ticks = 0
        should_exit = await self.on_tick(ticks)
        while not should_exit:
            ticks = (ticks + 10) % 864_000  # uvicorn counts tenths of a second: a multiple of 10 refreshes the Date
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.TICK)
            event.clear()
            should_exit = await self.on_tick(ticks)


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    until: threading.Event | None = None,
    on_signal: Callable[[int], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, or until `until` is set. The app's lifespan shutdown runs either way."""
    config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = _Server(config, on_signal)
    if until is not None:

        def watch() -> None:
            until.wait()
            server.stop()

        threading.Thread(target=watch, name="heapscope-until", daemon=True).start()
    # uvicorn re-raises the signal it caught once it has shut down: let that land on a handler that ignores it.
    previous = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
    if not server.started:
        raise UsageError("the HTTP server did not start (see the messages above)")


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass
