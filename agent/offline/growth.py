"""What is growing in a stored history: each site's live bytes over a window, read from the store and judged by
agent.model.growth. For `heapscope growth`, the daemon's `/growth` and its metrics.

The window ends at the last stored snapshot (or at `since + window`) and reaches back `window` seconds (or to
`since`; by default to the start of the run). It is read at no more than MAX_POINTS snapshots whatever its length:
all of them when there are few, else spread evenly over it, checkpoints only when the window holds MIN_CHECKPOINTS
of them or more (a checkpoint decodes alone; another snapshot rolls forward from its checkpoint, or from the
snapshot read just before it). A day of 10,000 sites is 48 snapshots read, not 86,400; an hour, its 36
checkpoints.

Sites are grouped as the metrics and the web page group them: by the name of their allocation site (Massif's
trimmed stack's first frame, `fn (file:line)`), across the segments of the window (a segment numbers its sites
its own way: they are matched by their stacks). A site that held no byte at any point read is left out: there is
nothing of it to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from agent.errors import NotInHistory, UsageError
from agent.model import growth as model
from agent.model.growth import GrowthReport, Sampling, SiteGrowth
from agent.model.stack import Stack
from agent.model.target import site_name
from agent.offline import history
from agent.offline.timespec import iso
from agent.store import SnapshotRef, SnapshotUnavailable, StoredSnapshot, StoreReader
from agent.store import format as fmt

TOP = 50  # sites listed by default (all are judged and counted)
MIN_CHECKPOINTS = 16  # a window holding this many checkpoints is read at its checkpoints alone


class _Point(NamedTuple):
    """What is kept of one snapshot read: the columns used and the process's lines (not its nine counters)."""

    ref: SnapshotRef
    cur_bytes: np.ndarray
    tot_blocks: np.ndarray
    tot_bytes: np.ndarray
    heap_B: int
    mapped_B: int | None
    rss_B: int | None
    rate: int | None  # sampled mode: the rate in force at the snapshot

    @classmethod
    def of(cls, snap: StoredSnapshot) -> _Point:
        c = snap.counters
        col = fmt.COUNTER_FIELDS.index
        return cls(snap.ref, c[col("cur_bytes")].copy(), c[col("tot_blocks")].copy(), c[col("tot_bytes")].copy(),
                   snap.heap_B, snap.mapped_B, snap.rss_B, snap.rate)


class _SiteRows:
    """The trimmed stack's number (history.StackNumbers) of each site of the window's snapshots, matched across
    segments by the hash of its stack, which the reader computes from a segment's tables without making its
    frames: frames are made only for a segment that holds a stack no earlier one had (the first, and now and
    then one with a new site). Making them for each of a day's 40 segments of 10,000 sites, and matching those
    stacks frame by frame, took seconds. (Two stacks with one 64-bit hash would be taken for one site: for 10,000
    stacks, a chance of about 3 in 10^12.)"""

    def __init__(self, reader: StoreReader, numbers: history.StackNumbers) -> None:
        self.reader = reader
        self.numbers = numbers
        self._hashes = np.zeros(0, np.int64)  # the stack hashes seen, sorted
        self._numbers = np.zeros(0, np.int64)  # the number of each
        self._by_segment: dict[int, np.ndarray] = {}  # id(segment) -> the number of each of its sites

    def of(self, p: _Point) -> np.ndarray:
        seg, n = p.ref.segment, len(p.cur_bytes)
        have = self._by_segment.get(id(seg))
        if have is not None and len(have) >= n:
            return have[:n]
        done = 0 if have is None else len(have)
        hashes = seg.stack_hashes(p.ref.seq)
        stacks: list[Stack] | None = None
        if hashes is None or len(hashes) < n:  # tables the reader cannot hash: their stacks, hashed here
            stacks = self.reader.load(p.ref).site_stacks
            hashes = np.fromiter(map(hash, stacks[:n]), dtype=np.int64, count=n)
        keys = hashes[done:n]
        grown = np.full(len(keys), -1, np.int64)
        known = np.zeros(len(keys), bool)
        if len(self._hashes):
            at = np.minimum(np.searchsorted(self._hashes, keys), len(self._hashes) - 1)
            known = self._hashes[at] == keys
            grown[known] = self._numbers[at[known]]
        if not known.all():  # stacks no earlier segment had: this segment's frames are made, for them
            if stacks is None:
                stacks = self.reader.load(p.ref).site_stacks
            seen: dict[int, int] = {}
            for i in np.flatnonzero(~known).tolist():
                key = int(keys[i])
                if key not in seen:
                    seen[key] = self.numbers.number_of(stacks[done + i])
                grown[i] = seen[key]
            every = np.concatenate([self._hashes, np.fromiter(seen, np.int64, len(seen))])
            order = np.argsort(every)
            self._hashes = every[order]
            self._numbers = np.concatenate([self._numbers, np.fromiter(seen.values(), np.int64, len(seen))])[order]
        have = grown if have is None else np.concatenate([have, grown])
        self._by_segment[id(seg)] = have
        return have[:n]


