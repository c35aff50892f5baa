"""sampler_sites.c under the in-process sampler: the bytes each site is expected to hold, the rate that gives each
big site enough samples, a run of it armed (run_sites), and the judgement of what the sampler saw against the
program's own record of its blocks (check_sites)."""

from __future__ import annotations

import collections
import os
import struct
from collections.abc import Callable
from pathlib import Path

from agent.model.sampling import sample_probability, weight_hint
from agent.process.sampler import SamplerControl, read_map_lines
from tests.support.conversation import Conversation
from tests.support.sampler_probes import sample_trace
from tests.support.target_memory import got_slot, libc_function, read_word

Z = 4.0  # standard errors


def site_rate(log_bytes: dict[int, int], min_samples: int) -> int:
    """The largest power-of-two rate that gives every site holding >= 10% of the heap `min_samples`
    expected samples (its blocks are small beside the rate, so about bytes / rate samples)."""
    total = sum(log_bytes.values())
    smallest = min(b for b in log_bytes.values() if b >= total / 10)
    rate = 1
    while smallest / (rate * 2) >= min_samples:
        rate *= 2
    return rate


# The sites program's expected bytes per site (from its generator's shares: 80% of calls of 16..127 bytes,
# 1.5% of 2048..8191, 0.2% of 16384..32767, 18.3% calloc of 24..223) for 400,000 calls.
EXPECTED_SITE_BYTES = {
    0: 400_000 * 0.800 * (16 + 127) / 2,
    1: 400_000 * 0.015 * (2048 + 8191) / 2,
    2: 400_000 * 0.002 * (16384 + 32767) / 2,
    3: 400_000 * 0.183 * (24 + 223) / 2,
}


def run_sites(
    program: Path, lib: Path, tmp_path: Path, control: Callable[[int], SamplerControl], load_itself: bool = True
) -> dict:
    """Run the sites program armed at a rate giving each big site >= 1600 expected samples (so that 10% is
    4 standard errors: the issue asks for >= 400), free site 0, disarm; returns what was seen. With
    load_itself the program dlopens the sampler; else `control` must bring it in."""
    rate = site_rate({k: int(v) for k, v in EXPECTED_SITE_BYTES.items()}, 1600)
    log = tmp_path / "blocks.bin"
    conv = Conversation([str(program), str(log)] + ([str(lib)] if load_itself else []))
    seen: dict = {"rate": rate, "pid": conv.pid}
    try:
        conv.expect("ready")
        ctl = control(conv.pid)
        malloc_slot = got_slot(conv.pid, program, "malloc")
        libc_malloc = libc_function(conv.pid, "malloc")
        lib_maps = [m for m in read_map_lines(conv.pid) if m.inode == os.stat(lib).st_ino]
        lib_lo, lib_hi = min(m.start for m in lib_maps), max(m.end for m in lib_maps)
        with sample_trace(lib) as read:
            armed = ctl.arm(rate)
            seen["armed"] = armed
            seen["slot_armed"] = read_word(conv.pid, malloc_slot)
            seen["counts_armed"] = ctl.counts()
            conv.say("go")
            conv.expect("allocated")
            seen["counts_allocated"] = ctl.counts()
            conv.say("free")
            conv.expect("freed")
            seen["counts_freed"] = ctl.counts()
            seen["samples"] = read()
            disarmed = ctl.disarm()
            seen["disarmed"] = disarmed
            seen["slot_disarmed"] = read_word(conv.pid, malloc_slot)
            seen["samples_after"] = read()
        seen.update(libc_malloc=libc_malloc, lib_range=(lib_lo, lib_hi))
        conv.say("exit")
        assert conv.finish() == 0
    finally:
        conv.kill()
    blocks = {}
    truth: collections.Counter[int] = collections.Counter()
    for ptr, site, size in struct.iter_unpack("<QII", log.read_bytes()):
        blocks[ptr] = (site, size)
        truth[site] += size
    seen["blocks"], seen["truth"] = blocks, truth
    return seen


def check_sites(seen: dict) -> None:
    rate, blocks, truth = seen["rate"], seen["blocks"], seen["truth"]
    samples = seen["samples"]
    assert samples.lost == 0
    estimate: collections.Counter[int] = collections.Counter()
    count: collections.Counter[int] = collections.Counter()
    for ptr, size, weight in samples.allocs:
        if ptr not in blocks:
            continue  # the program's own stdio buffers and thread stacks' TLS blocks
        site, true_size = blocks[ptr]
        assert size == true_size  # the sampler reports the requested size
        assert weight == weight_hint(size, rate) or abs(weight - weight_hint(size, rate)) <= 1
        estimate[site] += weight
        count[site] += 1
    total = sum(truth.values())
    for site, true_bytes in truth.items():
        if true_bytes < total / 10:
            continue
        assert count[site] >= 400, (site, count[site])
        assert abs(estimate[site] / true_bytes - 1) <= 0.10, (site, estimate[site], true_bytes, count[site])
    # Always-sampled blocks (>= rate) are all there, at their size.
    big = [p for p, (_, s) in blocks.items() if s >= rate]
    sampled = {p for p, _, _ in samples.allocs}
    assert big and all(p in sampled for p in big)
    # Frees: exactly the sampled blocks of site 0 (the program frees all of site 0), each once.
    site0_sampled = {p for p, _, _ in samples.allocs if blocks.get(p, (None,))[0] == 0}
    freed_known = [p for p in samples.frees if p in blocks]
    assert sorted(freed_known) == sorted(site0_sampled)
    # Unsampled blocks never reach a probe: samples are about bytes/rate, not one per call.
    expected = sum(sample_probability(s, rate) for _, s in blocks.values())
    known = sum(1 for p, _, _ in samples.allocs if p in blocks)
    assert abs(known - expected) <= Z * expected**0.5
    # Exact counts: the free phase frees exactly the site-0 blocks and allocates nothing; the allocation phase
    # makes at least the logged calls and bytes.
    before, allocated, freed = seen["counts_armed"], seen["counts_allocated"], seen["counts_freed"]
    site0_blocks = sum(1 for site, _ in blocks.values() if site == 0)
    assert freed["frees"] - allocated["frees"] == site0_blocks
    assert freed["allocs"] == allocated["allocs"]
    assert allocated["allocs"] - before["allocs"] >= len(blocks)
    assert allocated["alloc_bytes"] - before["alloc_bytes"] >= sum(truth.values())
    # The executable's malloc slot went to the hook while armed and back to libc's malloc after.
    lo, hi = seen["lib_range"]
    assert lo <= seen["slot_armed"] < hi
    assert seen["slot_disarmed"] == seen["libc_malloc"]
    assert seen["disarmed"]["slots_patched"] == 0
    assert seen["disarmed"].disarm_reason == "requested"
    # Nothing is sampled once disarmed.
    assert len(seen["samples_after"].allocs) == len(samples.allocs)
