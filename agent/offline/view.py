"""`heapscope view FILE [-o OUT.html]`: the web page of a massif.out (written by heapscope or by Valgrind's
Massif), as one self-contained HTML file that needs no server and makes no request.

The page is the daemon's (agent.export.webpage), with the data it would fetch embedded: the timeline, every
kept tree (pruned as the daemon prunes them) and, per snapshot with a tree, the bytes by site and by stack from
which the page computes any diff itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from agent.errors import UsageError
from agent.export.webdata import (
    DIFF_ROWS,
    TOP_SITES,
    build_timeline,
    path_bytes,
    site_bytes,
    snapshot_ids,
    snapshot_tree,
)
from agent.export.webpage import render_page
from agent.model.massif_file import MassifFile, parse_massif

FILE_KEY = 0  # the page's "target" key for the one profile of a file
DIFF_ENTRIES = 2000  # sites and stacks kept per snapshot for the page's diffs; the smaller ones are counted


def add_parser(sub: Any) -> None:
    p = sub.add_parser("view", help="write the web page of a massif.out as one self-contained HTML file")
    p.add_argument("file", help="a massif.out file, from heapscope or from Valgrind's Massif")
    p.add_argument("-o", "--output", default=None, metavar="OUT.html",
                   help="where to write the page (default: the file's name + .html, in the current directory)")


def _top(entries: dict[Any, int], limit: int) -> tuple[list[list[Any]], int]:
    ranked = sorted(((k, v) for k, v in entries.items() if v > 0), key=lambda kv: -kv[1])
    return [[k, v] for k, v in ranked[:limit]], max(len(ranked) - limit, 0)


def page_data(profile: MassifFile, name: str) -> dict[str, Any]:
    snaps = profile.snapshots
    timeline = build_timeline(snaps, time_unit=profile.time_unit, top=TOP_SITES)
    trees: dict[str, Any] = {}
    diffdata: dict[str, Any] = {}
    for sid, s in zip(snapshot_ids(snaps), snaps, strict=True):
        if s.tree is None:
            continue
        trees[sid] = dataclasses.asdict(snapshot_tree(snaps, sid))
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


def run(ns: argparse.Namespace, say: Any = print) -> int:
    src = Path(ns.file)
    try:
        text = src.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {src}: {exc.strerror}") from None
    profile = parse_massif(text, name=str(src))
    out = Path(ns.output) if ns.output else Path(src.name + ".html")
    html = render_page(page_data(profile, src.name))
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror}") from None
    say(f"heapscope: wrote {out} ({len(html.encode()):,} bytes, {len(profile.snapshots)} snapshots)")
    return 0
