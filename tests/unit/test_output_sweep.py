"""A fleet daemon's output files of processes it no longer profiles go once older than --output-max-age, and
nothing else in the output directory is touched (agent.daemon.outputs)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from agent.cli import expand_filename
from agent.daemon.fleetopts import age_or_zero
from agent.daemon.outputs import output_names, sweep_outputs

DAY = 86400.0


def touch(path: Path, age_s: float, now: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    os.utime(path, (now - age_s, now - age_s))
    return path


def test_the_names_are_those_with_the_pid_in_the_file_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SVC", "api")
    monkeypatch.delenv("UNSET_HERE", raising=False)
    names = output_names(
        ["massif.out.%p", "malt-%q{SVC}-%p.json", "fixed.out", "runs/%p/massif.out", "by-pid/heap.%p.pb.gz",
         "%q{UNSET_HERE}.%p"],
        expand_filename,
    )
    assert [(n.directory, n.pattern.pattern) for n in names] == [
        ("", r"massif\.out\.(\d+)"),
        ("", r"malt\-api\-(\d+)\.json"),
        ("by-pid", r"heap\.(\d+)\.pb\.gz"),
    ]


def test_old_files_of_processes_not_held_go_and_nothing_else(tmp_path: Path) -> None:
    now = time.time()
    out = tmp_path / "out"
    old_gone = touch(out / "massif.out.111", 8 * DAY, now)
    old_held = touch(out / "massif.out.222", 8 * DAY, now)
    fresh_gone = touch(out / "massif.out.333", 1 * DAY, now)
    old_in_dir = touch(out / "by-pid" / "heap.111.pb.gz", 8 * DAY, now)
    not_ours = [touch(out / n, 8 * DAY, now) for n in ("massif.out.111.bak", "massif.out.x", "notes.txt")]
    elsewhere = touch(tmp_path / "massif.out.111", 8 * DAY, now)  # beside the output directory
    link = out / "massif.out.444"
    link.symlink_to(elsewhere)
    names = output_names(["massif.out.%p", "by-pid/heap.%p.pb.gz", "../massif.out.%p"], expand_filename)

    swept = sweep_outputs(out, names, 7 * DAY, held={222}, now=now)

    assert swept.files_deleted == 2 and swept.errors == []
    assert not old_gone.exists() and not old_in_dir.exists()
    assert old_held.exists() and fresh_gone.exists()
    assert all(p.exists() for p in not_ours)
    assert elsewhere.exists() and link.is_symlink()  # a template leaving the directory, and a link, are left alone
    again = sweep_outputs(out, names, 7 * DAY, held=set(), now=now + 6.5 * DAY)
    assert again.files_deleted == 2  # 222's and 333's, once old: nothing remembers who wrote them
    assert sorted(p.name for p in out.iterdir() if p.is_file() and not p.is_symlink()) == sorted(
        p.name for p in not_ours
    )


def test_a_directory_not_made_yet_is_no_error(tmp_path: Path) -> None:
    names = output_names(["later/massif.out.%p"], expand_filename)
    swept = sweep_outputs(tmp_path, names, 1.0, held=set())
    assert (swept.files_deleted, swept.errors) == (0, [])


def test_the_age_is_a_duration_or_zero_for_never() -> None:
    assert age_or_zero("7d") == 7 * DAY
    assert age_or_zero("90") == 90.0
    assert age_or_zero("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read the duration"):
        age_or_zero("soon")
