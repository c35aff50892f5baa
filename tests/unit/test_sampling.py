"""The Poisson-by-bytes estimator (agent/model/sampling.py): its weights, the reference sampler's decisions,
and Monte Carlo runs on skewed size mixes showing that the weighted sums are unbiased and that their
relative error is what the theory says (about 1/sqrt(samples) for blocks small beside the rate).

Every bound below is derived from the number of trials and the variance the theory predicts (4 standard
errors for means; for a standard deviation from K trials the relative error of the estimate is about
1/sqrt(2K)), never tuned by hand. Seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest

from agent.model.sampling import (
    PoissonSampler,
    SiteEstimate,
    estimate_sites,
    sample_probability,
    sampling_variance,
    validate_rate,
    weight_blocks,
    weight_bytes,
    weight_hint,
)

Z = 4.0  # standard errors allowed for a mean: a false alarm about once in 16,000 checks


def test_weights_follow_the_formula() -> None:
    rate = 65536
    for size in (1, 8, 100, 4096, 65535):
        p = 1.0 - math.exp(-size / rate)
        assert sample_probability(size, rate) == pytest.approx(p, rel=1e-9)  # the naive 1 - e^-x cancels
        assert weight_bytes(size, rate) == pytest.approx(size / p, rel=1e-9)
        assert weight_blocks(size, rate) == pytest.approx(1.0 / p, rel=1e-9)
        assert weight_hint(size, rate) == round(size / p)
    # At or above the rate: always sampled, weighed at exactly its size and one block.
    for size in (rate, rate + 1, 10 * rate):
        assert sample_probability(size, rate) == 1.0
        assert weight_bytes(size, rate) == size
        assert weight_blocks(size, rate) == 1.0
        assert weight_hint(size, rate) == size
        assert sampling_variance(size, rate) == 0.0
    # Tiny blocks stand for about one rate's worth of bytes each (s/p -> T + s/2).
    assert weight_bytes(1, rate) == pytest.approx(rate + 0.5, rel=1e-9)


def test_zero_and_bad_rates_are_refused() -> None:
    assert sample_probability(0, 4096) == 0.0
    with pytest.raises(ValueError):
        weight_blocks(0, 4096)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            validate_rate(bad)  # type: ignore[arg-type]


def test_reference_sampler_samples_each_size_with_its_probability() -> None:
    """The countdown (what the C sampler runs) samples an allocation of s < T bytes with p = 1 - e^(-s/T),
    whatever the sizes around it: checked per size class on an interleaved stream."""
    rate = 4096
    sizes = (16, 256, 2048, 4095, 9000)
    rng = random.Random(1)
    sampler = PoissonSampler(rate, random.Random(2))
    calls = dict.fromkeys(sizes, 0)
    hits = dict.fromkeys(sizes, 0)
    for _ in range(60000):
        size = rng.choice(sizes)
        calls[size] += 1
        hits[size] += sampler.sample(size)
    for size in sizes:
        p = sample_probability(size, rate)
        n = calls[size]
        stderr = math.sqrt(n * p * (1 - p))
        assert abs(hits[size] - n * p) <= Z * stderr + 1e-9, (size, hits[size], n * p)


# ---- Monte Carlo on skewed mixes ----------------------------------------------------------------------


def poisson_by_bytes(sizes: np.ndarray, rate: int, rng: np.random.Generator) -> np.ndarray:
    """Which allocations a Poisson-by-bytes sampler reports (vectorised): points of a Poisson process of
    rate 1/T along the bytes of the allocations below T; an allocation that holds a point is sampled.
    This has the same law as the countdown (memorylessness), which the test above checks step for step."""
    sampled = sizes >= rate
    small = np.flatnonzero(~sampled)
    ends = np.cumsum(sizes[small], dtype=np.float64)
    total = ends[-1] if len(ends) else 0.0
    expected = total / rate
    gaps = rng.exponential(rate, size=int(expected + 10 * math.sqrt(expected) + 100))
    points = np.cumsum(gaps)
    while points[-1] < total:  # pragma: no cover - the draw above covers 10 standard deviations
        points = np.concatenate([points, points[-1] + np.cumsum(rng.exponential(rate, size=len(gaps)))])
    points = points[points < total]
    sampled[small[np.unique(np.searchsorted(ends, points, side="right"))]] = True
    return sampled


def run_trials(sites: dict[str, np.ndarray], rate: int, trials: int, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Interleave the sites' allocations into one stream, sample it `trials` times and return, per site
    and per trial, the estimated bytes and blocks, the sample count and the variance estimated in-trial."""
    names = np.concatenate([np.full(len(v), k) for k, v in sites.items()])
    sizes = np.concatenate(list(sites.values()))
    order = np.random.default_rng(seed).permutation(len(sizes))
    names, sizes = names[order], sizes[order]
    p = np.where(sizes >= rate, 1.0, -np.expm1(-sizes / rate))
    w_bytes = sizes / p
    w_blocks = 1.0 / p
    var_terms = sizes.astype(np.float64) ** 2 * (1 - p) / p**2
    rng = np.random.default_rng(seed + 1)
    out = {k: {f: np.zeros(trials) for f in ("bytes", "blocks", "samples", "var")} for k in sites}
    masks = {k: names == k for k in sites}
    for t in range(trials):
        s = poisson_by_bytes(sizes, rate, rng)
        for k, m in masks.items():
            sel = s & m
            out[k]["bytes"][t] = w_bytes[sel].sum()
            out[k]["blocks"][t] = w_blocks[sel].sum()
            out[k]["samples"][t] = sel.sum()
            out[k]["var"][t] = var_terms[sel].sum()
    return out


