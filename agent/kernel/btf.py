"""Field offsets of the running kernel's structures, from its BTF (/sys/kernel/btf/vmlinux).

The probes are compiled against the kernel headers Debian packages, which need not be the running kernel's
(this layout of `task_struct` or `mm_struct` moves from one release to the next); a probe that reads a kernel
structure takes the offset from here instead, as a `-D` constant. Only the type section is read: struct and union
members by name, anonymous members searched through (mm_struct keeps its fields in an anonymous struct).
"""

from __future__ import annotations

import struct
from functools import cache
from pathlib import Path

from agent.errors import EnvironmentProblem

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
BTF_MAGIC = 0xEB9F

# BTF_KIND_* (include/uapi/linux/btf.h) -> bytes that follow `struct btf_type` per vlen unit, and fixed bytes.
_STRUCT, _UNION = 4, 5
_PER_MEMBER = {3: 0, 4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}
_MODIFIERS = {8, 9, 10, 11, 18}  # typedef, volatile, const, restrict, type tag: see through to their type


class BtfError(EnvironmentProblem):
    """No BTF, or no such structure or member in it."""


class Btf:
    """The types of one BTF blob, indexed by id (1-based, as BTF numbers them)."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BtfError("BTF too short")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != BTF_MAGIC:
            raise BtfError("not BTF (no 0xeb9f magic, or not little-endian)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        self._blob = blob
        self._strings = blob[hdr_len + str_off : hdr_len + str_off + str_len]
        # One pass that only steps over the types (their position by id); members are read when asked for.
        self._pos: list[int] = [0]  # id 0: void
        self._by_name: dict[str, int] = {}
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        unpack = struct.unpack_from
        while pos < end:
            self._pos.append(pos)
            name_off, info = unpack("<II", blob, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if kind == _STRUCT and name_off:
                self._by_name.setdefault(self._string(name_off), len(self._pos) - 1)
            pos += 12 + _PER_MEMBER.get(kind, 0) * vlen + _FIXED.get(kind, 0)

    def _type(self, type_id: int) -> tuple[int, int, list[tuple[str, int, int]]]:
        """(kind, size or type, members) of a type; members (name, type, bit offset) of a struct or union."""
        pos = self._pos[type_id]
        _name_off, info, size_or_type = struct.unpack_from("<III", self._blob, pos)
        kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        members = []
        if kind in (_STRUCT, _UNION):
            for i in range(vlen):
                m_name, m_type, m_off = struct.unpack_from("<III", self._blob, pos + 12 + 12 * i)
                bits = m_off & 0xFFFFFF if kind_flag else m_off  # kind_flag: bitfield size in the top byte
                members.append((self._string(m_name), m_type, bits))
        return kind, size_or_type, members

    def _string(self, offset: int) -> str:
        end = self._strings.find(b"\0", offset)
        return self._strings[offset:end].decode("ascii", "replace")

    def _resolved(self, type_id: int) -> int:
        for _ in range(32):
            kind, target, _members = self._type(type_id)
            if kind not in _MODIFIERS:
                return type_id
            type_id = target
        return type_id

    def _find(self, type_id: int, member: str) -> int | None:
        """Bit offset of `member` in the struct or union `type_id`, looking into anonymous members."""
        for name, m_type, bits in self._type(type_id)[2]:
            if name == member:
                return bits
            inner = self._resolved(m_type)
            if not name and self._type(inner)[0] in (_STRUCT, _UNION):
                found = self._find(inner, member)
                if found is not None:
                    return bits + found
        return None

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of `member` in `struct struct_name`."""
        type_id = self._by_name.get(struct_name)
        if type_id is None:
            raise BtfError(f"the kernel's BTF has no struct {struct_name}")
        bits = self._find(type_id, member)
        if bits is None or bits % 8:
            raise BtfError(f"the kernel's BTF has no member {member} in struct {struct_name}")
        return bits // 8


@cache
def kernel_offset(struct_name: str, member: str) -> int:
    """Byte offset of a member of a structure of the running kernel."""
    try:
        blob = VMLINUX_BTF.read_bytes()
    except OSError as e:
        raise BtfError(f"cannot read the kernel's BTF ({VMLINUX_BTF}): {e.strerror}") from None
    return Btf(blob).offset(struct_name, member)
