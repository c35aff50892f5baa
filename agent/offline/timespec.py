"""Moments given on the command line: absolute (ISO 8601, or a time of day) or relative (`-24h`, `now`)."""

from __future__ import annotations

import itertools
import re
from datetime import datetime, time
from time import time_ns

from agent.errors import UsageError
from agent.store import ThinRule

_RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)(s|m|h|d|w)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")


# Moments a store can hold: from the epoch to the year 9999 (what datetime can print back).
_LATEST_NS = 253_402_214_400 * 10**9


def parse_moment(text: str, now_ns: int, base_ns: int | None = None) -> int:
    """Nanoseconds since the epoch for `text` (see _parse_moment); a moment before 1970 or after 9999 is refused
    as unreadable, so that every moment can be printed back."""
    try:
        ns = _parse_moment(text, now_ns, base_ns)
    except (OverflowError, OSError, ValueError):  # datetime's limits
        ns = -1
    if not 0 <= ns < _LATEST_NS:
        raise UsageError(f"the time {text!r} is out of range (1970 to 9999)")
    return ns


def _parse_moment(text: str, now_ns: int, base_ns: int | None = None) -> int:
    """Nanoseconds since the epoch for `text`:
    - `now`;
    - `-N` followed by s, m, h, d or w: that long before now (`-24h`, `-30m`, `-1.5d`);
    - an ISO 8601 date and time (`2026-11-23T08:00`, `2026-11-23 08:00:00+01:00`); without a zone, local time;
    - a time of day (`09:00`, `09:00:30`): on the day of `base_ns` (the other end of the range) or today.
    """
    t = text.strip()
    if t == "now":
        return now_ns
    m = _RELATIVE.match(t)
    if m:
        return now_ns - int(float(m.group(1)) * _UNIT_S[m.group(2)] * 1e9)
    try:
        day_time = time.fromisoformat(t) if re.match(r"^\d{1,2}:\d{2}", t) else None
    except ValueError:
        day_time = None
    if day_time is not None:
        day = datetime.fromtimestamp((base_ns if base_ns is not None else now_ns) / 1e9).date()
        return _ns(datetime.combine(day, day_time))
    try:
        moment = datetime.fromisoformat(t)
    except ValueError:
        raise UsageError(
            f"cannot read the time {text!r}: give an ISO date and time (2026-11-23T08:00), a time of day (09:00), "
            "`now`, or a time before now (-30m, -24h, -7d)"
        ) from None
    return _ns(moment)


def _ns(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.astimezone()  # local time
    return int(moment.timestamp() * 1_000_000) * 1000


def parse_duration(text: str) -> float:
    """Seconds for `500ms`, `10s`, `5m`, `1h`, `2d`, `1w` (a bare number is seconds)."""
    m = _DURATION.match(text.strip())
    if not m:
        raise UsageError(f"cannot read the duration {text!r}: expected a number and a unit (10s, 5m, 1h, 2d)")
    value = float(m.group(1))
    unit = m.group(2) or "s"
    return value / 1000 if unit == "ms" else value * _UNIT_S[unit]


def iso(ns: int) -> str:
    """Local time, to the second, with its zone."""
    return datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")


def parse_thin_rules(text: str) -> tuple[ThinRule, ...]:
    """`AGE:EVERY[,AGE:EVERY...]`, e.g. `1h:10s,1d:1m`: history older than AGE keeps one snapshot per EVERY.
    Ages must grow and intervals with them (an older rule never keeps more than a younger one)."""
    rules = []
    for part in text.split(","):
        age, sep, every = part.strip().partition(":")
        if not sep:
            raise UsageError(f"cannot read the thinning rule {part.strip()!r}: expected AGE:EVERY, e.g. 1h:10s")
        rules.append(ThinRule(parse_duration(age), parse_duration(every)))
    for a, b in itertools.pairwise(rules):
        if not (b.older_than_s > a.older_than_s and b.keep_every_s >= a.keep_every_s):
            raise UsageError(f"thinning rules must go to older ages and longer intervals: {text!r}")
    if any(r.keep_every_s <= 0 for r in rules):
        raise UsageError(f"a thinning interval must be positive: {text!r}")
    return tuple(rules)


# `--from -24h`: argparse takes a word that starts with '-' for an option unless it looks like a negative number;
# the commands that take times have no option that looks like one, so relative times are let through as values.
RELATIVE_TIME = re.compile(r"^-\d+(?:\.\d+)?[smhdw]?$")


def time_range(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    """--from and --to (None: open) in ns since the epoch, --to read from --from's day; --to before --from is
    refused."""
    now = time_ns()
    first = parse_moment(start, now) if start else None
    last = parse_moment(end, now, base_ns=first) if end else None
    if first is not None and last is not None and last < first:
        raise UsageError(f"--to ({iso(last)}) is before --from ({iso(first)})")
    return first, last
