"""`heapscope report`, `heapscope diff` and `heapscope growth`: read a stored history, no target, no probes, no
root.

    heapscope report STORE [--pid N] [--from T] [--to T] --format=massif|xtree|json [-o FILE]
    heapscope diff STORE [--pid N] --from T1 --to T2 [--json] [--threshold P]
    heapscope growth STORE [--pid N] [--since T] [--window SECONDS] [--top N] [--format text|json]

One class a command (Report, Diff, Growth): agent.cli lists them in its table of commands; each adds its parser
(`add_parser`) and runs on the namespace parsed (`run`).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from agent.argtypes import int_at_least, percent
from agent.errors import HeapscopeError, NotInHistory, UsageError
from agent.export.massif import write_massif
from agent.export.xtree import write_xtree
from agent.offline import growth, history
from agent.offline.timespec import RELATIVE_TIME, iso, parse_duration, parse_moment, time_range
from agent.store import SnapshotUnavailable, StoreReader

TIMES = (
    "Times: ISO 8601 (2026-11-23T08:00, local time unless a zone is given), a time of day (09:00: on the day "
    "of the other end, or today), `now`, or a time before now (-30m, -24h, -7d)."
)


@dataclass
class _Streams:
    """Where a command writes; None: standard output (and error) as it is when the command runs."""

    out: TextIO | None = None
    err: TextIO | None = None

    def streams(self) -> tuple[TextIO, TextIO]:
        return self.out or sys.stdout, self.err or sys.stderr


class Report(_Streams):
    """`heapscope report`: a profile of a stored range, as massif.out, xtree or JSON."""

    name = "report"

    def add_parser(self, sub: Any) -> None:
        rep = sub.add_parser(
            self.name, help="write a profile of a stored history (massif.out, xtree or JSON)", epilog=TIMES
        )
        _common(rep)
        rep.add_argument("--format", choices=("massif", "xtree", "json"), default="massif")
        rep.add_argument("-o", "--output", metavar="FILE", help="write there instead of standard output")
        rep.add_argument("--max-snapshots", type=int_at_least(10), default=None,
                         help="Massif's culling, applied to the range (default: the profile's, else 100)")
        rep.add_argument("--detailed-freq", type=int_at_least(1), default=None,
                         help="every Nth snapshot is detailed (default: the profile's, else 10)")
        rep.add_argument("--threshold", type=percent, default=None,
                         help="Massif's threshold, percent (default: the profile's, else 1.0)")

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        out, err = self.streams()
        start, end = time_range(ns.start, ns.end)
        with history.open_target(ns.store, ns.pid) as reader:
            text, notes = render_report(reader, start, end, ns.format, max_snapshots=ns.max_snapshots,
                                        detailed_freq=ns.detailed_freq, threshold=ns.threshold)
            for note in notes:
                err.write(f"heapscope: {note}\n")
            _emit(text, ns.output, out)
            _say_skipped(reader, err)
        return 0


class Diff(_Streams):
    """`heapscope diff`: what grew and what shrank between two stored moments."""

    name = "diff"

    def add_parser(self, sub: Any) -> None:
        d = sub.add_parser(self.name, help="what grew and what shrank between two stored moments", epilog=TIMES)
        _common(d, required=True)
        d.add_argument("--json", action="store_true", help="print JSON instead of text")
        d.add_argument("--threshold", type=percent, default=1.0,
                       help="nodes below this percent of the growth (or shrinkage) are merged into one line (1.0)")

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        out, err = self.streams()
        start, end = time_range(ns.start, ns.end)
        assert start is not None and end is not None  # the parser requires both
        with history.open_target(ns.store, ns.pid) as reader:
            d = diff_between(reader, start, end)
            meta = reader.meta
            if ns.json:
                out.write(json.dumps(diff_json(d, ns.threshold), indent=1) + "\n")
            else:
                out.write(diff_text(d, meta.pid, meta.cmd, ns.threshold))
            _say_skipped(reader, err)
        return 0


class Growth(_Streams):
    """`heapscope growth`: the sites ranked by steady growth over a window, leak suspects first."""

    name = "growth"

    def add_parser(self, sub: Any) -> None:
        g = sub.add_parser(
            self.name, help="what is growing: sites ranked by steady growth over a window, leak suspects first",
            epilog=TIMES + " Verdicts: leak suspect (steady growth of bytes that stay), grew then stopped (a cache "
            "that filled), growing, churn (rises and falls), shrinking, flat, too few samples (sampled mode); "
            "agent/model/growth.py says how each is decided.",
        )
        _store_args(g)
        g.add_argument("--since", metavar="T",
                       help="start of the window (default: --window before the last snapshot)")
        g.add_argument("--window", metavar="SECONDS", type=window_seconds, default=None,
                       help="length of the window: 20, 90s, 10m, 1h, 2d (default: from --since, else the whole run)")
        g.add_argument("--top", type=int_at_least(0), default=growth.TOP,
                       help=f"sites listed, ranked (0: all; every site is judged and counted) ({growth.TOP})")
        g.add_argument("--format", choices=("text", "json"), default="text")

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        out, err = self.streams()
        since = parse_moment(ns.since, time.time_ns()) if ns.since else None
        with history.open_target(ns.store, ns.pid) as reader:
            rep = growth.report(reader, since_ns=since, window_s=ns.window, top=ns.top)
        if ns.format == "json":
            out.write(json.dumps(rep.to_json(), indent=1) + "\n")
        else:
            out.write(growth.text(rep))
        for note in rep.notes:
            err.write(f"heapscope: {note}\n")
        return 0


def _store_args(p: argparse.ArgumentParser) -> None:
    p._negative_number_matcher = RELATIVE_TIME  # type: ignore[attr-defined]
    p.add_argument("store", metavar="STORE", help="the store directory (as given to --store), or one process's")
    p.add_argument("--pid", type=int_at_least(1), default=None, help="the process (when the store holds several)")


def _common(p: argparse.ArgumentParser, required: bool = False) -> None:
    _store_args(p)
    p.add_argument("--from", dest="start", metavar="T", required=required, help="start of the range")
    p.add_argument("--to", dest="end", metavar="T", required=required, help="end of the range")


def window_seconds(text: str) -> float:
    """A window's length, as --window takes it: a positive duration (20, 90s, 10m, 1h, 2d)."""
    try:
        seconds = parse_duration(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return seconds


def _say_skipped(reader: StoreReader, err: TextIO) -> None:
    for s in reader.skipped:
        err.write(f"heapscope: {s}\n")


def _option(reader: StoreReader, name: str, given: object, default: object) -> object:
    if given is not None:
        return given
    return reader.meta.options.get(name, default)


def render_report(
    reader: StoreReader,
    start: int | None,
    end: int | None,
    format: str,
    *,
    max_snapshots: int | None = None,
    detailed_freq: int | None = None,
    threshold: float | None = None,
) -> tuple[str, list[str]]:
    """The report of [start, end] (ns since the epoch, None: open) as text, massif, xtree or json, and notes
    on what it left out. Options left None take the profile's own (else Massif's defaults). For the daemon's
    /all_snapshots?from=&to= as for `heapscope report`."""
    sel = history.select(reader, start, end)
    if not sel.refs:
        raise NotInHistory(f"no snapshot in that range of {reader.path}" + _extent(reader))
    meta = reader.meta
    buf = io.StringIO()
    if format == "massif":
        series = history.massif_series(
            reader, sel,
            max_snapshots=int(_option(reader, "max_snapshots", max_snapshots, 100)),  # type: ignore[call-overload]
            detailed_freq=int(_option(reader, "detailed_freq", detailed_freq, 10)),  # type: ignore[call-overload]
        )
        write_massif(buf, series.snapshots, desc=meta.desc, cmd=meta.cmd, time_unit=meta.time_unit,
                     threshold=float(_option(reader, "threshold", threshold, 1.0)))  # type: ignore[arg-type]
        return buf.getvalue(), series.notes
    if format == "xtree":
        snap = history.load_at_end(reader, sel)
        if snap is None:
            raise HeapscopeError("no snapshot of the range can be read")
        sites = history.Trimmer(meta.options, massif=False).merge(snap.sites())
        kind = meta.options.get("xtree_memory")
        write_xtree(buf, sites, cmd=meta.cmd, pid=meta.pid, kind=kind if kind in ("allocs", "full") else "full")
        return buf.getvalue(), sel.notes
    if format == "json":
        json.dump(_report_json(reader, sel), buf, indent=1)
        buf.write("\n")
        return buf.getvalue(), sel.notes
    raise UsageError(f"unknown report format {format!r}: massif, xtree or json")


def _emit(text: str, path: str | None, out: TextIO) -> None:
    if path is None:
        out.write(text)
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise HeapscopeError(f"cannot write {path}: {exc.strerror}") from None


def _extent(reader: StoreReader) -> str:
    refs = reader.snapshots()
    if not refs:
        return " (it holds no snapshot)"
    return f" (it holds {iso(refs[0].wall_ns)} to {iso(refs[-1].wall_ns)})"


def _report_json(reader: StoreReader, sel: history.Selection) -> dict[str, object]:
    meta = reader.meta
    snaps = []
    for ref in sel.refs:
        i = ref.info
        snaps.append({
            "wall_time": iso(ref.wall_ns), "wall_ns": ref.wall_ns, "time": i["time"], "heap_B": i["heap"],
            "heap_extra_B": i["extra"], "stacks_B": i["stacks"], "mapped_B": i.get("mapped"), "rss_B": i.get("rss"),
        })
    end = history.load_at_end(reader, sel)
    sites = []
    if end is not None:
        merged = history.Trimmer(meta.options).merge(end.sites())
        for stack, c in sorted(merged.items(), key=lambda kv: -kv[1].cur_bytes):
            sites.append({"stack": [f.label for f in stack], **vars(c)})
    peak = sel.refs[-1].peak
    return {
        "pid": meta.pid, "cmd": meta.cmd, "time_unit": meta.time_unit,
        "from": iso(sel.refs[0].wall_ns), "to": iso(sel.refs[-1].wall_ns),
        "snapshots": snaps,
        "peak": None if peak is None else {"time": peak.time, "heap_B": peak.heap_B, "heap_extra_B": peak.extra_B,
                                           "stacks_B": peak.stacks_B},
        "sites_at_end": sites,
        "notes": sel.notes,
        "skipped": [str(s) for s in reader.skipped],
    }


def diff_between(reader: StoreReader, start: int, end: int) -> history.Diff:
    """The difference between the last readable snapshots at or before `start` and `end` (ns since the epoch)."""
    before = reader.at(start)
    after = reader.at(end)
    if before is None or after is None:
        raise NotInHistory(f"no snapshot at or before {iso(start if before is None else end)}" + _extent(reader))
    meta = reader.meta
    try:
        return history.diff(before, after, history.Trimmer(meta.options), meta.root_label)
    except SnapshotUnavailable as exc:
        raise HeapscopeError(f"the stored stacks cannot be read: {exc}") from None


def _shown(node: history.DeltaNode, sig: int) -> tuple[list[history.DeltaNode], list[history.DeltaNode]]:
    """Children at or above `sig` bytes (by size), and the others."""
    kids = sorted(node.children.values(), key=lambda n: (-abs(n.bytes), n.label))
    return [k for k in kids if abs(k.bytes) >= sig], [k for k in kids if abs(k.bytes) < sig]


def _sig(root: history.DeltaNode, threshold: float) -> int:
    return max(1, int(abs(root.bytes) * threshold / 100))


def _node_json(node: history.DeltaNode, sig: int) -> dict[str, object]:
    big, small = _shown(node, sig)
    kids: list[dict[str, object]] = [_node_json(k, sig) for k in big]
    if small:
        kids.append({"label": f"in {len(small)} places below the threshold", "bytes": sum(k.bytes for k in small),
                     "blocks": sum(k.blocks for k in small), "children": []})
    return {"label": node.label, "bytes": node.bytes, "blocks": node.blocks, "children": kids}


def _side(snap: history.StoredSnapshot) -> dict[str, object]:
    return {"wall_time": iso(snap.wall_ns), "time": snap.time, "heap_B": snap.heap_B,
            "heap_extra_B": snap.extra_B, "stacks_B": snap.stacks_B, "mapped_B": snap.mapped_B, "rss_B": snap.rss_B}


def diff_json(d: history.Diff, threshold: float) -> dict[str, object]:
    return {
        "from": _side(d.before),
        "to": _side(d.after),
        "heap_delta_B": d.after.heap_B - d.before.heap_B,
        "new_sites": d.new_sites,
        "gone_sites": d.gone_sites,
        "grew": _node_json(d.grew, _sig(d.grew, threshold)),
        "shrank": _node_json(d.shrank, _sig(d.shrank, threshold)),
    }


def _signed(n: int) -> str:
    return f"{n:+,}"


def diff_text(d: history.Diff, pid: int, cmd: str, threshold: float) -> str:
    b, a = d.before, d.after
    lines = [
        f"pid {pid}: {cmd}",
        f"from {iso(b.wall_ns)} (time {b.time}) to {iso(a.wall_ns)} (time {a.time}), "
        f"{(a.wall_ns - b.wall_ns) / 1e9:.0f} s",
        f"heap  {b.heap_B:,} -> {a.heap_B:,} B ({_signed(a.heap_B - b.heap_B)})",
        f"extra {b.extra_B:,} -> {a.extra_B:,} B ({_signed(a.extra_B - b.extra_B)})",
    ]
    if b.rss_B is not None and a.rss_B is not None:
        lines.append(f"rss   {b.rss_B:,} -> {a.rss_B:,} B ({_signed(a.rss_B - b.rss_B)})")
    lines.append(f"sites: {d.new_sites} new, {d.gone_sites} gone")
    for title, root in (("grew", d.grew), ("shrank", d.shrank)):
        lines.append("")
        lines.append(f"{title}: {_signed(root.bytes)} B, {_signed(root.blocks)} blocks")
        sig = _sig(root, threshold)
        _tree_lines(root, sig, 1, lines, threshold)
    return "\n".join(lines) + "\n"


def _tree_lines(node: history.DeltaNode, sig: int, depth: int, lines: list[str], threshold: float) -> None:
    big, small = _shown(node, sig)
    for k in big:
        lines.append(f"{'  ' * depth}{_signed(k.bytes):>14}  {k.label}")
        _tree_lines(k, sig, depth + 1, lines, threshold)
    if small:
        small_bytes = sum(k.bytes for k in small)
        lines.append(f"{'  ' * depth}{_signed(small_bytes):>14}  in {len(small)} places, all below {threshold:.2f}%")
