"""Extra bytes of large blocks (agent/model/options.py massif_slop, probes/heap.bpf.c its twin) against real Massif.

Valgrind's client arena carves blocks out of 4 MiB superblocks; a request that does not fit one, with the 64 bytes
of headers, gets a superblock of its own, whole pages, unsplit: the block's slop runs to the page end. The rule
depends on nothing but the size, so the model is exact there: every block of 100 KB to 100 MB, and the sizes at
the edges, has Massif's slop to the byte.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from agent.model.options import LARGEST_SPLIT_BLOCK, MassifOptions, massif_slop
from tests.support.valgrind import run_massif

# Measured under Valgrind 3.19's Massif, one block per run (2026-11-26): request -> slop (extra - 8 admin bytes).
MEASURED = {
    100_000: 0,
    1_048_576: 0,
    1_048_577: 15,
    4_194_100: 12,
    4_194_208: 0,
    4_194_209: 31,  # fills a fresh 4 MiB superblock but for 16 bytes, which it gets too
    4_194_224: 16,
    4_194_230: 10,
    4_194_240: 0,  # LARGEST_SPLIT_BLOCK: still fits
    4_194_241: 4095,  # a superblock of its own
    4_194_304: 4032,
    4_198_336: 0,
    10_000_000: 2368,
    10_485_760: 4032,  # 10 MiB: the 4,040 extra bytes, admin included
    50_000_000: 3904,
    100_000_000: 3776,
}


def test_measured_slops() -> None:
    assert {size: massif_slop(size, 16) for size in MEASURED} == MEASURED
    assert MassifOptions().extra_bytes(10 << 20) == 4040


def test_aligned_blocks_keep_their_model() -> None:
    # memalign's blocks come from superblocks that are split, whatever their size (m_mallocfree.c).
    assert massif_slop(10_000_000, 64) == (64 + 16) // 2
    assert massif_slop(LARGEST_SPLIT_BLOCK + 1, 64) == 15 + (64 + 16) // 2


def _sizes() -> list[int]:
    rnd = random.Random(27)
    edges = [LARGEST_SPLIT_BLOCK - 31, LARGEST_SPLIT_BLOCK - 16, LARGEST_SPLIT_BLOCK, LARGEST_SPLIT_BLOCK + 1]
    return edges + [rnd.randint(100_000, 100_000_000) for _ in range(40)]


PROGRAM = r"""
#include <stdlib.h>
static const unsigned long sizes[] = { %s };
void *keep[sizeof sizes / sizeof sizes[0]];
int main(void)
{
    for (unsigned i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        keep[i] = malloc(sizes[i]); /* never touched: Valgrind maps the pages, the machine holds none */
    return 0;
}
"""


@pytest.mark.needs("valgrind", "gcc")
def test_large_slop_is_massifs(tmp_path: Path) -> None:
    sizes = _sizes()
    out = run_massif(
        tmp_path, PROGRAM % ", ".join(map(str, sizes)), "--time-unit=B", "--max-snapshots=1000", "--detailed-freq=1000"
    )
    text = out.read_text()
    heap = [int(x) for x in re.findall(r"mem_heap_B=(\d+)", text)]
    extra = [int(x) for x in re.findall(r"mem_heap_extra_B=(\d+)", text)]
    assert len(heap) == 1 + len(sizes), "one snapshot per allocation expected"
    admin = MassifOptions().heap_admin
    got = [(heap[i] - heap[i - 1], extra[i] - extra[i - 1] - admin) for i in range(1, len(heap))]
    assert got == [(size, massif_slop(size, 16)) for size in sizes]
