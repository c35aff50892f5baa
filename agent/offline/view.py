"""`heapscope view FILE|STORE [-o OUT.html]`: the web page of a massif.out (written by heapscope or by Valgrind's
Massif), or of a range of a stored history, as one self-contained HTML file that needs no server and makes no
request.

The page is the daemon's (agent.export.webpage), with the data it would fetch embedded: the timeline, every
kept tree (pruned as the daemon prunes them) and, per snapshot with a tree, the bytes by site and by stack from
which the page computes any diff itself. A store range gives the snapshots `heapscope report --format=massif`
would write for it (Massif's culling over the range), with the mapped total and RSS the store kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.errors import HeapscopeError, UsageError
from agent.export.webdata import (
    DIFF_ROWS,
    TOP_SITES,
    Mode,
    build_timeline,
    memory_lookup,
    path_bytes,
    site_bytes,
    snapshot_ids,
    snapshot_tree,
)
from agent.export.webpage import render_page
from agent.model.massif_file import MassifFile, parse_massif
from agent.model.memline import MemoryPoint
from agent.offline import history
from agent.offline.timespec import RELATIVE_TIME, iso, time_range

FILE_KEY = 0  # the page's "target" key for the one profile of a file
DIFF_ENTRIES = 2000  # sites and stacks kept per snapshot for the page's diffs; the smaller ones are counted


def _top(entries: dict[Any, int], limit: int) -> tuple[list[list[Any]], int]:
    ranked = sorted(((k, v) for k, v in entries.items() if v > 0), key=lambda kv: -kv[1])
    return [[k, v] for k, v in ranked[:limit]], max(len(ranked) - limit, 0)


def page_data(profile: MassifFile, name: str, memory: Sequence[MemoryPoint] = ()) -> dict[str, Any]:
    snaps = profile.snapshots
    # heapscope's sampled mode says so in desc: (agent.model.sampling.ProfileMode.desc)
    mode: Mode = "sampled" if "--mode=sampled" in profile.desc.split() else "exact"
    timeline = build_timeline(snaps, time_unit=profile.time_unit, top=TOP_SITES, memory=memory_lookup(memory),
                              mode=mode)
    trees: dict[str, Any] = {}
    diffdata: dict[str, Any] = {}
    for sid, s in zip(snapshot_ids(snaps), snaps, strict=True):
        if s.tree is None:
            continue
        trees[sid] = dataclasses.asdict(snapshot_tree(snaps, sid, mode=mode))
        sites, cut_sites = _top(site_bytes(s.tree), DIFF_ENTRIES)
        paths, cut_paths = _top(path_bytes(s.tree), DIFF_ENTRIES)
        diffdata[sid] = {"sites": sites, "paths": [[list(p), v] for p, v in paths], "truncated": cut_sites + cut_paths}
    last = snaps[-1]
    target = {"pid": FILE_KEY, "command": profile.cmd, "state": "file", "mode": timeline.mode,
              "heap": {"useful_bytes": last.heap_B}}
    return {
        "file": name,
        "diff_rows": DIFF_ROWS,
        "targets": [target],
        "timelines": {FILE_KEY: {**dataclasses.asdict(timeline), "pid": FILE_KEY, "command": profile.cmd,
                                 "state": "file"}},
        "trees": {FILE_KEY: trees},
        "diffdata": {FILE_KEY: diffdata},
    }


def _from_file(src: Path) -> tuple[dict[str, Any], str, int]:
    try:
        text = src.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {src}: {exc.strerror}") from None
    profile = parse_massif(text, name=str(src))
    return page_data(profile, src.name), src.name + ".html", len(profile.snapshots)


def _from_store(ns: argparse.Namespace, say: Callable[[str], None]) -> tuple[dict[str, Any], str, int]:
    start, end = time_range(ns.start, ns.end)
    with history.open_target(ns.file, ns.pid) as reader:
        sel = history.select(reader, start, end)
        if not sel.refs:
            raise HeapscopeError(f"no snapshot in that range of {reader.path}")
        meta = reader.meta
        series = history.massif_series(
            reader, sel, max_snapshots=_int_option(meta.options, "max_snapshots", 100),
            detailed_freq=_int_option(meta.options, "detailed_freq", 10),
        )
        memory = [MemoryPoint(int(r.info["time"]), r.info.get("mapped"), r.info.get("rss")) for r in sel.refs]
        profile = MassifFile(" ".join(meta.desc), meta.cmd, series.time_unit, series.snapshots)
        name = f"{meta.cmd} (PID {meta.pid}, {iso(sel.refs[0].wall_ns)} to {iso(sel.refs[-1].wall_ns)})"
        data = page_data(profile, name, memory)  # inside: the trees are read from the store as they are asked
        for note in [*series.notes, *reader.skipped]:
            say(f"heapscope: {note}")
        return data, f"heapscope.{meta.pid}.html", len(profile.snapshots)


def _int_option(options: Mapping[str, object], name: str, default: int) -> int:
    """The profile's own option (as `heapscope report` takes it), else Massif's default."""
    value = options.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclasses.dataclass
class View:
    """`heapscope view`: the page of a massif.out or of a store's range, as one HTML file."""

    say: Callable[[str], None] = print
    name = "view"

    def add_parser(self, sub: Any) -> None:
        p = sub.add_parser(self.name,
                           help="write the web page of a massif.out, or of a stored history, as one HTML file")
        p._negative_number_matcher = RELATIVE_TIME
        p.add_argument("file", metavar="FILE|STORE",
                       help="a massif.out file (from heapscope or Valgrind's Massif), or a store directory (--store)")
        p.add_argument("-o", "--output", default=None, metavar="OUT.html",
                       help="where to write the page (default: the file's name + .html, in the current directory)")
        g = p.add_argument_group("a store's range (times as `heapscope report` takes them)")
        g.add_argument("--pid", type=int, default=None, help="the process, when the store holds several")
        g.add_argument("--from", dest="start", metavar="T", default=None,
                       help="start of the range (default: its start)")
        g.add_argument("--to", dest="end", metavar="T", default=None, help="end of the range (default: its end)")

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        src = Path(ns.file)
        if src.is_dir():
            data, default, n = _from_store(ns, self.say)
        elif ns.pid is not None or ns.start is not None or ns.end is not None:
            raise UsageError("--pid, --from and --to choose a range of a store: give a store directory")
        else:
            data, default, n = _from_file(src)
        out = Path(ns.output) if ns.output else Path(default)
        html = render_page(data)
        try:
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(html, encoding="utf-8")
            os.replace(tmp, out)
        except OSError as exc:
            raise UsageError(f"cannot write {out}: {exc.strerror}") from None
        self.say(f"heapscope: wrote {out} ({len(html.encode()):,} bytes, {n} snapshots)")
        return 0