def check_site(sizes: np.ndarray, got: dict[str, np.ndarray], rate: int) -> None:
    trials = len(got["bytes"])
    true_bytes = float(sizes.sum())
    true_blocks = float(len(sizes))
    # The variance the theory predicts for this site's sum, and its sample count.
    p = np.where(sizes >= rate, 1.0, -np.expm1(-sizes / rate))
    predicted_var = float((sizes.astype(np.float64) ** 2 * (1 - p) / p).sum())
    predicted_sd = math.sqrt(predicted_var)
    # Unbiased: the mean over trials is within Z standard errors of the truth.
    assert abs(got["bytes"].mean() - true_bytes) <= Z * predicted_sd / math.sqrt(trials) + 1e-6 * true_bytes
    block_var = float(((1 - p) / p).sum())
    assert abs(got["blocks"].mean() - true_blocks) <= Z * math.sqrt(block_var / trials) + 1e-9
    if predicted_sd == 0.0:  # every allocation at or above the rate: the estimate is exact
        assert np.all(got["bytes"] == true_bytes)
        return
    # The spread over trials is the predicted one (sd of an sd from K trials: about 1/sqrt(2K) relative).
    observed_sd = float(got["bytes"].std(ddof=1))
    assert abs(observed_sd / predicted_sd - 1.0) <= Z / math.sqrt(2 * trials)
    # The variance each trial estimates from its own samples is right on average.
    var_stderr = float(got["var"].std(ddof=1)) / math.sqrt(trials)
    assert abs(got["var"].mean() - predicted_var) <= Z * var_stderr


def assert_error_is_one_over_sqrt_samples(sizes: np.ndarray, got: dict[str, np.ndarray], rate: int) -> None:
    """relative sd x sqrt(expected samples) is, exactly, sqrt(sum p * sum s^2 (1-p)/p) / sum s: about 1
    for blocks small beside the rate (it is sqrt(1-p) for one size). The observed figure matches it, and
    it is within a few percent of 1."""
    trials = len(got["bytes"])
    p = -np.expm1(-sizes / rate)
    expected_samples = float(p.sum())
    var_sum = float((sizes.astype(np.float64) ** 2 * (1 - p) / p).sum())
    exact = math.sqrt(expected_samples * var_sum) / float(sizes.sum())
    observed = float(got["bytes"].std(ddof=1)) / float(sizes.sum()) * math.sqrt(expected_samples)
    assert abs(observed / exact - 1.0) <= Z / math.sqrt(2 * trials)
    assert abs(exact - 1.0) <= float(sizes.max()) / rate  # 1 - p <= 1 and p ~ s/T: off by at most s/T


