"""A process's files as the process sees them: through its own root, whatever its mount namespace.

/proc/PID/maps names a file relative to the root of the mount namespace it lives in. For a container
(pivot_root into its image, as runtimes do) that is the container's root: the same path on the host is
another file, or none. For a chroot the maps show the host's path, while /proc/PID/root is the chroot
directory, so joining the two doubles the prefix. A process's file is therefore opened as
/proc/PID/root/<its path inside its root>; a process that shares our mount namespace and root keeps plain
paths, as before. What the outputs show stays the path as the process names it (Mapping.shown).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from agent.model.maps import Mapping


@dataclass(frozen=True)
class ProcessView:
    pid: int
    proc: str
    root: str  # where the process's root is, as readlink(/proc/PID/root) says ("/" unless chrooted)
    foreign: bool  # its paths are not ours: another mount namespace, or another root
    same_ns: bool = True  # its mount namespace is ours (a chroot's maps name files by our paths)
    namespace: str = ""  # its mount namespace ("mnt:[4026531841]"), "" for a gone process

    @classmethod
    def of(cls, pid: int, proc: str = "/proc") -> ProcessView:
        """The view of a live process (a gone one: plain paths, nothing to read anyway)."""
        try:
            root = os.readlink(f"{proc}/{pid}/root")
            theirs = os.readlink(f"{proc}/{pid}/ns/mnt")
            ours = os.readlink(f"{proc}/self/ns/mnt")
        except OSError:
            return cls(pid, proc, "/", False)
        return cls(pid, proc, root, theirs != ours or root != "/", theirs == ours, theirs)

    def inside(self, path: str) -> str:
        """`path` as the maps name it, made relative to the process's root (a chroot's prefix taken off)."""
        root = self.root.rstrip("/")
        if root and (path == root or path.startswith(root + "/")):
            return path[len(root) :] or "/"
        return path

    def file(self, path: str) -> str:
        """Where heapscope opens the file the process's maps name `path`."""
        if not self.foreign:
            return path
        return self.through(path)

    def through(self, path: str) -> str:
        """`path` through the process's root, except a file a chroot'ed process of our mount namespace mapped
        before it chrooted (haproxy's workers chroot into an empty directory): outside its root, its maps name it
        by our path, which is where it is."""
        inside = self.inside(path)
        if self.same_ns and self.root != "/" and inside == path:
            return path
        return f"{self.proc}/{self.pid}/root{inside}"

    def root_prefix(self) -> str:
        """What goes before a path inside the process's root to open it from here ("" when they are ours)."""
        return f"{self.proc}/{self.pid}/root" if self.foreign else ""

    def mapping(self, m: Mapping) -> Mapping:
        """`m` with its file opened through the process's root, still shown by the process's own name. A memfd
        (the sampler handed over in one) has no path anywhere, and a file mapped from outside the process's root
        and mount namespace none there: each is opened through /proc/PID/map_files."""
        by_mapping = f"{self.proc}/{self.pid}/map_files/{m.start:x}-{m.end:x}"
        if m.path.startswith("/memfd:"):
            return replace(m, path=by_mapping, shown=m.path)
        if not self.foreign:
            return m
        opened = self.file(m.path)
        if not os.path.exists(opened):  # mapped from outside its root (the sampler's folder, handed over)
            opened = by_mapping
        return replace(m, path=opened, shown=self.inside(m.path))
