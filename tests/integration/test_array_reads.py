"""Reading an array map in bulk (agent/kernel/arrays.py mapped_prefix): an mmapable array is copied from a mapping
of it, and what comes back is what the kernel's batch lookup gives, value for value; an array that cannot be mapped
is read by the batch lookup. A real map, loaded by bcc."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from agent.kernel.arrays import mapped_prefix
from agent.kernel.loader import load_bcc

pytestmark = pytest.mark.integration

SOURCE = """
struct slot { u64 tid, count, bytes, ns; };
BPF_F_TABLE("array", int, struct slot, mapped, 3000, BPF_F_MMAPABLE);
BPF_ARRAY(unmapped, u64, 100);
"""


def batch(table: Any, count: int) -> bytes:
    keys = (table.Key * count)()
    values = (table.Leaf * count)()
    n = ctypes.c_uint32(count)
    lib = load_bcc().libbcc.lib
    rc = lib.bpf_lookup_batch(table.map_fd, None, ctypes.byref(ctypes.c_uint32()), keys, values, ctypes.byref(n))
    assert rc == 0 and n.value == count
    return bytes(memoryview(values))


def test_a_mapped_read_equals_the_batch_lookup() -> None:
    bpf = load_bcc().BPF(text=SOURCE)
    try:
        table = bpf["mapped"]
        for i in range(0, 3000, 7):  # values past the first page, none at a page's edge alone
            table[ctypes.c_int(i)] = table.Leaf(i + 1, 2 * i, 3 * i + 5, 1 << 40 | i)
        for count in (1, 127, 128, 129, 3000):  # 32-byte values: 128 a page
            got = mapped_prefix(table, count)
            assert got is not None and len(got) == count * 32
            assert got == batch(table, count)
        assert got[7 * 32 : 7 * 32 + 8] == (8).to_bytes(8, "little")  # entry 7's tid, as written
        assert mapped_prefix(table, 3001) is None  # past the end: the caller's batch says how far it got
        plain = bpf["unmapped"]
        plain[ctypes.c_int(3)] = ctypes.c_uint64(9)
        assert mapped_prefix(plain, 100) is None  # not mmapable: read by the batch lookup instead
    finally:
        bpf.cleanup()
