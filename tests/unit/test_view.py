"""`heapscope view`: the page of a massif.out written to one HTML file with its data embedded, and bad input as
one line and an exit code. The page in a real browser: tests/integration/test_webpage.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import main
from tests.support.massif_sample import sample_massif_out
from tests.support.page_reader import embedded


def test_view_writes_one_page_with_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "massif.out.123"
    src.write_text(sample_massif_out())
    out = tmp_path / "page.html"
    assert main(["view", str(src), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    html = out.read_text()
    data = embedded(html)
    timeline = data["timelines"]["0"]
    assert len(timeline["points"]) == 4
    tree_ids = [p["id"] for p in timeline["points"] if p["sites"] is not None]
    assert sorted(data["trees"]["0"]) == sorted(tree_ids) == sorted(data["diffdata"]["0"])
    peak = data["trees"]["0"][tree_ids[-1]]
    assert peak["kind"] == "peak" and peak["root"]["bytes"] == timeline["points"][2]["heap"]
    assert not re.search(r"""\b(src|href)\s*=|url\(|@import""", html)


def test_view_writes_to_the_current_directory_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "in" / "massif.out.9"
    src.parent.mkdir()
    src.write_text(sample_massif_out())
    monkeypatch.chdir(tmp_path)
    assert main(["view", str(src)]) == 0
    assert (tmp_path / "massif.out.9.html").exists()


def test_view_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(tmp_path / "missing.out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err
    bad = tmp_path / "bad.out"
    bad.write_text("desc: x\ncmd: y\ntime_unit: ms\nsnapshot=0\ntime=zero\n")
    assert main(["view", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a whole number" in err
    assert not (tmp_path / "x.html").exists()


def test_names_from_the_profile_cannot_end_the_script(tmp_path: Path) -> None:
    """A function name is the target's data: embedded, it must not close the <script> that holds it (the page
    itself only ever sets names as text, never as HTML)."""
    evil = "f</script><script>alert(1)</script><!--"
    text = sample_massif_out().replace("fn29 (prog.c:129)", f"{evil} (prog.c:129)")
    assert evil in text
    src = tmp_path / "massif.out.evil"
    src.write_text(text)
    out = tmp_path / "evil.html"
    assert main(["view", str(src), "-o", str(out)]) == 0
    html = out.read_text()
    assert "<script>alert" not in html and "<!--\"" not in html
    data = embedded(html)
    names = [n["name"] for t in data["trees"]["0"].values() for n in t["root"]["children"]]
    assert evil in names  # intact once parsed
    assert "innerHTML" not in (Path(__file__).resolve().parents[2] / "agent/export/web/page.js").read_text()


def test_view_of_a_store_range_has_the_report_s_snapshots_and_the_memory_lines(tmp_path: Path) -> None:
    """A stored history's range gives the page exactly the snapshots `heapscope report --format=massif` writes
    for it (the same culling), with the mapped total and RSS the store kept."""
    from tests.support.massif_reader import read_massif
    from tests.support.store_workload import S, iso_of, make_store

    wl = make_store(tmp_path / "store", steps=120, n_sites=50)
    start, end = iso_of(wl.start_ns + 10 * S), iso_of(wl.start_ns + 100 * S)
    page, report = tmp_path / "store.html", tmp_path / "report.out"
    common = [str(tmp_path / "store"), "--pid", "4242", "--from", start, "--to", end]
    assert main(["view", *common, "-o", str(page)]) == 0
    assert main(["report", *common, "--format=massif", "-o", str(report)]) == 0
    timeline = embedded(page.read_text())["timelines"]["0"]
    expected = read_massif(report)
    assert [(p["time"], p["heap"]) for p in timeline["points"]] == [(s.time, s.heap_B) for s in expected.snapshots]
    trees = [p for p in timeline["points"] if p["sites"] is not None]
    assert len(trees) == len([s for s in expected.snapshots if s.tree is not None])
    # The workload's memory lines: mapped = 2 * heap + 4096, RSS = heap + 1 MiB, sampled with every snapshot.
    for p in timeline["points"]:
        assert p["mapped"] is not None and p["rss"] is not None
    last = timeline["points"][-1]
    assert last["rss"] - (1 << 20) == (last["mapped"] - 4096) // 2


def test_range_options_want_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "massif.out.1"
    src.write_text(sample_massif_out())
    assert main(["view", str(src), "--from", "-1h"]) == 2
    assert "store directory" in capsys.readouterr().err