@dataclass
class _Points:
    """The snapshots read for a window, and what they hold."""

    snaps: list[_Point]
    times_s: np.ndarray  # seconds from the window's start
    start_ns: int
    end_ns: int
    in_window: int  # stored snapshots in the window
    notes: list[str]


def report(reader: StoreReader, *, since_ns: int | None = None, window_s: float | None = None,
           top: int = TOP) -> GrowthReport:
    """What is growing over the window of `reader`'s history; `top` sites listed (0: all)."""
    if window_s is not None and window_s <= 0:
        raise UsageError(f"the window must be positive, not {window_s:g} s")
    if top < 0:
        raise UsageError(f"top must be 0 (all) or more, not {top}")
    pts = _points(reader, since_ns, window_s)
    meta = reader.meta
    # Per trimmed stack (Massif's trimming; --ignore-fn leaves some sites out), then per site: its first frame.
    numbers = history.StackNumbers(history.Trimmer(meta.options))
    placed = _place(pts, _SiteRows(reader, numbers))
    m = len(pts.snaps)
    live = np.zeros((len(numbers.stacks), m))
    for k, (snap, at) in enumerate(zip(pts.snaps, placed, strict=True)):
        keep = at >= 0
        live[:, k] = np.bincount(at[keep], weights=snap.cur_bytes[keep], minlength=len(live))
    names: dict[str, int] = {}
    group = np.array([names.setdefault(site_name(t), len(names)) for t in numbers.stacks], np.int64)
    series = np.zeros((len(names), m))
    np.add.at(series, group, live)
    # A site that held nothing at any point of the window (its blocks, if any, lived between two samples) has
    # nothing to judge: it is left out, and the others numbered again.
    held = np.flatnonzero(series.any(axis=1))
    renumber = np.full(len(names), -1, np.int64)
    renumber[held] = np.arange(len(held))
    group = renumber[group]
    used = group >= 0
    series = series[held]
    every_name = list(names)
    site_names = [every_name[i] for i in held]
    n_groups = len(held)

    mode, rate = _mode(reader, pts)
    sampling = None
    if mode == "sampled":
        alloc = np.zeros((2, len(numbers.stacks)))
        for sign, snap, at in ((-1, pts.snaps[0], placed[0]), (1, pts.snaps[-1], placed[-1])):
            keep = at >= 0
            np.add.at(alloc[0], at[keep], sign * snap.tot_blocks[keep])
            np.add.at(alloc[1], at[keep], sign * snap.tot_bytes[keep])
        by_group = np.zeros((2, n_groups))
        np.add.at(by_group.T, group[used], np.maximum(alloc[:, used], 0).T)
        sampling = Sampling(rate, by_group[0], by_group[1])
    trends = model.judge(pts.times_s, series, sampling)

    # The stack shown for a site: its stack that added the most over the window (the most live at the end).
    score = np.lexsort((live[:, -1], live[:, -1] - live[:, 0]))  # ascending: the best last
    best: dict[int, Stack] = {}
    for r in score[::-1]:
        g = int(group[r])
        if g >= 0 and g not in best:
            best[g] = numbers.stacks[r]
    order = trends.ranked()
    listed = order if top == 0 else order[:top]
    rest = float(trends.bytes_per_s[order[len(listed):]].sum())
    sites = tuple(_site(trends, int(g), site_names[g], best.get(int(g), ()), series) for g in listed)

    heap = model.line_trend(pts.times_s, [s.heap_B for s in pts.snaps])
    assert heap is not None
    process = model.judge_process(heap, model.line_trend(pts.times_s, [s.mapped_B for s in pts.snaps]),
                                  model.line_trend(pts.times_s, [s.rss_B for s in pts.snaps]),
                                  estimate=mode == "sampled")
    notes = pts.notes + [str(s) for s in reader.skipped]
    return GrowthReport(
        pid=meta.pid, cmd=meta.cmd, mode=mode, sample_rate=rate, start_wall_ns=pts.start_ns,
        end_wall_ns=pts.end_ns, times_s=tuple(float(t) for t in pts.times_s), process=process, sites=sites,
        n_sites=n_groups, counts=trends.counts(), snapshots=pts.in_window, rest_bytes_per_s=rest, notes=tuple(notes),
    )


