"""MALT profile: the JSON writer of agent.model.malt's profile.

The format is MALT's documented JSON profile (sections `run`, `config`, `stacks`, `sites`, `timeline`,
`scatter`, `threads`, `memStats`, `globals`, `leaks`). `formatVersion` 1.1 is what that document describes;
1.6 is what the reader of current MALT (libreader, MALT 1.5/1.6) requires: it refuses any other
`formatVersion`, needs a top-level `domains`, `mmap`/`munmap` in each stack's infos, `stacks.count`, `fields`
and `callsite` in every timeline, `aslrOffset` in each map entry, its own `config` keys, the extra fields of
each global variable (`symbol`, `usedSize`, `binaryFile`, `offset`, `secOffset`) and the thread
`stackMem.timeprofiler` block (whose `peakTimesteamp` key is spelled that way in the reader).

Pure: no bcc, no I/O except writing to the given text stream. Symbols are resolved through a callback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from agent.model.malt import (
    FORMAT_VERSIONS,
    MALT_FUNCTIONS,
    ROOT_ADDRESS,
    ROOT_STRING,
    UNKNOWN_ASLR_OFFSET,
    UNKNOWN_STRING,
    FormatVersion,
    GlobalVariable,
    MaltConfig,
    MaltProfile,
    MaltThread,
    StackKey,
    ThreadFunctionStats,
    TimelineSeries,
)
from agent.model.stack import Frame, ip_groups

# ----------------------------------------------------------------------------------------------------------
# Sites


# A resolver gives the frames of one raw return address, innermost inlined function first (Symbolizer.resolver).
SiteResolver = Callable[[int], Sequence[Frame]]


def _hex(address: int) -> str:
    return f"0x{address:x}"


class _Strings:
    def __init__(self) -> None:
        self.items: list[str] = [UNKNOWN_STRING, ROOT_STRING]
        self._index = {s: i for i, s in enumerate(self.items)}

    def id(self, text: str | None) -> int:
        if not text:
            return 0
        i = self._index.get(text)
        if i is None:
            i = self._index[text] = len(self.items)
            self.items.append(text)
        return i


def _instr_entry(strings: _Strings, frames: Sequence[Frame]) -> dict[str, int]:
    """One address as MALT's addr2line gives it: the innermost (inlined) function and its file:line."""
    if not frames:
        return {"function": 0}
    inner = frames[0]
    entry: dict[str, int] = {}
    path = inner.path or inner.file
    if path:
        entry["file"] = strings.id(path)
    entry["function"] = strings.id(inner.function)
    if inner.line:
        entry["line"] = inner.line
    obj = next((f.obj for f in frames if f.obj), None)
    if obj:
        entry["binary"] = strings.id(obj)
    return entry


def _stack_json(profile: MaltProfile, key: StackKey, function_frame: bool) -> list[int]:
    fn_addr = profile.function_addresses.get(key.function) if function_frame else None
    return ([fn_addr] if fn_addr is not None else []) + list(key.addresses)


def build_sites(
    profile: MaltProfile, resolve: SiteResolver | None, *, version: FormatVersion, function_frame: bool = True
) -> dict[str, Any]:
    """The `sites` section: the mappings, the string table and one `instr` entry per address used."""
    strings = _Strings()
    instr: dict[int, dict[str, int]] = {ROOT_ADDRESS: {"function": strings.id(ROOT_STRING)}}
    if function_frame:
        for fn, addr in profile.function_addresses.items():
            entry = {"function": strings.id(fn)}
            if profile.run.allocator:
                entry["binary"] = strings.id(profile.run.allocator)
            instr[addr] = entry
    known: dict[int, Sequence[Frame]] = {}
    for s in profile.stacks:  # frames the profiler already has
        if s.frames:
            groups = ip_groups(s.frames)
            if len(groups) == len(s.key.addresses):
                known.update(zip(s.key.addresses, groups, strict=True))
    wanted = {a for s in profile.stacks for a in s.key.addresses}
    wanted.update(a for lk in profile.leaks for a in lk.key.addresses)
    for addr in sorted(wanted):
        if addr in instr:
            continue
        frames = known.get(addr)
        if frames is None:
            frames = resolve(addr) if resolve is not None else ()
        instr[addr] = _instr_entry(strings, frames)
    maps = []
    for m in profile.mappings:
        row: dict[str, Any] = {"lower": _hex(m.start), "upper": _hex(m.end), "offset": _hex(m.offset)}
        if version == "1.6":
            row["aslrOffset"] = UNKNOWN_ASLR_OFFSET
        row["file"] = m.name  # as the process names it (a container's, inside it)
        maps.append(row)
    return {"map": maps, "strings": strings.items, "instr": {_hex(a): e for a, e in sorted(instr.items())}}


# ----------------------------------------------------------------------------------------------------------
# The writer


