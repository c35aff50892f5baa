"""The target's file mappings, recorded while it lives so that it can be symbolized after it exits."""

from __future__ import annotations

from agent.model.maps import Mapping, parse_maps
from agent.model.pages import parse_start_stack
from agent.process.view import ProcessView


class MapsRecorder:
    """The target's file mappings, recorded while it lives so that it can be symbolized after it exits."""

    def __init__(self, pid: int, proc: str = "/proc") -> None:
        self.path = f"{proc}/{pid}/maps"
        self.view = ProcessView.of(pid, proc)  # a container's or a chroot's files: through its own root
        self.stat_path = f"{proc}/{pid}/stat"
        self._text = ""
        self._seen: dict[tuple[int, int, int, str], Mapping] = {}
        self.mappings: tuple[Mapping, ...] = ()  # every mapping ever seen, newest first
        self.current: tuple[Mapping, ...] = ()  # the mappings at the last refresh
        # Where the main thread's stack reads must stop: just above argc, where exec left the stack pointer.
        # Its frames lie below, in pages the process has used; above argc's page the kernel's random gap may
        # never have been touched, and a read from the BPF side cannot fault it in. 0: unknown.
        self.stack_end = 0

    def refresh(self) -> bool:
        """Read the maps again; True when something new was mapped."""
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError:  # the target is gone: keep what was recorded
            return False
        if text == self._text:
            return False
        self._text = text
        fresh = False
        self.current = tuple(self.view.mapping(m) for m in parse_maps(text))
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
