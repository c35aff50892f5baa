"""modes_sites.c's known sites, for the tests that check sampled mode's estimates against the truth: the blocks
each site holds, the sampling rate that gives every big site enough samples, and the bytes per site of a tree."""

from __future__ import annotations

from agent.model.sampling import sample_probability

MIN_SAMPLES = 1600  # per big site: 10% is then about 4 standard errors (the issue asks for 400 at least)
SITES = ("site_small", "site_medium", "site_calloc", "site_large")
SCALE = 4  # the estimates' run: a rate of 4096 gives each big site 1,600 samples, all but site_large at random


def site_sizes(scale: int) -> dict[str, list[int]]:
    """modes_sites.c's blocks live at the end, per site, as its comment and loops say."""
    return {
        "site_small": [16 + (i % 7) * 16 for i in range(40000 * scale)],
        "site_medium": [1000 + (i % 500) for i in range(2500 * scale)],
        "site_calloc": [640] * (3000 * scale),
        "site_large": [262144] * (4 * scale),
    }


def sampling_rate(scale: int) -> int:
    """The largest power-of-two rate at which every site holding 10% or more of the heap, and sampled at
    random (blocks below the rate), expects MIN_SAMPLES samples."""
    sizes = site_sizes(scale)
    total = sum(sum(v) for v in sizes.values())
    rate = 1 << 20
    while rate > 1:
        expected = [
            sum(sample_probability(s, rate) for s in blocks)
            for blocks in sizes.values()
            if sum(blocks) >= total / 10 and max(blocks) < rate
        ]
        if all(e >= MIN_SAMPLES for e in expected):
            return rate
        rate //= 2
    raise AssertionError("no rate gives the sites enough samples")


def tree_sites(tree_paths: dict[tuple[str, ...], int]) -> dict[str, int]:
    """Bytes per allocation site (the tree's first level), by function name."""
    out: dict[str, int] = {}
    for p, b in tree_paths.items():
        if len(p) == 1:
            name = p[0].split(" ", 1)[0]
            out[name] = out.get(name, 0) + b
    return out


def check_estimates(got: dict[str, int], truth: dict[str, int], rate: int) -> None:
    """Every site of 10% of the heap or more within 10% of the truth; blocks at or above the rate exactly."""
    total = sum(truth.values())
    for site, true_bytes in truth.items():
        ratio = got.get(site, 0) / true_bytes
        print(f"{site}: {true_bytes / total:.0%} of the heap, estimate/truth {ratio:.4f} at rate {rate}")
        if true_bytes >= total / 10:
            assert abs(ratio - 1) <= 0.10, (site, got.get(site), true_bytes)
    assert got["site_large"] == truth["site_large"]