def _place(pts: _Points, rows: _SiteRows) -> list[np.ndarray]:
    """Each point's sites as trimmed stack numbers; a point whose stacks cannot be read is left out."""
    placed, kept = [], []
    for k, p in enumerate(pts.snaps):
        try:
            placed.append(rows.of(p))
            kept.append(k)
        except SnapshotUnavailable:
            continue
    if not kept:
        raise NotInHistory("the stacks of no snapshot of the window can be read")
    if len(kept) < len(pts.snaps):
        pts.notes.append(f"{len(pts.snaps) - len(kept)} snapshots of the window were left out: their stacks "
                         "cannot be read")
        pts.snaps = [pts.snaps[k] for k in kept]
        pts.times_s = pts.times_s[kept]
    return placed


def _site(trends: model.Trends, g: int, name: str, stack: Stack, series: np.ndarray) -> SiteGrowth:
    samples = None if trends.samples is None else round(float(trends.samples[g]))
    return SiteGrowth(
        site=name, stack=tuple(site_name((f,)) for f in stack), bytes_per_s=float(trends.bytes_per_s[g]),
        steadiness=float(trends.steadiness[g]), age_s=float(trends.age_s[g]), added_B=int(trends.added_B[g]),
        live_B=int(trends.live_B[g]), verdict=model.VERDICTS[int(trends.verdict[g])], samples=samples,
        line=tuple(int(v) for v in series[g]),
    )


def _mode(reader: StoreReader, pts: _Points) -> tuple[str, int]:
    """The profile's mode over the window (from its segments' descriptions): sampled, with its rate, when any
    part of it was sampled. The rate is the highest in force at the snapshots read, when the sampling budget
    raised it: a site's samples are then not overcounted (a site with too few is called so, not judged)."""
    rates = set()
    exact = False
    for seg in {id(p.ref.segment): p.ref.segment for p in pts.snaps}.values():
        rate = next((a.split("=", 1)[1] for a in seg.meta.desc if a.startswith("--sample-rate=")), None)
        if "--mode=sampled" in seg.meta.desc and rate is not None and rate.isdigit():
            rates.add(int(rate))
        else:
            exact = True
    if not rates:
        return "exact", 1
    if exact or len(rates) > 1:
        pts.notes.append("the window spans a change of mode: its growth is judged as sampled")
    asked = max(rates)
    in_force = max((p.rate for p in pts.snaps if p.rate is not None), default=asked)
    if in_force > asked:
        pts.notes.append(f"the sampling budget raised the rate to one sample per {in_force} bytes in the window: "
                         "samples are counted at that rate")
    return "sampled", max(asked, in_force)


