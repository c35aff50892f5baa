"""The extra-heap model of aligned blocks (agent/model/options.py massif_slop) against real Massif.

A program interleaves ordinary blocks of varied sizes with aligned ones, so that Valgrind's arena places the
aligned blocks at varied addresses. Each block's slop in Massif (from the change of mem_heap_extra_B between
consecutive snapshots) must lie within slop_uncertainty of the model, on the model's 16-byte grid, and the whole
range must be used (the uncertainty is not a loose bound). One more case shows here: the fragment an aligned
block leaves in front of it goes back to Valgrind's free lists, and a later block given such a free block one
16-byte granule larger than it needs (the rest too small to split off) has 16 bytes more slop, whatever its
alignment (REUSE_GRANULE).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.model.options import MassifOptions, massif_slop, slop_uncertainty, valgrind_alignment
from tests.support.valgrind import run_massif

ALIGNMENTS = (24, 32, 64, 128, 256, 1024)
REUSE_GRANULE = 16
ROUNDS = 24

PROGRAM = r"""
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>
static const unsigned long aligns[] = { %s };
void *keep[4096];
int main(void)
{
    int n = 0;
    for (unsigned a = 0; a < sizeof aligns / sizeof aligns[0]; a++)
        for (int k = 0; k < %d; k++) {
            keep[n++] = malloc(16 * (k %% 7) + 8);
            keep[n++] = memalign(aligns[a], 1000 + 7 * k);
        }
    return 0;
}
"""


def test_valgrind_alignment() -> None:
    assert [valgrind_alignment(a) for a in (1, 8, 16, 17, 24, 48, 64, 4096)] == [16, 16, 16, 32, 32, 64, 64, 4096]


@pytest.mark.needs("valgrind", "gcc")
def test_aligned_slop_within_the_uncertainty_of_massif(tmp_path: Path) -> None:
    out = run_massif(
        tmp_path,
        PROGRAM % (", ".join(map(str, ALIGNMENTS)), ROUNDS),
        "--time-unit=B",
        "--max-snapshots=1000",
        "--detailed-freq=1000",
    )
    text = out.read_text()
    heap = [int(x) for x in re.findall(r"mem_heap_B=(\d+)", text)]
    extra = [int(x) for x in re.findall(r"mem_heap_extra_B=(\d+)", text)]
    assert len(heap) == 1 + 2 * len(ALIGNMENTS) * ROUNDS, "one snapshot per allocation expected"
    admin = MassifOptions().heap_admin
    steps = [(heap[i] - heap[i - 1], extra[i] - extra[i - 1] - admin) for i in range(1, len(heap))]
    for a_index, asked in enumerate(ALIGNMENTS):
        align = valgrind_alignment(asked)
        offsets = set()
        for k in range(ROUNDS):
            plain_size, plain_slop = steps[2 * (a_index * ROUNDS + k)]
            assert plain_slop - massif_slop(plain_size, 16) in (0, REUSE_GRANULE)
            size, slop = steps[2 * (a_index * ROUNDS + k) + 1]
            model = massif_slop(size, align)
            u = slop_uncertainty(align)
            assert -u <= slop - model <= u + REUSE_GRANULE, (asked, size, slop, model)
            assert (slop - massif_slop(size, 16)) % 16 == 0
            offsets.add(slop - model)
        # Both ends of the range are reached where the rounds can cover it (A / 16 positions): the bound is the
        # arena's, not a guess.
        if align // 16 <= ROUNDS // 3:
            assert min(offsets) == -u and max(offsets) >= u, (asked, sorted(offsets))


def test_extra_bytes_of_an_aligned_request() -> None:
    opts = MassifOptions()
    assert opts.extra_bytes(3000, 64) == massif_slop(3000, 64) + opts.heap_admin
    assert opts.extra_bytes(3000) == opts.extra_bytes(3000, 8) == massif_slop(3000, 16) + opts.heap_admin
    with pytest.raises(TypeError):
        opts.extra_bytes()  # type: ignore[call-arg]
