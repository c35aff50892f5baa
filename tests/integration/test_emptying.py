"""Emptying a target's maps for the next target of its slot (agent/kernel/emptying.py), each kind of map on real
kernel maps: a hash map of more entries than one batch holds, an mmapable array as far as asked, a per-CPU array
on every CPU, and a ring buffer whose unread records are skipped while the records after are read."""

from __future__ import annotations

import ctypes
import os
import struct

import pytest

from agent.kernel.emptying import empty_map, map_info
from agent.kernel.loader import compile_program, unload
from agent.kernel.rings import RingReader

pytestmark = pytest.mark.integration

SOURCE = """
struct blob { u64 word[128]; };
BPF_HASH(big, u32, struct blob, 4096);
BPF_PERCPU_ARRAY(per_cpu, u64, 16);
BPF_F_TABLE("array", int, u64, mapped, 4096, BPF_F_MMAPABLE);
BPF_RINGBUF_OUTPUT(ring, 4);

TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
    if (bpf_get_current_pid_tgid() >> 32 != TARGET)
        return 0;
    int zero = 0;
    u64 *n = per_cpu.lookup(&zero);
    if (n)
        *n += 1;
    u64 seen = n ? *n : 0;
    ring.ringbuf_output(&seen, sizeof(seen), 0);
    return 0;
}
"""
RECORD = struct.Struct("<Q")


def test_each_kind_of_map_is_left_as_a_new_one(bpf_ready: None) -> None:
    bpf = compile_program("test program", text=SOURCE.encode(), cflags=[f"-DTARGET={os.getpid()}"])
    try:
        big, per_cpu, mapped = bpf["big"], bpf["per_cpu"], bpf["mapped"]
        blob = big.Leaf()
        blob.word[0] = 7
        for key in range(1000):  # 1 KiB values: four batches of emptying
            big[big.Key(key)] = blob
        for row in (0, 99, 100, 4095):
            mapped[ctypes.c_int(row)] = ctypes.c_uint64(row + 1)
        ring_size = map_info(bpf["ring"].map_fd).max_entries
        reader = RingReader(bpf["ring"].map_fd, ring_size, RECORD)
        try:
            for _ in range(5):
                os.getppid()
            assert len(big) == 1000
            assert sum(per_cpu[ctypes.c_int(0)]) == 5

            empty_map(big.map_fd, map_info(big.map_fd))
            empty_map(per_cpu.map_fd, map_info(per_cpu.map_fd))
            empty_map(mapped.map_fd, map_info(mapped.map_fd), rows=100)
            empty_map(bpf["ring"].map_fd, map_info(bpf["ring"].map_fd))

            assert len(big) == 0
            assert list(per_cpu[ctypes.c_int(0)]) == [0] * len(per_cpu[ctypes.c_int(0)])
            assert [mapped[ctypes.c_int(row)].value for row in (0, 99, 100, 4095)] == [0, 0, 101, 4096]
            assert reader.drain() == [], "records of the last target were left to read"
            os.getppid()
            assert reader.drain() == [(1,)], "the next record was not read after the skipped ones"
            empty_map(mapped.map_fd, map_info(mapped.map_fd))  # all rows
            assert [mapped[ctypes.c_int(row)].value for row in (100, 4095)] == [0, 0]
        finally:
            reader.close()
    finally:
        unload(bpf)
