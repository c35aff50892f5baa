"""MALT's per-function and per-thread statistics in sampled mode: each sample is filed under the allocation
function the program called (not malloc for all), as exact mode files the same call, and the per-thread call
counts are the sampler's exact counts.

programs/sampled_fns.cpp makes known numbers of calls of malloc, calloc, realloc, posix_memalign and operator
new on a thread of their own, each from its own function, and prints how many of each it made (the truth).
Four runs of it: exact mode (the reference), sampled at a rate of 1 byte (every block sampled, at weight 1:
the estimates must be exact), and sampled at a rate that gives each function's stacks 1,600 expected samples
(the estimates within four standard errors, derived from the program's sizes; the per-thread counts exact),
and sampled at the default rate (a few samples in all: the per-thread counts exact all the same).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.model.sampling import DEFAULT_SAMPLE_RATE, sample_probability
from agent.session.maltrec import EXACT_IN_SAMPLED
from tests.support.harness import Completed
from tests.support.malt_reader import Profile

pytestmark = pytest.mark.integration

CALLS = 20000
MIN_SAMPLES = 1600  # per function: its count's standard error is then about 2.5%
Z = 4.0  # standard errors
SOURCE = "sampled_fns.cpp"
# The program's function making each kind of call -> the allocation function exact mode names for it.
SITE_FUNCTIONS = {"fn_malloc": "malloc", "fn_calloc": "calloc", "fn_realloc": "realloc",
                  "fn_posix_memalign": "posix_memalign", "fn_new": "malloc"}  # fmt: skip


def call_sizes(calls: int) -> dict[str, list[int]]:
    """The sizes of each site's calls, as sampled_fns.cpp's comment and loops give them."""
    return {
        "fn_malloc": [32 + (i % 16) * 32 for i in range(calls)],
        "fn_calloc": [(1 + i % 4) * 48 for i in range(calls)],
        "fn_realloc": [64 + (i % 32) * 32 for i in range(calls)],
        "fn_posix_memalign": [256] * calls,
        "fn_new": [40 + (i % 8) * 24 for i in range(calls)],
    }


def realistic_rate(calls: int) -> int:
    """The largest power-of-two rate at which every site expects MIN_SAMPLES samples."""
    rate = 1 << 20
    while rate > 1:
        if all(sum(sample_probability(s, rate) for s in sizes) >= MIN_SAMPLES for sizes in call_sizes(calls).values()):
            return rate
        rate //= 2
    raise AssertionError("no rate gives every site enough samples")


def count_tolerance(sizes: list[int], rate: int) -> float:
    """Z standard errors of a Horvitz-Thompson count of `sizes` sampled at `rate`: each block sampled with
    p = 1 - e^(-s/T) stands for 1/p blocks (variance (1 - p)/p), rounded at random to a whole number (at most
    a quarter block squared more per sample)."""
    var = 0.0
    for s in sizes:
        p = sample_probability(s, rate)
        var += (1 - p) / p + 0.25 * p
    return Z * math.sqrt(var)


def per_site_counts(profile: Profile) -> Counter[tuple[str, str]]:
    """Allocations (alloc.count + countZeros) per (program function calling, MALT allocation function) over the
    stacks whose call site is in one of sampled_fns.cpp's fn_* functions (main's pthread_create and printf
    allocate inside libc, which exact mode sees)."""
    out: Counter[tuple[str, str]] = Counter()
    for stack in profile.doc["stacks"]["stats"]:
        function = profile.function_of(stack)
        for address in stack["stack"]:
            loc = profile.location(address)
            if loc and loc[1] == SOURCE:
                infos = stack["infos"]
                n = infos["alloc"]["count"] + infos.get("countZeros", 0)
                caller = loc[0].split("(")[0]  # C++: fn_new()
                if n and caller in SITE_FUNCTIONS:  # not a stack of frees or of page calls
                    out[(caller, function)] += n
                break
    return out


def worker_stats(doc: dict[str, Any]) -> dict[str, int]:
    """The call counts of the thread that made the known calls (the only one calling posix_memalign)."""
    found = [t for t in doc["threads"] if t["stats"]["posix_memalign"]["count"] > 0]
    assert len(found) == 1, doc["threads"]
    return {fn: s["count"] for fn, s in found[0]["stats"].items()}


@pytest.fixture(scope="module")
def program(build: Callable[..., Path]) -> Path:
    return build(SOURCE, flags=("-g", "-O0", "-fno-omit-frame-pointer", "-pthread"))


@pytest.fixture(scope="module")
def profiles(
    program: Path, run_heapscope: Callable[..., Completed], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, int], Profile, int, dict[str, int]]]:
    """mode name -> (the program's truth, its MALT profile, the rate (0: exact), the summary's counters)."""
    out = {}
    rates = {"exact": 0, "sampled-1": 1, "sampled": realistic_rate(CALLS), "sampled-default": DEFAULT_SAMPLE_RATE}
    for name, rate in rates.items():
        malt = tmp_path_factory.mktemp(name) / "malt.json"
        options = ["--mode=exact"] if rate == 0 else ["--mode=sampled", f"--sample-rate={rate}"]
        if name in ("sampled-1", "sampled"):  # judged at their rate: no budget to raise it (sampled-default has it)
            options.append("--max-samples=0")
        got = run_heapscope(program, (str(CALLS),), (*options, f"--malt-out-file={malt}"))
        assert got.returncode == 0, got.stderr
        assert "inconsistent" not in got.stderr, got.stderr
        truth = {fn: int(n) for _, fn, n in (line.split() for line in got.stdout.splitlines())}
        out[name] = (truth, Profile(json.loads(malt.read_text())), rate, got.counters)
    return out


def expected_sites(truth: dict[str, int]) -> Counter[tuple[str, str]]:
    want = Counter({(site, fn): CALLS for site, fn in SITE_FUNCTIONS.items()})
    want[("fn_realloc", "malloc")] += 1  # the chain's first block
    assert sum(n for (_, fn), n in want.items() if fn == "malloc") == truth["malloc"]  # the program agrees
    return want


@pytest.mark.parametrize("mode", ["exact", "sampled-1"])
def test_every_call_counted_under_its_function(profiles: dict, mode: str) -> None:
    """Exact mode, and sampled mode with every block sampled at weight 1: each site's calls, exactly, under the
    function it called (operator new under malloc, as libstdc++'s operator new calls it)."""
    truth, profile, _, _ = profiles[mode]
    assert per_site_counts(profile) == expected_sites(truth)


def test_sampled_counts_per_function_within_their_standard_error(profiles: dict) -> None:
    truth, profile, rate, _ = profiles["sampled"]
    got = per_site_counts(profile)
    want = expected_sites(truth)
    assert set(got) <= set(want), got  # nothing filed under a function its site did not call
    sizes = call_sizes(CALLS)
    for site, fn in SITE_FUNCTIONS.items():
        tolerance = count_tolerance(sizes[site], rate)
        print(f"{site} -> {fn}: estimate {got[(site, fn)]}, truth {CALLS}, tolerance {tolerance:.0f} at rate {rate}")
        assert abs(got[(site, fn)] - CALLS) <= tolerance, (site, fn, got[(site, fn)], tolerance)
        assert tolerance <= CALLS / 10  # the rate keeps the test worth something: 10% at most


@pytest.mark.parametrize("mode", ["exact", "sampled-1", "sampled", "sampled-default"])
def test_thread_call_counts_are_exact(profiles: dict, mode: str) -> None:
    """The worker thread's calls per function, exactly, in every mode (sampled mode: the sampler's own counts),
    and the profile says which figures are exact in sampled mode."""
    truth, profile, _, counters = profiles[mode]
    stats = worker_stats(profile.doc)
    want = {"malloc": truth["malloc"], "calloc": truth["calloc"], "realloc": truth["realloc"],
            "posix_memalign": truth["posix_memalign"], "free": truth["free"]}  # fmt: skip
    got = {fn: n for fn, n in stats.items() if n}
    if mode == "exact":
        # Exact mode probes libc's free itself, so it also counts the frees glibc makes inside the allocator
        # (its thread cache, given back at the thread's exit); the sampler sees the program's calls only.
        assert got.pop("free") >= want.pop("free")
    assert got == want
    heapscope = profile.doc["config"]["heapscope"]
    if mode == "exact":
        assert "exact" not in heapscope and heapscope["estimates"] is False
    else:
        assert heapscope["estimates"] is True and heapscope["exact"] == list(EXACT_IN_SAMPLED)
        # The summary's call counts are the same exact counts, split as exact mode splits them: a realloc is
        # neither an allocation nor a free.
        threads = [t["stats"] for t in profile.doc["threads"]]
        assert counters["n_reallocs"] == truth["realloc"]
        assert counters["n_allocs"] == sum(s[fn]["count"] for s in threads for fn in ("malloc", "calloc",
                                           "posix_memalign", "memalign", "valloc", "pvalloc"))  # fmt: skip
        assert counters["n_frees"] == sum(s["free"]["count"] for s in threads)
