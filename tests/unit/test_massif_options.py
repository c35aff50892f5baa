"""Every option Massif's users pass is accepted with Massif's meaning, or refused with one line that says why.

The list is Massif 3.19's manual, "Massif Command-line Options", in its order, and the Valgrind core options its
users pass with it (-v, -q, --stats, the malloc replacement's --alignment, --xtree-memory). Each value range is
Massif's own: heapscope refuses what `valgrind --tool=massif` refuses, with one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from agent.cli import build_parser, main, options_from, settings_from
from agent.errors import UsageError
from agent.model.counters import Counters
from agent.model.summary import ProfileSummary, ScheduleSummary


def parse(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["attach", *args, "1"])


def refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line `heapscope run ARGS -- /bin/true` is refused with (exit code 2, nothing run)."""
    assert main(["run", *args, "--", "/bin/true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@dataclass(frozen=True)
class Accepted:
    """An option as Massif's manual gives it, and the MassifOptions field and value it must set."""

    arg: str
    field: str
    value: object


# The manual's Massif options, each at its default and at the edges Massif accepts.
ACCEPTED = [
    Accepted("--heap=yes", "heap", True),
    Accepted("--heap-admin=8", "heap_admin", 8),
    Accepted("--heap-admin=0", "heap_admin", 0),
    Accepted("--heap-admin=1024", "heap_admin", 1024),
    Accepted("--stacks=no", "stacks", False),
    Accepted("--stacks=yes", "stacks", True),
    Accepted("--pages-as-heap=no", "pages_as_heap", False),
    Accepted("--pages-as-heap=yes", "pages_as_heap", True),
    Accepted("--depth=30", "depth", 30),
    Accepted("--depth=1", "depth", 1),
    Accepted("--depth=200", "depth", 200),
    Accepted("--alloc-fn=xmalloc", "alloc_fns", ["xmalloc"]),
    Accepted("--alloc-fn=operator new(unsigned long, std::nothrow_t const&)", "alloc_fns",
             ["operator new(unsigned long, std::nothrow_t const&)"]),
    Accepted("--ignore-fn=quiet_alloc", "ignore_fns", ["quiet_alloc"]),
    Accepted("--threshold=1.0", "threshold", 1.0),
    Accepted("--threshold=0.0", "threshold", 0.0),
    Accepted("--threshold=100", "threshold", 100.0),
    Accepted("--peak-inaccuracy=1.0", "peak_inaccuracy", 1.0),
    Accepted("--peak-inaccuracy=0.0", "peak_inaccuracy", 0.0),
    Accepted("--time-unit=ms", "time_unit", "ms"),
    Accepted("--time-unit=B", "time_unit", "B"),
    Accepted("--detailed-freq=10", "detailed_freq", 10),
    Accepted("--detailed-freq=1", "detailed_freq", 1),
    Accepted("--detailed-freq=1000000", "detailed_freq", 1000000),
    Accepted("--max-snapshots=100", "max_snapshots", 100),
    Accepted("--max-snapshots=10", "max_snapshots", 10),
    Accepted("--max-snapshots=1000", "max_snapshots", 1000),
    # Valgrind's core options that Massif's replacement of malloc and its xtree read.
    Accepted("--alignment=16", "alignment", 16),
    Accepted("--alignment=4096", "alignment", 4096),
    Accepted("--xtree-memory=none", "xtree_memory", "none"),
    Accepted("--xtree-memory=allocs", "xtree_memory", "allocs"),
    Accepted("--xtree-memory=full", "xtree_memory", "full"),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda c: c.arg)
def test_massif_option_has_massifs_meaning(case: Accepted) -> None:
    opts = options_from(parse(case.arg))
    assert getattr(opts, case.field) == case.value


def test_output_file_options_are_massifs() -> None:
    ns = parse("--massif-out-file=out.%p", "--xtree-memory-file=xt.%p")
    assert ns.massif_out_file == "out.%p" and ns.xtree_memory_file == "xt.%p"
    defaults = parse()
    assert defaults.massif_out_file == "massif.out.%p" and defaults.xtree_memory_file == "xtmemory.kcg.%p"


# What `valgrind --tool=massif` refuses (3.19's ranges), and the two that heapscope refuses with its reason.
REFUSED = [
    ("--heap-admin=1025", "at most 1024"),
    ("--heap-admin=-1", "at least 0"),
    ("--depth=0", "at least 1"),
    ("--depth=201", "at most 200"),
    ("--threshold=100.1", "between 0.0 and 100.0"),
    ("--detailed-freq=0", "at least 1"),
    ("--detailed-freq=1000001", "at most 1000000"),
    ("--max-snapshots=9", "at least 10"),
    ("--max-snapshots=1001", "at most 1000"),
    ("--alignment=8", "at least 16"),
    ("--alignment=8192", "at most 4096"),
    ("--alignment=24", "power of two"),
    ("--time-unit=x", "invalid choice"),
    ("--stacks=maybe", "yes or no"),
    # Massif's own refusal
    ("--stacks=yes --pages-as-heap=yes", "cannot be combined"),
    # heapscope's: time in instructions needs hardware counters
    ("--time-unit=i", "instruction counters"),
    # heapscope's: Massif would then profile the stacks alone, or nothing
    ("--heap=no", "Massif then profiles only the stacks"),
    ("--heap=no --pages-as-heap=yes", "not even pages"),
]


@pytest.mark.parametrize(("args", "why"), REFUSED, ids=[a for a, _ in REFUSED])
def test_option_outside_massifs_range_is_one_line(capsys: pytest.CaptureFixture[str], args: str, why: str) -> None:
    line = refusal(capsys, *args.split())
    assert why in line, line


def test_refusals_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        options_from(parse("--heap=no"))


def test_verbosity_and_stats_are_accepted() -> None:
    ns = parse("-v", "-v", "--stats=yes")
    assert ns.verbose == 2 and ns.stats is True
    assert settings_from(ns, (), daemon=False).verbose == 2
    quiet = parse("-q")
    assert quiet.quiet and quiet.verbose == 0 and quiet.stats is False
    assert parse("--stats=no").stats is False


def test_stats_are_massifs_from_our_counts() -> None:
    s = ProfileSummary(Counters(n_allocs=7, n_frees=5, n_reallocs=1, n_sites=3),
                       schedule=ScheduleSummary(taken=40, at_peaks=2, cullings=1, kept=21))
    lines = s.massif_stats()
    values = {line.split(":")[1].strip(): int(line.rsplit(maxsplit=1)[1]) for line in lines}
    assert values == {"heap allocs": 7, "heap reallocs": 1, "heap frees": 5, "real snapshots": 40,
                      "peak snapshots": 2, "cullings": 1, "kept snapshots": 21, "XPt sites": 3}


def test_nice_takes_a_nice_level_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--nice=10").nice == 10 and parse("--nice=-20").nice == -20 and parse().nice is None
    assert "--nice: must be at most 19, got 20" in refusal(capsys, "--nice=20")
    assert "--nice: expected a whole number, got 'low'" in refusal(capsys, "--nice=low")
