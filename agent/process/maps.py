"""The target's file mappings, recorded while it lives so that it can be symbolized after it exits."""

from __future__ import annotations

import os
import weakref
from dataclasses import replace

from agent.model.maps import Mapping, code_lines, parse_maps
from agent.model.pages import parse_start_stack
from agent.process.view import ProcessView


class MapsRecorder:
    """The target's executable file mappings, recorded while it lives so that it can be symbolized after it
    exits."""

    def __init__(self, pid: int, proc: str = "/proc") -> None:
        self.path = f"{proc}/{pid}/maps"
        self.view = ProcessView.of(pid, proc)  # a container's or a chroot's files: through its own root
        self.stat_path = f"{proc}/{pid}/stat"
        self._raw = ""  # the maps text as last read
        self._text = ""  # its code lines
        self._seen: dict[tuple[int, int, int, str], Mapping] = {}
        self.mappings: tuple[Mapping, ...] = ()  # every code mapping ever seen, newest first
        self.current: tuple[Mapping, ...] = ()  # the code mappings at the last refresh
        # Where the main thread's stack reads must stop: just above argc, where exec left the stack pointer.
        # Its frames lie below, in pages the process has used; above argc's page the kernel's random gap may
        # never have been touched, and a read from the BPF side cannot fault it in. 0: unknown.
        self.stack_end = 0
        self.reads = 0  # of the maps text (refresh)
        self.version = 0  # moves whenever `current` changes, whoever read the maps (a stale publication's test)
        # A container's files are opened through /proc/PID/root, which goes with the process, while its profile is
        # still to be symbolized and written: its root is held open (a mount detached with its namespace stays
        # readable through it), and its files named through that descriptor once it has ended (hold_files).
        self._root = self.view.root_prefix()  # "" unless foreign
        self._held: str | None = None
        if self._root:
            try:
                fd = os.open(self._root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                pass
            else:
                self._held = f"/proc/self/fd/{fd}"
                weakref.finalize(self, os.close, fd)

    def hold_files_if_gone(self) -> None:
        """hold_files, when the process's root no longer opens (it has ended): before its stacks are symbolized."""
        if self._held is not None and not os.path.exists(self._root + "/"):
            self.hold_files()

    def hold_files(self) -> None:
        """The process has ended (or is let go): its files are named through its root held open from now on."""
        held, root = self._held, self._root
        if held is None:
            return
        self._held = None  # once

        def moved(m: Mapping) -> Mapping:
            return replace(m, path=held + m.path[len(root) :]) if m.path.startswith(root + "/") else m

        self._seen = {key: moved(m) for key, m in self._seen.items()}
        self.mappings = tuple(moved(m) for m in self.mappings)
        self.current = tuple(moved(m) for m in self.current)

    def refresh(self) -> bool:
        """Read the maps again; True when new code was mapped."""
        try:
            with open(self.path) as f:
                raw = f.read()
        except OSError:  # the target is gone: keep what was recorded
            return False
        self.reads += 1
        if raw == self._raw:  # a served process's maps, most looks: one comparison
            return False
        self._raw = raw
        text = code_lines(raw)  # data and anonymous memory mapped per request: no news for the symbolizer
        if text == self._text:
            return False
        self._text = text
        fresh = False
        self.current = tuple(self.view.mapping(m) for m in parse_maps(text))
        self.version += 1
        try:
            with open(self.stat_path) as f:
                start_stack = parse_start_stack(f.read())
        except OSError:
            start_stack = None
        self.stack_end = start_stack + 8 if start_stack else 0
        for m in self.current:
            key = (m.start, m.end, m.offset, m.path)
            if key not in self._seen:
                self._seen[key] = m
                fresh = True
        if fresh or len(self.current) != len(self._seen):
            fresh = True
            # Newest first, so that an address range reused by a later mapping finds the later one.
            self.mappings = tuple(reversed(self._seen.values()))
        return fresh
