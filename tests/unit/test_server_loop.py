"""The HTTP server's own loop (api.server): an idle daemon's event loop wakes about once a second, not uvicorn's ten
times, and a request to stop is seen at once, not at the next of those wakes."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from api import server


def test_the_loop_wakes_once_a_second_and_at_once_when_told_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[float] = []
    until = threading.Event()
    stop_asked: list[float] = []
    on_tick = server._Server.on_tick

    async def counted(self: server._Server, counter: int) -> bool:
        ticks.append(time.monotonic())
        if len(ticks) == 3:  # just after a wake: the next would come a whole tick later
            threading.Timer(0.05, lambda: (stop_asked.append(time.monotonic()), until.set())).start()
        return await on_tick(self, counter)

    monkeypatch.setattr(server._Server, "on_tick", counted)
    app = FastAPI()
    app.get("/healthz")(lambda: {"ok": True})
    sock = server.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    answered: list[int] = []
    threading.Timer(0.5, lambda: answered.append(httpx.get(f"http://127.0.0.1:{port}/healthz").status_code)).start()
    started = time.monotonic()
    server.serve(app, sock, until=until)
    assert answered == [200]
    idle = [b - a for a, b in itertools.pairwise(ticks[:3])]  # the last came at the request to stop
    assert all(gap >= 0.9 * server._Server.TICK for gap in idle), idle  # uvicorn's own loop: 0.1 s apart
    assert len(ticks) == 4, ticks  # the wake that saw the request to stop was the last
    assert ticks[-1] - stop_asked[0] < 0.5 * server._Server.TICK, (ticks[-1] - stop_asked[0])
    assert time.monotonic() - started < 10
