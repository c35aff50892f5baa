"""Reading BPF ring buffers in place: the records the kernel submitted, unpacked, and their space freed."""

from __future__ import annotations

import mmap
import struct
from typing import Any


class RingReader:
    """A BPF ring buffer read in place, as libbpf does it, without a callback per record: the consumer position
    is a shared page we write, the producer position and the data (mapped twice, so a record never wraps)
    pages we read. x86 keeps loads in order, so reading the producer position before the records suffices.
    Both positions are read and written as one aligned 8-byte word (a native memoryview): struct's "<Q" packs
    byte by byte after zeroing the field, and a reservation that read the consumer position meanwhile saw 0 and
    found the ring full (a lost event in the kernel's counters)."""

    _BUSY = 1 << 31  # a record reserved and not yet submitted: stop there
    _DISCARD = 1 << 30
    _HEADER = struct.Struct("<II")  # length (with the two bits above), page offset

    def __init__(self, map_fd: int, size: int, record: struct.Struct) -> None:
        page = mmap.PAGESIZE
        self.size = size
        self.record = record
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # The data once, not twice as libbpf maps it: the kernel maps every page of a ring mapping at once, so
        # the second copy would be `size` more bytes of the daemon's RSS for every target. A record that wraps
        # is read in two pieces.
        self._producer = mmap.mmap(map_fd, page + size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = memoryview(self._producer)[page:]
        self._consumer_pos = memoryview(self._consumer).cast("Q")
        self._producer_pos = memoryview(self._producer)[:8].cast("Q")
        self.taken = 0  # records consumed so far

    def drain(self) -> list[tuple[Any, ...]]:
        """Every submitted record, unpacked, in order; frees their space for the kernel."""
        header, record, data = self._HEADER, self.record, self._data
        cons = self._consumer_pos[0]
        prod = self._producer_pos[0]
        mask = self.size - 1
        out = []
        while cons < prod:
            length, _ = header.unpack_from(data, cons & mask)
            if length & self._BUSY:
                break
            if not length & self._DISCARD:
                at = (cons & mask) + 8  # headers are 8-byte aligned: only a record's body can wrap
                if at + record.size <= self.size:
                    out.append(record.unpack_from(data, at))
                else:
                    out.append(record.unpack(bytes(data[at:]) + bytes(data[: at + record.size - self.size])))
            cons += ((length & ~(self._BUSY | self._DISCARD)) + 8 + 7) & ~7
            self.taken += 1
        self._consumer_pos[0] = cons
        return out

    def produced(self) -> int:
        """The producer position: it moves with every record the kernel reserves."""
        return int(self._producer_pos[0])

    def consumed(self) -> int:
        """The consumer position: how far drain() has read (it stops at a record not yet submitted)."""
        return int(self._consumer_pos[0])

    def close(self) -> None:
        self._data.release()
        self._consumer_pos.release()
        self._producer_pos.release()
        self._producer.close()
        self._consumer.close()
