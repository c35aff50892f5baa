"""Every option Massif's users pass is accepted with Massif's meaning, or refused with one line that says why."""

from __future__ import annotations

import pytest

from agent.cli import build_parser, settings_from
from agent.model.counters import Counters
from agent.model.summary import ProfileSummary, ScheduleSummary


def parse(*args: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["attach", *args, "1"])


def test_verbosity_and_stats_are_accepted() -> None:
    ns = parse("-v", "-v", "--stats=yes")
    assert ns.verbose == 2 and ns.stats is True
    assert settings_from(ns, (), daemon=False).verbose == 2
    quiet = parse("-q")
    assert quiet.quiet and quiet.verbose == 0 and quiet.stats is False


def test_stats_are_massifs_from_our_counts() -> None:
    s = ProfileSummary(Counters(n_allocs=7, n_frees=5, n_reallocs=1, n_sites=3),
                       schedule=ScheduleSummary(taken=40, at_peaks=2, cullings=1, kept=21))
    lines = s.massif_stats()
    values = {line.split(":")[1].strip(): int(line.rsplit(maxsplit=1)[1]) for line in lines}
    assert values == {"heap allocs": 7, "heap reallocs": 1, "heap frees": 5, "real snapshots": 40,
                      "peak snapshots": 2, "cullings": 1, "kept snapshots": 21, "XPt sites": 3}


def test_heap_no_alone_is_one_clear_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["run", "--heap=no", "--", "/bin/true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--heap=no needs --pages-as-heap=yes" in err[0], err
