"""What each target holds in the kernel: the tables sized from the mode (agent.kernel.interface.table_sizes), the
mode's default capacity, and the ring reader that maps a ring's data once (pure logic; the ring is a memfd laid
out as the kernel lays out a BPF ring buffer)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import replace

from agent.kernel import abi
from agent.kernel.interface import ProbeSettings, block_slots, table_sizes
from agent.kernel.rings import RingReader
from agent.model.options import MassifOptions
from agent.model.sampling import DEFAULT_CAPACITY, ProfileMode
from agent.session.pipeline import ProfileSettings

PAGE = mmap.PAGESIZE


def _settings(mode: str, **kw: object) -> ProbeSettings:
    s = ProfileSettings(opts=MassifOptions(), mode=ProfileMode(mode), malt=True)  # type: ignore[arg-type]
    return replace(s, **kw).probe_settings(1234, launched=False)  # type: ignore[arg-type]


def test_exact_mode_keeps_its_tables() -> None:
    s = _settings("exact")
    sizes = table_sizes(s)
    assert (s.max_blocks, s.max_stacks) == DEFAULT_CAPACITY["exact"] == (1 << 20, 1 << 16)
    assert sizes["HS_BLOCK_SLOTS"] == block_slots(s.max_blocks) == s.max_blocks
    assert sizes["HS_MAX_BLOCKS"] == s.max_blocks // 2
    assert sizes["HS_PENDING_SLOTS"] == abi.PENDING_SLOTS
    assert sizes["HS_MAX_STACKS"] == s.max_stacks
    assert sizes["HS_MAX_SIZES"] == sizes["HS_MAX_JUMPS"] == abi.MAX_SIZES
    assert sizes["HS_MAX_PENDING"] == abi.MAX_THREADS
    assert sizes["HS_PAGE_RING_PAGES"] * PAGE == abi.PAGE_RING_BYTES == s.page_ring_bytes


def test_sampled_mode_drops_the_exact_tables_and_sizes_its_own() -> None:
    s = _settings("sampled")
    sizes = table_sizes(s)
    assert (s.max_blocks, s.max_stacks) == DEFAULT_CAPACITY["sampled"]
    assert sizes["HS_BLOCK_SLOTS"] == 2 and sizes["HS_MAX_BLOCKS"] == 16  # no program of the mode uses them
    assert sizes["HS_PENDING_SLOTS"] == 1 and sizes["HS_MAX_PENDING"] == 16
    assert sizes["HS_MAX_SIZES"] == abi.SAMPLED_MAX_SIZES < abi.MAX_SIZES
    assert sizes["HS_MAX_JUMPS"] == 1  # sampled calls never reach them
    assert sizes["HS_MAX_SAMPLED_BLOCKS"] == s.max_blocks
    assert sizes["HS_MAX_STACKS"] == s.max_stacks
    assert sizes["HS_PAGE_RING_PAGES"] * PAGE == abi.SAMPLED_PAGE_RING_BYTES < abi.PAGE_RING_BYTES
    # The options still decide when given.
    raised = table_sizes(_settings("sampled", max_blocks=1 << 20, max_stacks=1 << 16))
    assert raised["HS_MAX_SAMPLED_BLOCKS"] == 1 << 20 and raised["HS_MAX_STACKS"] == 1 << 16
    assert raised["HS_BLOCK_SLOTS"] == 2


def test_malt_tables_only_with_malt() -> None:
    for mode in ("exact", "sampled"):
        sizes = table_sizes(_settings(mode, malt=False))
        assert sizes["HS_MAX_SIZES"] == sizes["HS_MAX_JUMPS"] == 1


def _ring(size: int) -> tuple[int, mmap.mmap]:
    """A memfd laid out as a BPF ring buffer's mapping: the consumer page, the producer page, the data."""
    fd = os.memfd_create("ring")
    os.ftruncate(fd, 2 * PAGE + size)
    return fd, mmap.mmap(fd, 2 * PAGE + size)


def test_ring_records_read_across_the_wrap() -> None:
    size = PAGE
    record = struct.Struct("<5Q")  # 40 bytes: with its 8-byte header, records straddle the end of the data
    fd, view = _ring(size)
    try:
        reader = RingReader(fd, size, record)
        data_at = 2 * PAGE
        written, pos, got = [], 0, []
        for n in range(300):  # several laps of the ring, drained every 7 records
            values = tuple(range(n * 5, n * 5 + 5))
            body = record.pack(*values)
            struct.pack_into("<II", view, data_at + pos % size, record.size, 0)
            for i, byte in enumerate(body):  # the kernel writes through its double mapping: wrap by hand here
                view[data_at + (pos + 8 + i) % size] = byte
            pos += 8 + record.size
            struct.pack_into("<Q", view, PAGE, pos)  # the producer position
            written.append(values)
            if n % 7 == 6:
                got += reader.drain()
                assert struct.unpack_from("<Q", view, 0)[0] == pos  # the consumer moved on
        got += reader.drain()
        assert got == written and reader.taken == len(written)
        assert any((p * 48 + 8) % size + record.size > size for p in range(300))  # some did wrap
        reader.close()
    finally:
        view.close()
        os.close(fd)
