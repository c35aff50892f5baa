"""Separate debug files: where an object's DWARF lives when the object itself was stripped."""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Sequence

from agent.symbols.elf import ElfError, ElfObject, open_elf


def _crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


DEFAULT_DEBUG_ROOTS = ("/usr/lib/debug",)


PROCESS_ROOT = re.compile(r"^/proc/\d+/root(?=/)")


def find_debug_file(obj: ElfObject, debug_roots: Sequence[str]) -> ElfObject | None:
    """The separate debug file of an object: by build-id under each root's .build-id/, else by
    .gnu_debuglink next to the object, in its .debug/ folder, or under each root plus the object's folder.
    An object read through a process's root (a container's) is looked for inside that root first, then on the
    host by build id (a debug file found by its name alone must match the object's build id or CRC)."""
    inside = PROCESS_ROOT.match(obj.path)
    if inside is not None:
        debug_roots = [inside.group(0) + r for r in debug_roots] + list(debug_roots)
    if obj.build_id and len(obj.build_id) > 2:
        for root in debug_roots:
            cand = os.path.join(root, ".build-id", obj.build_id[:2], obj.build_id[2:] + ".debug")
            dbg = _try_open(cand)
            if dbg is not None and dbg.build_id == obj.build_id and dbg.has_dwarf:
                return dbg
    if obj.debuglink is not None:
        name, crc = obj.debuglink
        # realpath would follow /proc/PID/root out of the container: its folder is taken as the process sees it
        folder = os.path.dirname(obj.path if inside is not None else os.path.realpath(obj.path))
        cands = [os.path.join(folder, name), os.path.join(folder, ".debug", name)]
        own = os.path.dirname(obj.path[inside.end():]) if inside is not None else folder  # as the process names it
        cands += [os.path.join(root, own.lstrip("/"), name) for root in debug_roots]
        for cand in cands:
            if os.path.realpath(cand) == os.path.realpath(obj.path):
                continue
            dbg = _try_open(cand)
            if dbg is None or not dbg.has_dwarf:
                continue
            if obj.build_id and dbg.build_id:
                if dbg.build_id == obj.build_id:
                    return dbg
            elif _crc32_of(cand) == crc:
                return dbg
    return None


def _try_open(path: str) -> ElfObject | None:
    if not os.path.isfile(path):
        return None
    try:
        return open_elf(path)
    except ElfError:
        return None

