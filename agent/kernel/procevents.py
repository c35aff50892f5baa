"""The kernel's process events for the daemon's selectors: every exec, the forks and exits of watched processes
(probes/procevents.bpf.c, three tracepoints). One small BPF program for the whole daemon, whatever the number of
selectors and targets; user space sleeps in epoll until the ring buffer has records."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import struct
from dataclasses import dataclass
from importlib import resources
from types import TracebackType
from typing import Any, Literal

from agent.kernel.loader import compile_program, unload
from agent.kernel.rings import RingReader

RING_BYTES = 256 << 10
MAX_WATCHED = 65536
_RECORD = struct.Struct("<4I16s")  # struct pe_event
_KINDS: dict[int, Literal["exec", "fork", "exit"]] = {1: "exec", 2: "fork", 3: "exit"}


@dataclass(frozen=True)
class ProcEvent:
    kind: Literal["exec", "fork", "exit"]
    pid: int  # the process
    parent: int  # fork: the watched parent; else 0
    comm: str  # exec: the new program's name; fork: the parent's (the child's until it execs)


class ProcEvents:
    """The event source: `with ProcEvents() as ev: ev.watch(pid); ev.poll(1.0)`. Not thread-safe: one reader."""

    def __init__(self) -> None:
        self._bpf: Any = None
        self._ring: RingReader | None = None
        self._epoll: select.epoll | None = None
        self._lost_seen = 0

    def __enter__(self) -> ProcEvents:
        path = os.path.join(str(resources.files("probes")), "procevents.bpf.c")
        cflags = [f"-DPE_RING_PAGES={RING_BYTES // mmap.PAGESIZE}", f"-DPE_MAX_WATCHED={MAX_WATCHED}"]
        # bcc attaches the TRACEPOINT_PROBEs as it loads them.
        self._bpf = compile_program("cannot load the process-event tracepoints", src_file=path.encode(), cflags=cflags)
        try:
            fd = self._bpf["proc_events"].map_fd
            self._ring = RingReader(fd, RING_BYTES, _RECORD)
            self._epoll = select.epoll()
            self._epoll.register(fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._bpf is not None:
            unload(self._bpf)
            self._bpf = None

    def watch(self, pid: int) -> None:
        """Report the forks and the exit of `pid` from now on."""
        if self._bpf is not None:
            self._bpf["watched"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def unwatch(self, pid: int) -> None:
        if self._bpf is None:
            return
        with contextlib.suppress(KeyError):
            del self._bpf["watched"][ctypes.c_uint32(pid)]

    def watched(self) -> set[int]:
        if self._bpf is None:
            return set()
        return {int(k.value) for k in self._bpf["watched"]}

    def poll(self, timeout: float) -> list[ProcEvent]:
        """The events since the last call, waiting up to `timeout` seconds for the first."""
        assert self._ring is not None and self._epoll is not None
        records = self._ring.drain()
        if not records:
            self._epoll.poll(timeout)  # retried by Python on EINTR
            records = self._ring.drain()
        out = []
        for kind, pid, parent, _, comm in records:
            name = _KINDS.get(kind)
            if name is not None:
                out.append(ProcEvent(name, pid, parent, comm.split(b"\0", 1)[0].decode(errors="replace")))
        return out

    def lost(self) -> int:
        """Records lost since the last call (the ring buffer was full)."""
        if self._bpf is None:
            return 0
        total = int(self._bpf["lost"][ctypes.c_int(0)].value)
        new, self._lost_seen = total - self._lost_seen, total
        return new
