"""Sampled mode's page events go through a small ring (agent.kernel.abi.SAMPLED_PAGE_RING_BYTES), which
the kernel holds for every target: a burst of page syscalls after a quiet spell, ten times what the ring holds,
must still reach the page map whole. The ring half full wakes the profile's loop (probes/heap.bpf.c page_exit,
HS_EV_PAGES), which otherwise looks at a quiet target only once a second; the daemon reads the ring's data
through one mapping, so records that wrap are read in two pieces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent.kernel.abi import SAMPLED_PAGE_RING_BYTES
from tests.support.harness import Completed

pytestmark = pytest.mark.integration

PAIRS = 30_000
RECORD = 88 + 8  # struct hs_page_event (80 bytes, rounded to 8) and its ring header, at most


def test_page_burst_after_quiet_spell_loses_nothing(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    assert 2 * PAIRS > 10 * SAMPLED_PAGE_RING_BYTES // RECORD  # the burst is ten rings' worth and more
    program = build("page_burst.c")
    done = run_heapscope(program, args=(str(PAIRS),), options=("--mode=sampled",))
    assert done.returncode == 0, done.stderr
    kernel = done.summary["pages"]["kernel"]
    assert kernel["lost"] == 0 and kernel["calls_full"] == 0, (kernel, done.stderr)
    assert kernel["events"] >= 2 * PAIRS, kernel
    assert "pages: NOT COUNTED" not in done.stderr