def test_many_tiny_and_a_few_huge() -> None:
    """100,000 blocks of 8-64 bytes beside 12 blocks of 1-8 MiB and some of about half the rate."""
    rate = 65536
    rng = np.random.default_rng(7)
    sites = {
        "tiny": rng.integers(8, 65, size=100_000),
        "huge": rng.integers(1 << 20, 8 << 20, size=12),
        "near_rate": rng.integers(rate // 4, rate, size=300),
    }
    got = run_trials(sites, rate, trials=300, seed=11)
    for name, sizes in sites.items():
        check_site(sizes, got[name], rate)
    # The huge blocks are always sampled: exact, one sample each.
    assert np.all(got["huge"]["samples"] == 12)
    # Tiny blocks: relative error about 1/sqrt(expected samples).
    assert_error_is_one_over_sqrt_samples(sites["tiny"], got["tiny"], rate)


def test_bimodal_sizes_at_one_site_and_a_lone_mode_at_another() -> None:
    """One site half 32-byte and half 16 KiB calls; another only 48-byte calls, with a tenth of the bytes."""
    rate = 65536
    rng = np.random.default_rng(8)
    mixed = np.where(rng.random(8_000) < 0.5, 32, 16384)
    small_total = int(mixed.sum() / 10)
    sites = {"bimodal": mixed, "small": np.full(small_total // 48, 48)}
    got = run_trials(sites, rate, trials=300, seed=12)
    for name, sizes in sites.items():
        check_site(sizes, got[name], rate)


@pytest.mark.parametrize("samples_wanted", [100, 400, 1600])
def test_relative_error_shrinks_as_one_over_sqrt_samples(samples_wanted: int) -> None:
    """At a fixed heap, raising the sample count by 4 halves the relative error."""
    rate = 4096
    sizes = np.full(samples_wanted * rate // 48, 48)
    got = run_trials({"s": sizes}, rate, trials=200, seed=samples_wanted)
    check_site(sizes, got["s"], rate)
    assert_error_is_one_over_sqrt_samples(sizes, got["s"], rate)


def test_estimate_sites_sums_weights_per_site() -> None:
    rate = 1000
    samples = [("a", 10), ("a", 2000), ("b", 500)]
    sites = estimate_sites(samples, rate)
    assert sites["a"].samples == 2
    assert sites["a"].bytes == pytest.approx(weight_bytes(10, rate) + 2000)
    assert sites["a"].blocks == pytest.approx(weight_blocks(10, rate) + 1)
    assert sites["b"].bytes == pytest.approx(weight_bytes(500, rate))
    p = sample_probability(500, rate)
    assert sites["b"].variance == pytest.approx(500**2 * (1 - p) / p**2)
    assert SiteEstimate().relative_stderr == math.inf


def test_a_sampler_that_disarms_itself_is_said_once() -> None:
    """The sampler disarms itself when it finds its lease closed or lost: from then on nothing is sampled, and
    the profile says so (once, with the reason) instead of going on counting nothing."""
    from agent.process.sampler import CONTROL_FIELDS, ControlState
    from agent.session.sampled import SamplerLink

    fields = {name: 0 for name, _ in CONTROL_FIELDS}
    fields.update(state=2, samples=40, arm_count=3)  # armed

    class Control:
        def read(self) -> ControlState:
            return ControlState(dict(fields))

    said: list[str] = []
    link = SamplerLink.__new__(SamplerLink)  # the link's bookkeeping alone: no process, no library
    link.pid, link.say, link._lock, link._last_stats, link.disarmed_itself = 42, said.append, threading.Lock(), {}, None
    link.control = Control()  # type: ignore[assignment]
    assert link.statistics()["samples"] == 40 and said == [] and link.disarmed_itself is None
    fields.update(state=1, disarm_reason=2)  # idle: its lease was seen closed
    link.statistics()
    link.statistics()
    assert link.disarmed_itself == "controller gone"
    assert said == ["sampler in 42 disarmed itself (controller gone, armed 3 times): its allocations are no "
                    "longer sampled"]


def test_a_sampler_that_cannot_be_read_is_said_once_with_what_its_descriptors_are() -> None:
    """A read of a live process's sampler that fails leaves its counts standing still: said once, with what the
    control's descriptors are now (one taken over by another part of the daemon shows what took it)."""
    from agent.session.sampled import SamplerLink

    class Control:
        def read(self) -> None:
            raise OSError(9, "Bad file descriptor")

        def count_table(self) -> None:
            raise OSError(9, "Bad file descriptor")

        def descriptors(self) -> str:
            return "memory fd 7: anon_inode:bpf-map, lease fd 8: closed by us"

    class Alive:
        def alive(self) -> bool:
            return True

    said: list[str] = []
    link = SamplerLink.__new__(SamplerLink)  # the link's bookkeeping alone: no process, no library
    link.pid, link.say, link._lock, link._last_stats, link._last_table = 42, said.append, threading.Lock(), {}, None
    link.disarmed_itself = link.read_error = None
    link.process = Alive()  # type: ignore[assignment]
    link.control = Control()  # type: ignore[assignment]
    assert link.statistics() == {} and link.counts() is None and link.statistics() == {}
    assert said == ["cannot read the sampler in 42 ([Errno 9] Bad file descriptor; memory fd 7: anon_inode:bpf-map, "
                    "lease fd 8: closed by us): its counts stay as last read"]


def test_the_per_thread_counts_are_read_once_a_tick_and_a_large_table_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler's count table is read at each look of a reader (its figures are exact as of the request), but
    the profile's own looks within COUNTS_FRESH share one read, and a table of more than COUNTS_MANY_SLOTS threads
    (a thread-per-request server fills 16,384 slots, 2 MiB) is read at most once in LARGE_COUNTS_FRESH by anyone;
    the disarm reads it whatever its age."""
    from agent.process.sampler import COUNTS
    from agent.session import sampled
    from agent.session.sampled import SamplerLink

    clock = [100.0]
    monkeypatch.setattr(sampled.time, "monotonic", lambda: clock[0])

    class Control:
        def __init__(self, slots: int) -> None:
            self.slots, self.reads = slots, 0

        def count_table(self) -> bytes:
            self.reads += 1
            return COUNTS.pack(self.reads, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1) * self.slots

    def link_with(control: Control) -> SamplerLink:
        link = SamplerLink.__new__(SamplerLink)  # the link's bookkeeping alone: no process, no library
        link._lock, link._last_table, link._read_at, link.control = threading.Lock(), None, 0.0, control  # type: ignore[assignment]
        return link

    few = Control(4)
    link = link_with(few)
    assert link.counts()["allocs"] == 4 and link.counts()["allocs"] == 8  # a reader reads every time
    link._count_table(tick=True)
    assert few.reads == 2  # the profile's look within COUNTS_FRESH of the last read shares it
    clock[0] += sampled.COUNTS_FRESH * 1.01
    link._count_table(tick=True)
    assert few.reads == 3
    many = Control(sampled.COUNTS_MANY_SLOTS + 1)
    link = link_with(many)
    link.counts()
    clock[0] += sampled.LARGE_COUNTS_FRESH / 2
    assert link.counts()["allocs"] == many.slots and many.reads == 1  # within the second: the last read
    clock[0] += sampled.LARGE_COUNTS_FRESH * 0.51
    assert link.counts()["allocs"] == 2 * many.slots and many.reads == 2
    link._count_table(now=True)  # the disarm's
    assert many.reads == 3


def test_a_threadless_sampler_reads_its_maps_for_new_code_only_when_the_sessions_maps_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A threadless sampler looks for new objects every NEW_CODE_EVERY; while the session's maps version stands
    (the loader's events and the walks' unread code move it), nothing was loaded and the maps are not read. Once it
    moves they are, and new code is scanned for; lazy slots due are scanned for whatever the version. Without a
    session's version (a link of its own), the maps are read at every look as before."""
    from agent.session import sampled
    from agent.session.sampled import NEW_CODE_EVERY, SamplerLink

    clock = [100.0]
    monkeypatch.setattr(sampled.time, "monotonic", lambda: clock[0])
    maps = [frozenset({(0x1000, 7)})]
    version = [3]

    class Control:
        rescans = 0

        def rescan(self) -> None:
            self.rescans += 1

    def link_with(versioned: bool) -> tuple[SamplerLink, list[int]]:
        link = SamplerLink.__new__(SamplerLink)  # the link's bookkeeping alone: no process, no library
        link._last_stats, link._lazy_wait = {}, NEW_CODE_EVERY
        link.code_version = (lambda: version[0]) if versioned else None
        reads: list[int] = []
        link._code_now = lambda: reads.append(1) or maps[0]  # type: ignore[method-assign]
        link._code = link._code_read()  # as the arm reads them
        link._next_look = link._next_lazy = clock[0] + NEW_CODE_EVERY
        return link, reads

    def looks(link: SamplerLink, control: Control, n: int) -> None:
        for _ in range(n):
            clock[0] += NEW_CODE_EVERY
            link._rescan_if_due(control)  # type: ignore[arg-type]

    link, reads = link_with(versioned=True)
    control = Control()
    looks(link, control, 5)
    assert (len(reads), control.rescans) == (1, 0)  # the arm's read only
    version[0] += 1  # the session read its maps again (a data file mapped): no new code
    looks(link, control, 2)
    assert (len(reads), control.rescans) == (2, 0)
    maps[0] = maps[0] | {(0x9000, 8)}  # dlopen: the loader's event moves the version
    version[0] += 1
    looks(link, control, 3)
    assert (len(reads), control.rescans) == (3, 1)
    link._last_stats = {"lazy_skipped": 2}  # slots left lazy: scanned again when due, the version standing
    looks(link, control, 1)
    assert (len(reads), control.rescans) == (4, 2)

    plain, plain_reads = link_with(versioned=False)
    looks(plain, Control(), 4)
    assert len(plain_reads) == 5
