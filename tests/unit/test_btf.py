"""agent.kernel.btf: member offsets from a BTF blob, anonymous members searched through, and clear errors."""

from __future__ import annotations

import struct

import pytest

from agent.kernel.btf import Btf, BtfError


def blob() -> bytes:
    """BTF of: int; struct inner {long a; long total_vm;} anonymous; struct mm_struct {int x; <anonymous inner at
    byte 8>; const <anonymous inner> second;} and a typedef, in the kernel's encoding."""
    strings = b"\0int\0mm_struct\0x\0a\0total_vm\0second\0long\0"
    off = {name: strings.index(b"\0" + name.encode() + b"\0") + 1 for name in
           ("int", "mm_struct", "x", "a", "total_vm", "second", "long")}

    def btf_type(name: int, kind: int, vlen: int, size_or_type: int, kind_flag: int = 0) -> bytes:
        return struct.pack("<III", name, kind_flag << 31 | kind << 24 | vlen, size_or_type)

    types = b"".join([
        btf_type(off["int"], 1, 0, 4) + struct.pack("<I", 32),  # [1] int
        btf_type(off["long"], 1, 0, 8) + struct.pack("<I", 64),  # [2] long
        btf_type(0, 4, 2, 16) + struct.pack("<III", off["a"], 2, 0) + struct.pack("<III", off["total_vm"], 2, 64),
        btf_type(0, 10, 0, 3),  # [4] const struct (anonymous)
        btf_type(off["mm_struct"], 4, 3, 40, kind_flag=1)  # [5] bitfield encoding of offsets
        + struct.pack("<III", off["x"], 1, 0)
        + struct.pack("<III", 0, 3, 64)
        + struct.pack("<III", off["second"], 4, 192),
    ])
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    return header + types + strings


def test_member_offsets_through_anonymous_members() -> None:
    btf = Btf(blob())
    assert btf.offset("mm_struct", "x") == 0
    assert btf.offset("mm_struct", "total_vm") == 8 + 8  # the anonymous struct at 8, total_vm at 8 in it
    assert btf.offset("mm_struct", "second") == 24


def test_missing_struct_member_and_bad_magic_are_clear_errors() -> None:
    btf = Btf(blob())
    with pytest.raises(BtfError, match="no struct task_struct"):
        btf.offset("task_struct", "mm")
    with pytest.raises(BtfError, match="no member hiwater_vm in struct mm_struct"):
        btf.offset("mm_struct", "hiwater_vm")
    with pytest.raises(BtfError, match="not BTF"):
        Btf(b"\0" * 64)
    with pytest.raises(BtfError, match="too short"):
        Btf(b"")