def _heapscope_json(cfg: MaltConfig) -> dict[str, Any]:
    """heapscope's own config section: which mode the figures come from."""
    sampled = cfg.mode == "sampled"
    out: dict[str, Any] = {"mode": cfg.mode, "sample-rate": cfg.sample_rate if sampled else 0, "estimates": sampled}
    if sampled and cfg.exact:
        out["exact"] = list(cfg.exact)  # everything else is an estimate
    return out


def _config_json(cfg: MaltConfig, version: FormatVersion) -> dict[str, Any]:
    sampled = cfg.mode == "sampled"
    if version == "1.1":
        return {
            "time": {"enabled": cfg.time_enabled, "points": cfg.points, "linear": False},
            "stack": {"enabled": cfg.stack_enabled, "mode": cfg.stack_mode, "resolve": True},
            "output": {"name": cfg.output_name, "json": True},
            "sampling": {"enabled": sampled, "volume": cfg.sample_rate if sampled else 0},
            "heapscope": _heapscope_json(cfg),
        }
    # Every key MALT 1.6's reader loads (format/Config.cpp), with heapscope's meaning where one exists.
    return {
        "time": {"enabled": cfg.time_enabled, "points": cfg.points, "linear": False},
        "stack": {"enabled": cfg.stack_enabled, "mode": cfg.stack_mode, "resolve": True, "libunwind": False, "skip": 0},
        "addr2line": {"bucket": 0, "threads": 1, "huge": 0},
        # MALT's own sampling is by volume too (one allocation in `volume` bytes); heapscope's, by Poisson.
        "sampling": {"enabled": sampled, "volume": cfg.sample_rate if sampled else 0, "count": 0},
        "python": {
            "instru": False,
            "mix": False,
            "stack": "none",
            "obj": False,
            "mem": False,
            "raw": False,
            "hide-imports": False,
            "mode": "none",
        },
        "c": {"gpu-malloc": False, "malloc": True, "mmap": cfg.mmap},
        "output": {
            "callgrind": False,
            "config": False,
            "indent": True,
            "json": True,
            "lua": False,
            "name": cfg.output_name,
            "verbosity": "default",
            "stack-tree": False,
            "loop-suppress": False,
        },
        "max-stack": {"enabled": False},
        "distr": {"alloc-size": True, "realloc-jump": True},
        "info": {"hidden": False},
        "trace": {"enabled": False},
        "filter": {"exe": "", "childs": False, "enabled": False, "ranks": ""},
        "dump": {
            "on-signal": "",
            "after-seconds": 0,
            "on-sys-full-at": "",
            "on-app-using-rss": "",
            "on-app-using-virt": "",
            "on-app-using-req": "",
            "on-thread-stack-using": "",
            "on-alloc-count": "",
            "watch-dog": False,
        },
        "tools": {"nm": False, "nm-max-size": ""},
        "heapscope": _heapscope_json(cfg),
    }


def _callsite_text(site: StackKey | int | None, stack_ids: Mapping[StackKey, str], version: FormatVersion) -> str:
    if isinstance(site, StackKey):
        found = stack_ids.get(site)
        if found is not None:
            return found
    elif isinstance(site, int) and site:
        return _hex(site)
    # MALT 1.1 prints a null pointer as glibc's %p does; 1.6's reader writes and parses 0x0.
    return "0x0" if version == "1.6" else "(nil)"


def _timeline_json(
    series: TimelineSeries,
    stack_ids: Mapping[StackKey, str],
    version: FormatVersion,
    *,
    with_callsite: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"start": series.start}
    if version == "1.6":
        out["fields"] = list(series.fields)
    out["perPoints"] = series.per_points
    out["peak"] = list(series.peak) if series.peak else [0] * len(series.fields)
    out["values"] = [list(v) for v in series.values]
    if with_callsite or version == "1.6":
        sites = list(series.callsites) + [None] * (len(series.values) - len(series.callsites))
        out["callsite"] = [_callsite_text(c, stack_ids, version) for c in sites[: len(series.values)]]
    return out


def _thread_json(thread: MaltThread, version: FormatVersion) -> dict[str, Any]:
    stats = {}
    for fn in MALT_FUNCTIONS:
        s = thread.stats.get(fn, ThreadFunctionStats())
        stats[fn] = {"count": s.count, "sum": s.sum, "time": s.time}
    # heapscope does not follow thread stacks: the stack-memory block is there, empty, for the readers.
    timeprofiler: dict[str, Any] = {
        "min": [],
        "max": [],
        "index": [],
        "location": [],
        "timestamp": [],
        "peakTimestamp": 0,
        "peakMemory": 0,
        "peakIndex": 0,
        "linearIndex": True,
    }
    if version == "1.6":
        timeprofiler["peakTimesteamp"] = 0  # the reader's spelling
    stack_mem = {"size": 0, "stack": [], "mem": [], "total": 0, "timeprofiler": timeprofiler}
    return {"stackMem": stack_mem, "cntMemOps": thread.mem_ops, "stats": stats}


