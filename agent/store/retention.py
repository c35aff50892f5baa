"""The store's retention: how much history a target's directory keeps (Retention, ThinRule), and the code that
applies it: closed segments deleted by age and size and thinned by age (`apply_retention`), thinning's rewrite
(`thin_segment`), and the sweep of ended processes' histories (`sweep_ended`)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path

from agent.store import format as fmt
from agent.store.files import segment_entries, segment_paths
from agent.store.reader import SegmentReader
from agent.store.segment import INFO_KEYS, SegmentFile, fsync_dir


@dataclass(frozen=True)
class ThinRule:
    """Snapshots older than `older_than_s` are kept at most one per `keep_every_s` seconds."""

    older_than_s: float
    keep_every_s: float


@dataclass(frozen=True)
class Retention:
    """How much history is kept. A segment closes at `segment_bytes` or when it holds `segment_seconds` of
    history (by its snapshots' wall clocks); closed segments are
    deleted, oldest first, while the target's directory exceeds `max_bytes` or once they are older than
    `max_age_s` (a segment's age is its file's modification time: when its last snapshot was written), and
    thinned by `thin` (the rule with the largest age that a segment has reached applies)."""

    max_bytes: int | None = 4 << 30
    max_age_s: float | None = 7 * 86400.0
    segment_bytes: int = 64 << 20
    segment_seconds: float = 3600.0
    thin: tuple[ThinRule, ...] = ()


@dataclass
class Applied:
    """What one application of the retention did to a directory. Problems are listed, never raised: the profile
    matters more than its old history."""

    segments_deleted: int = 0
    segments_thinned: int = 0
    snapshots_thinned: int = 0
    errors: list[str] = field(default_factory=list)


def apply_retention(directory: Path, retention: Retention, now: float, current: Path | None) -> Applied:
    """Thin, then delete the closed segments of `directory` (all but `current`, the one being written) by age and
    size; a segment's age is its file's modification time. Segments are looked at oldest first, and by age only
    until the first one no rule reaches: a later segment is never older (its last snapshot came later), and
    statting every one at each new segment cost a process attached thousands of times 75 ms an attach."""
    done = Applied()
    r = retention
    writing = current.name if current is not None else None
    closed = [e for e in segment_entries(directory) if e.name != writing]
    ages = [*([r.max_age_s] if r.max_age_s is not None else []), *(t.older_than_s for t in r.thin)]
    deleted: set[str] = set()
    rewritten: set[str] = set()
    for entry in closed if ages else ():
        try:
            age = now - entry.stat().st_mtime
        except OSError:
            continue
        if age < min(ages):
            break
        path = directory / entry.name
        if r.max_age_s is not None and age > r.max_age_s:
            if _delete(path, done):
                deleted.add(entry.name)
            continue
        rules = [t for t in r.thin if age >= t.older_than_s]
        if rules:
            rule = max(rules, key=lambda t: t.older_than_s)
            if _thin(path, rule.keep_every_s, done):
                rewritten.add(entry.name)  # its entry's stat is the old file's
    if r.max_bytes is not None:
        sizes = _closed_sizes(directory, [e for e in closed if e.name not in deleted], rewritten)
        total = sum(sizes.values())
        if current is not None:
            with contextlib.suppress(OSError):
                total += current.stat().st_size
        for name, size in sizes.items():
            if total <= r.max_bytes:
                break
            total -= size
            _delete(directory / name, done)
    return done


# The sizes of each directory's closed segments, as last seen: name -> (inode, size). A closed segment is written
# again only by thinning, which replaces it with a new file (a new inode), so its size is read once, not at each
# segment a writer opens (a process attached thousands of times has thousands of segments). Rebuilt from each
# listing, so that a name made again (a directory emptied, then written again) is read again. Least recently
# used directories go past _SIZES_KEPT.
_SIZES_KEPT = 256
_sizes: OrderedDict[Path, dict[str, tuple[int, int]]] = OrderedDict()
_sizes_lock = threading.Lock()


def _closed_sizes(directory: Path, closed: list[os.DirEntry[str]], rewritten: set[str]) -> dict[str, int]:
    """The size of each of these closed segments, oldest first."""
    with _sizes_lock:
        known = _sizes.pop(directory, {})
    seen: dict[str, tuple[int, int]] = {}
    for entry in closed:
        was = known.get(entry.name)
        if was is None or was[0] != entry.inode() or entry.name in rewritten:
            try:
                st = (directory / entry.name).stat() if entry.name in rewritten else entry.stat()
            except OSError:
                continue
            was = (st.st_ino, st.st_size)
        seen[entry.name] = was
    with _sizes_lock:
        _sizes[directory] = seen
        while len(_sizes) > _SIZES_KEPT:
            _sizes.popitem(last=False)
    return {name: size for name, (_, size) in seen.items()}


def _delete(path: Path, done: Applied) -> bool:
    try:
        path.unlink()
        done.segments_deleted += 1
        return True
    except OSError as exc:
        done.errors.append(f"store: cannot delete {path}: {exc.strerror}")
        return False


def _thin(path: Path, keep_every_s: float, done: Applied) -> bool:
    """Thin one segment; True when it was rewritten."""
    try:
        dropped = thin_segment(path, keep_every_s)
    except (OSError, ValueError, fmt.FormatError, fmt.SnapshotUnavailable) as exc:
        done.errors.append(f"store: cannot thin {path}: {exc}")
        return False
    if dropped is None:
        return False
    done.segments_thinned += 1
    done.snapshots_thinned += dropped
    return True


def thin_segment(path: Path, keep_every_s: float) -> int | None:
    """Rewrite a closed segment keeping its first and last snapshots and, between them, one at least every
    `keep_every_s` seconds. Counters are cumulative, so totals stay exact; what goes is resolution.
    Returns the snapshots dropped, or None when the segment was already that thin. The rewrite goes to a
    temporary file renamed over the old one, so a crash leaves one or the other."""
    reader = SegmentReader(path)
    meta_json = reader.filemeta
    if float(meta_json.get("thinned_every_s", 0)) >= keep_every_s:  # type: ignore[arg-type]
        return None
    refs = reader.snapshots()
    if not refs:
        return None
    step_ns = int(keep_every_s * 1e9)
    keep = [refs[0]]
    for ref in refs[1:-1]:
        if ref.wall_ns - keep[-1].wall_ns >= step_ns:
            keep.append(ref)
    if len(refs) > 1:
        keep.append(refs[-1])
    tmp = path.with_name(path.name + ".thin")
    tmp.unlink(missing_ok=True)
    seg = SegmentFile(
        tmp,
        reader.meta,
        seq=int(meta_json.get("segment", 0)),  # type: ignore[call-overload]
        checkpoint_every=int(meta_json.get("checkpoint_every", 100)),  # type: ignore[call-overload]
        extra={"thinned_every_s": keep_every_s},
    )
    try:
        for ref in keep:
            snap = reader.load(ref)
            info = {key: snap.info.get(key) for key in INFO_KEYS}
            seg.write(info, snap.counters, reader.site_stacks[seg.n_sites : snap.counters.shape[1]])
        seg.close(sync=True)
        st = path.stat()
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # its age is that of its history, not of the rewrite
        os.replace(tmp, path)
    except BaseException:
        seg.close(sync=False)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return len(refs) - len(keep)


@dataclass
class Sweep:
    """What a sweep of the store's ended histories deleted, and what it could not."""

    segments_deleted: int = 0
    directories_removed: int = 0
    errors: list[str] = field(default_factory=list)


def sweep_ended(root: Path, max_age_s: float | None, busy: Container[str], now: float | None = None) -> Sweep:
    """Delete the segments older than `max_age_s` in the directories under root that no writer holds (`busy`
    names the held ones), and each such directory once it holds nothing. A writer applies the store's retention
    to its own directory only, so without this an ended process's history stayed for good and a fleet's store
    grew with every process it saw. Age is a segment's modification time, as for a writer."""
    done = Sweep()
    if max_age_s is None:
        return done
    now = time.time() if now is None else now
    try:
        names = sorted(n for n in os.listdir(root) if n.isdigit() and n not in busy)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            done.errors.append(f"store: cannot list {root}: {exc.strerror}")
        return done

    def old(path: Path) -> bool:
        return now - path.stat().st_mtime > max_age_s

    for name in names:
        directory = root / name
        deleted = 0
        for seg in segment_paths(directory):
            try:
                if old(seg):
                    seg.unlink()
                    deleted += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                done.errors.append(f"store: cannot delete {seg}: {exc.strerror}")
        done.segments_deleted += deleted
        try:
            # Only when empty, and emptied here or long unchanged: a writer may have just made it.
            if deleted or old(directory):
                directory.rmdir()
                done.directories_removed += 1
        except OSError:
            pass
    return done