def _points(reader: StoreReader, since_ns: int | None, window_s: float | None) -> _Points:
    """The snapshots to read for the window, read."""
    count, first_ns, last_ns = reader.extent()
    if not count or first_ns is None or last_ns is None:
        raise NotInHistory(f"{reader.path} holds no snapshot")
    if since_ns is not None:
        start = since_ns
        end = last_ns if window_s is None else min(last_ns, since_ns + int(window_s * 1e9))
    else:
        end = last_ns
        start = first_ns if window_s is None else end - int(window_s * 1e9)
    if start > last_ns:
        raise NotInHistory(f"no snapshot after {iso(start)} (the store holds {iso(first_ns)} to {iso(last_ns)})")
    notes: list[str] = []
    refs = reader.snapshots(start, end)
    prior = reader.before(start) if not refs or refs[0].wall_ns > start else None
    if prior is not None and refs and history.run_of(prior) != history.run_of(refs[0]):
        prior = None
    runs = sorted({history.run_of(r) for r in refs})
    if len(runs) > 1:
        refs = [r for r in refs if history.run_of(r) == runs[-1]]
        notes.append(f"the window covers {len(runs)} runs of the process: the last is judged")
    in_window = len(refs)
    if prior is not None:
        refs.insert(0, prior)
    if not refs:
        raise NotInHistory(f"no snapshot at or before {iso(end)} (the store holds {iso(first_ns)} to "
                           f"{iso(last_ns)})")
    start = max(start, refs[0].wall_ns) if prior is None else start
    chosen = _choose(refs)
    snaps, walls = [], []
    for ref in chosen:
        try:
            snaps.append(_Point.of(reader.load(ref, stacks=False)))
        except SnapshotUnavailable:
            continue
        walls.append(max(ref.wall_ns, start))
    if not snaps:
        raise NotInHistory("no snapshot of the window can be read")
    if len(snaps) < len(chosen):
        notes.append(f"{len(chosen) - len(snaps)} snapshots of the window could not be read and were left out")
    if walls[-1] < end:  # the last state held until the window's end (a quiet target is stored rarely)
        snaps.append(snaps[-1])
        walls.append(end)
    if in_window < 2 * model.SUBWINDOWS:
        notes.append(f"only {_count(in_window, 'snapshot')} stored in the window: the verdicts rest on few points")
    times = (np.array(walls, dtype=np.int64) - start) / 1e9
    return _Points(snaps, times, start, end, in_window, notes)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _choose(refs: list[SnapshotRef]) -> list[SnapshotRef]:
    """At most MAX_POINTS of `refs` (in time order), spread over them, the first and the last among them. When the
    window holds MIN_CHECKPOINTS checkpoints or more, checkpoints only: each decodes alone, where another snapshot
    rolls forward from its checkpoint (about 0.3 ms a snapshot for 10,000 sites: an hour read through is a second).
    Fewer checkpoints means a window of less than MIN_CHECKPOINTS checkpoint intervals: rolled through at most once."""
    most = model.MAX_POINTS
    if len(refs) <= most:
        return refs
    inner = refs[1:-1]
    checkpoints = [r for r in inner if r.seq % r.segment.checkpoint_every == 0]
    pool = checkpoints if len(checkpoints) >= MIN_CHECKPOINTS else inner
    picked = [pool[i] for i in model.thin(len(pool), most - 2)]
    return [refs[0], *picked, refs[-1]]


# ---- text -------------------------------------------------------------------------------------------------


def _age(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f}{unit}"
    return f"{seconds:.0f}s"


STACK_LINES = 8  # frames of a suspect's stack shown in the text


def text(rep: GrowthReport) -> str:
    """`heapscope growth`'s table: the process's verdict, then the sites ranked, each suspect's stack under it."""
    mode = ("exact mode" if rep.mode == "exact"
            else f"sampled mode, a sample per {rep.sample_rate:,} B on average: the bytes are estimates")
    lines = [
        f"pid {rep.pid}: {rep.cmd} ({mode})",
        f"window {iso(rep.start_wall_ns)} to {iso(rep.end_wall_ns)}: {_age(rep.window_s)}, "
        f"{_count(rep.snapshots, 'snapshot')} stored, {len(rep.times_s)} read",
        f"process: {rep.process.said}",
    ]
    for name, line in (("heap", rep.process.heap), ("mapped", rep.process.mapped), ("rss", rep.process.rss)):
        if line is not None:
            lines.append(f"  {name:<7}{model.bytes_text(line.start_B):>11} -> {model.bytes_text(line.end_B):>11}  "
                         f"{model.rate_text(line.bytes_per_s):>13}  {line.trend}")
    counted = ", ".join(f"{n} {v}" for v, n in rep.counts.items() if n)
    lines += [f"sites: {rep.n_sites} judged" + (f": {counted}" if counted else ""), ""]
    if not rep.sites:
        return "\n".join(lines) + "\n"
    head = f"{'#':>3}  {'verdict':<17}{'rate':>13}{'added':>11}{'live':>11}{'steady':>8}{'age':>7}"
    if rep.mode == "sampled":
        head += f"{'samples':>9}"
    lines.append(head + "  site")
    for i, s in enumerate(rep.sites, 1):
        row = (f"{i:>3}  {s.verdict:<17}{model.rate_text(s.bytes_per_s):>13}{model.bytes_text(s.added_B):>11}"
               f"{model.bytes_text(s.live_B):>11}{s.steadiness:>8.2f}{_age(s.age_s):>7}")
        if rep.mode == "sampled":
            row += f"{'' if s.samples is None else s.samples:>9}"
        lines.append(f"{row}  {s.site}")
        if s.suspect:
            lines += [f"{'':>7}{'<-' if k else 'at'} {frame}" for k, frame in enumerate(s.stack[:STACK_LINES])]
            if len(s.stack) > STACK_LINES:
                lines.append(f"{'':>7}... {len(s.stack) - STACK_LINES} more frames")
    if len(rep.sites) < rep.n_sites:
        lines.append(f"({rep.n_sites - len(rep.sites)} more sites: --top 0 lists them all)")
    return "\n".join(lines) + "\n"