def _global_variable_json(var: GlobalVariable, version: FormatVersion) -> dict[str, Any]:
    if version == "1.1":
        return {"name": var.name, "size": var.size, "tls": var.tls}
    return {
        "symbol": var.symbol,
        "name": var.name,
        "size": var.size,
        "offset": var.offset,
        "secOffset": var.section_offset,
        "tls": var.tls,
        # Resident size is not measured: the declared size (0 for TLS, as MALT writes for thread-locals).
        "usedSize": 0 if var.tls else var.size,
        "binaryFile": var.binary,
    }


def _domains_json(profile: MaltProfile) -> dict[str, Any]:
    def counters(c: int, mmap: int) -> dict[str, int]:
        return {"c": c, "pyObj": 0, "pyMem": 0, "pyRaw": 0, "mmap": mmap}

    t = profile.totals
    at_peak = sum(s.stats.global_peak for s in profile.stacks)
    return {
        "counters": counters(t.alloc_count, t.mmap_count),
        "mem": counters(t.alloc_bytes, t.mmap_bytes),
        "localPeak": counters(t.peak_bytes, 0),
        "atGlobalPeak": counters(at_peak, 0),
    }


def profile_to_json(
    profile: MaltProfile,
    *,
    format_version: FormatVersion = "1.1",
    resolve: SiteResolver | None = None,
    function_frame: bool = True,
) -> dict[str, Any]:
    """The whole profile as MALT's JSON document (a dict, in MALT's key order)."""
    if format_version not in FORMAT_VERSIONS:
        raise ValueError(f"format_version must be one of {', '.join(FORMAT_VERSIONS)}, got {format_version!r}")
    version: FormatVersion = format_version
    r = profile.run
    run: dict[str, Any] = {
        "formatVersion": version,
        "tool": r.tool,
        "date": r.date,
        "runtime": r.runtime,
        "exe": r.exe,
        "command": r.command,
        "hostname": r.hostname,
        "allocator": r.allocator,
    }
    if version == "1.6":
        run["allocatorWrappers"] = []

    stack_ids: dict[StackKey, str] = {}
    stats = []
    for i, s in enumerate(profile.stacks):
        sid = _hex(s.stack_id if s.stack_id is not None else i + 1)
        stack_ids.setdefault(s.key, sid)
        stats.append(
            {
                "stack": [_hex(a) for a in _stack_json(profile, s.key, function_frame)],
                "stackId": sid,
                "infos": s.stats.to_json(version),
            }
        )
    stacks: dict[str, Any] = {"stats": stats}
    if version == "1.6":
        stacks["count"] = len(stats)

    g = profile.globals
    doc: dict[str, Any] = {
        "run": run,
        "config": _config_json(profile.config, version),
        "stacks": stacks,
        "sites": build_sites(profile, resolve, version=version, function_frame=function_frame),
        "timeline": {
            "memoryTimeline": _timeline_json(profile.memory_timeline, stack_ids, version, with_callsite=True),
            "systemTimeline": _timeline_json(profile.system_timeline, stack_ids, version, with_callsite=False),
            "memoryBandwidth": _timeline_json(profile.memory_bandwidth, stack_ids, version, with_callsite=False),
        },
        "scatter": {
            "sizeOverTime": profile.size_over_time.to_json(),
            "lifetimeOverSize": profile.lifetime_over_size.to_json(),
        },
        "threads": [_thread_json(t, version) for t in profile.threads],
        "memStats": {
            "sizeMap": {str(size): n for size, n in sorted(profile.size_map.items())},
            "reallocJump": [
                {"oldSize": old, "newSize": new, "count": n} for (old, new), n in sorted(profile.realloc_jump.items())
            ],
            "globalVariables": {
                path: [_global_variable_json(v, version) for v in variables]
                for path, variables in profile.global_variables.items()
            },
        },
        "globals": {
            "ticksPerSecond": g.ticks_per_second,
            "totalMemory": g.total_memory,
            "freeMemoryAtStart": g.free_memory_at_start,
            "cachedMemoryAtStart": g.cached_memory_at_start,
            "maxThreadCount": g.max_thread_count,
        },
        "leaks": [
            {
                "stack": [_hex(a) for a in _stack_json(profile, lk.key, function_frame)],
                "count": lk.count,
                "memory": lk.memory,
            }
            for lk in profile.leaks
        ],
    }
    if version == "1.6":
        doc["domains"] = _domains_json(profile)
    return doc


def write_malt(
    out: TextIO,
    profile: MaltProfile,
    *,
    format_version: FormatVersion = "1.1",
    resolve: SiteResolver | None = None,
    function_frame: bool = True,
    indent: bool = True,
) -> None:
    """Write the profile as MALT JSON (`formatVersion` 1.1 by default; 1.6 for MALT's current reader).

    `resolve` names the stacks' addresses that have no frames in the model (Symbolizer.resolver gives one);
    `function_frame=False` leaves out the allocation function's own frame at the top of each stack."""
    doc = profile_to_json(profile, format_version=format_version, resolve=resolve, function_frame=function_frame)
    json.dump(doc, out, indent="\t" if indent else None, separators=None if indent else (",", ":"))
    out.write("\n")
