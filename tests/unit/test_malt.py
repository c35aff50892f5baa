"""MALT profile model (agent.model.malt), its JSON writer (agent.export.malt) and global variables
(agent.symbols.globalvars).

Judges: the JSON schema written from MALT's documented format (tests/malt_schema.json), the format document's own
examples field by field, and for global variables a compiled C program read back with `nm -S` and `readelf`.
No root needed.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent.export.malt import profile_to_json, write_malt
from agent.model.malt import (
    BANDWIDTH_FIELDS,
    MALT_FUNCTIONS,
    MEMORY_FIELDS,
    SYSTEM_FIELDS,
    CountMinMaxSum,
    GlobalVariable,
    MaltGlobals,
    MaltLeak,
    MaltProfile,
    MaltRun,
    MaltStack,
    MaltStackStats,
    MaltThread,
    MaltTotals,
    ScatterAxis,
    ScatterChart,
    StackKey,
    ThreadFunctionStats,
    TimelineBinner,
    check_consistency,
    log2_bin,
)
from agent.model.maps import Mapping
from agent.model.stack import Frame
from agent.symbols.elf import open_elf
from agent.symbols.globalvars import global_variables, variables_of
from agent.symbols.symbolizer import Symbolizer
from tests.support.capability import require
from tests.support.reference import group_leaks

SCHEMA = json.loads((Path(__file__).parents[1] / "malt_schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


# ----------------------------------------------------------------------------------------------------------
# A synthetic run: the events of a small program, replayed through MALT's rules to fill the model.

MALLOC_AT = 0x7F0000010000
FREE_AT = 0x7F0000010800
CALLOC_AT = 0x7F0000011000
REALLOC_AT = 0x7F0000011800


class Replay:
    """Applies MALT's per-stack rules (CallStackInfo) to a list of calls, the way the profiler must."""

    def __init__(self) -> None:
        self.stats: dict[StackKey, MaltStackStats] = {}
        self.live: dict[int, tuple[StackKey, int, int]] = {}  # ptr -> (alloc stack, size, time)
        self.totals = MaltTotals()
        self.size_map: dict[int, int] = {}
        self.realloc_jump: dict[tuple[int, int], int] = {}
        self.threads: dict[int, MaltThread] = {}
        self.live_bytes = 0
        self.next_ptr = 0x1000

    def _st(self, key: StackKey) -> MaltStackStats:
        return self.stats.setdefault(key, MaltStackStats())

    def _thread(self, tid: int, fn: str, size: int) -> None:
        th = self.threads.setdefault(tid, MaltThread(tid))
        s = th.stats.setdefault(fn, ThreadFunctionStats())
        s.count += 1
        s.sum += size
        s.time += 10

    def alloc(self, key: StackKey, size: int, t: int, tid: int = 1) -> int:
        st = self._st(key)
        if size == 0:
            st.count_zeros += 1
        else:
            st.alloc.add(size)
        st.alive_req += size
        st.max_alive_req = max(st.max_alive_req, st.alive_req)
        self.totals.alloc_count += 1
        self.totals.alloc_bytes += size
        self.size_map[size] = self.size_map.get(size, 0) + 1
        self.live_bytes += size
        if self.live_bytes > self.totals.peak_bytes:
            self.totals.peak_bytes = self.live_bytes
            for s in self.stats.values():
                s.global_peak = s.alive_req
        self._thread(tid, key.function, size)
        ptr = self.next_ptr
        self.next_ptr += 0x100
        self.live[ptr] = (key, size, t)
        return ptr

    def free(self, key: StackKey, ptr: int, t: int, tid: int = 1) -> None:
        owner, size, t0 = self.live.pop(ptr)
        if size:
            self._st(key).free.add(size)
        o = self._st(owner)
        o.alive_req -= size
        if t - t0:
            o.lifetime.add(t - t0)
        self.totals.free_count += 1
        self.totals.free_bytes += size
        self.live_bytes -= size
        self._thread(tid, "free", 0)

    def realloc(self, key: StackKey, ptr: int, new: int, t: int) -> int:
        old = self.live[ptr][1]
        self._st(key).realloc_count += 1
        self._st(key).realloc_sum_delta += new - old
        self.realloc_jump[(old, new)] = self.realloc_jump.get((old, new), 0) + 1
        self.free(key, ptr, t)
        self.threads[1].stats["free"].count -= 1  # counted as one realloc call, not a free
        self.threads[1].stats["free"].time -= 10
        return self.alloc(key, new, t)


SITE_A = StackKey((0x401234, 0x401500, 0x7F00000290AA), "malloc")
SITE_A_FREE = StackKey((0x401260, 0x401500, 0x7F00000290AA), "free")
SITE_B = StackKey((0x401300, 0x401500, 0x7F00000290AA), "calloc")
SITE_C = StackKey((0x401400, 0x401500, 0x7F00000290AA), "realloc")
SITE_ZERO = StackKey((0x401450, 0x401500, 0x7F00000290AA), "malloc")


def build_profile(variables: dict[str, list[GlobalVariable]] | None = None) -> MaltProfile:
    r = Replay()
    a1 = r.alloc(SITE_A, 16, 100)
    a2 = r.alloc(SITE_A, 64, 150)
    r.free(SITE_A_FREE, a1, 400)
    b = r.alloc(SITE_B, 4096, 500, tid=2)
    c = r.alloc(SITE_C, 0 + 32, 600)
    c = r.realloc(SITE_C, c, 100, 700)
    r.alloc(SITE_ZERO, 0, 800)
    r.free(SITE_A_FREE, b, 900)
    del a2, c  # leaked on purpose
    mem = TimelineBinner(MEMORY_FIELDS, points=8)
    bw = TimelineBinner(BANDWIDTH_FIELDS, points=8, bandwidth=True)
    sysl = TimelineBinner(SYSTEM_FIELDS, points=8)
    for t, live, site in ((100, 16, SITE_A), (150, 80, SITE_A), (400, 64, SITE_A_FREE), (500, 4160, SITE_B)):
        mem.push(t, [live, 1 << 20, 1 << 22, 4096, 2], site)
        bw.push(t, [live, 1, 0, 0])
        sysl.push(t, [1 << 30, 1 << 29, 0])
    sot = ScatterChart.size_over_time()
    los = ScatterChart.lifetime_over_size()
    sot.add(100, 16)
    sot.add(500, 4096)
    los.add(16, 300)
    stacks = [MaltStack(k, st) for k, st in r.stats.items()]
    leaks = group_leaks((key, size) for key, size, _ in r.live.values())
    return MaltProfile(
        run=MaltRun("prog", "./prog --flag", "host", "/usr/lib/x86_64-linux-gnu/libc.so.6", "2024-05-01 12:30", 1000),
        globals=MaltGlobals(ticks_per_second=1_000_000_000, total_memory=1 << 34, max_thread_count=2),
        totals=r.totals,
        stacks=stacks,
        function_addresses={"malloc": MALLOC_AT, "free": FREE_AT, "calloc": CALLOC_AT, "realloc": REALLOC_AT},
        mappings=(Mapping(0x400000, 0x402000, 0, "/tmp/prog"),),
        size_map=r.size_map,
        realloc_jump=r.realloc_jump,
        global_variables=variables or {},
        threads=list(r.threads.values()),
        memory_timeline=mem.series(),
        memory_bandwidth=bw.series(),
        system_timeline=sysl.series(),
        size_over_time=sot,
        lifetime_over_size=los,
        leaks=leaks,
    )


def dump(profile: MaltProfile, version: str = "1.1", **kw: Any) -> dict[str, Any]:
    out = io.StringIO()
    write_malt(out, profile, format_version=version, **kw)  # type: ignore[arg-type]
    return json.loads(out.getvalue())


def strip_json5(text: str) -> Any:
    """The seed's examples are json5: drop comments, trailing commas and `...` placeholders."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r",(\s*[}\]])", r"\1", text)
    return json.loads(text)


# ----------------------------------------------------------------------------------------------------------
# Counters


def test_count_min_max_sum_add_and_merge() -> None:
    a = CountMinMaxSum()
    a.add(64)
    a.add(16, times=2)
    assert a.to_json() == {"count": 3, "min": 16, "max": 64, "sum": 96}
    b = CountMinMaxSum()
    b.merge(a)
    b.merge(CountMinMaxSum())
    b.add(128)
    assert b.to_json() == {"count": 4, "min": 16, "max": 128, "sum": 224}
    assert a.problems("x") == [] and b.problems("x") == []


def test_count_min_max_sum_problems() -> None:
    assert CountMinMaxSum(0, 0, 0, 5).problems("free")  # nothing counted but a sum
    assert CountMinMaxSum(2, 10, 20, 50).problems("alloc")  # sum above count * max
    assert CountMinMaxSum(2, 30, 20, 50).problems("alloc")  # min above max
    assert CountMinMaxSum(1, -1, 0, 0).problems("alloc")


# ----------------------------------------------------------------------------------------------------------
# Schema


@pytest.mark.parametrize("version", ["1.1", "1.6"])
def test_synthetic_profile_validates(version: str) -> None:
    doc = dump(build_profile(), version)
    VALIDATOR.validate(doc)
    assert doc["run"]["formatVersion"] == version


def test_schema_rejects_a_missing_section_or_field() -> None:
    doc = dump(build_profile())
    for section in ("run", "stacks", "sites", "timeline", "scatter", "threads", "memStats", "globals", "leaks"):
        broken = dict(doc)
        del broken[section]
        assert not VALIDATOR.is_valid(broken), section
    broken = json.loads(json.dumps(doc))
    del broken["stacks"]["stats"][0]["infos"]["lifetime"]
    assert not VALIDATOR.is_valid(broken)
    broken = json.loads(json.dumps(doc))
    broken["sites"]["strings"][1] = "root"
    assert not VALIDATOR.is_valid(broken)


def test_schema_requires_the_16_additions_only_for_16() -> None:
    doc11 = dump(build_profile(), "1.1")
    assert "domains" not in doc11
    assert "mmap" not in doc11["stacks"]["stats"][0]["infos"]
    doc11["run"]["formatVersion"] = "1.6"  # a 1.1 body announced as 1.6 is not what MALT 1.6 reads
    errors = {e.message for e in VALIDATOR.iter_errors(doc11)}
    assert any("domains" in m for m in errors)
    assert any("mmap" in m for m in errors)
    assert any("count" in m for m in errors)


def test_format_16_writes_what_the_reader_requires() -> None:
    doc = dump(build_profile(), "1.6")
    assert doc["run"]["formatVersion"] == "1.6" and doc["run"]["allocatorWrappers"] == []
    assert set(doc["domains"]) >= {"counters", "mem"}
    assert doc["domains"]["counters"]["c"] == 6 and doc["domains"]["mem"]["c"] == 16 + 64 + 4096 + 32 + 100
    assert doc["stacks"]["count"] == len(doc["stacks"]["stats"])
    for s in doc["stacks"]["stats"]:
        assert s["infos"]["mmap"] == s["infos"]["munmap"] == {"count": 0, "min": 0, "max": 0, "sum": 0}
    for name, fields in (
        ("memoryTimeline", MEMORY_FIELDS),
        ("systemTimeline", SYSTEM_FIELDS),
        ("memoryBandwidth", BANDWIDTH_FIELDS),
    ):
        tl = doc["timeline"][name]
        assert tl["fields"] == list(fields)
        assert len(tl["callsite"]) == len(tl["values"])
    assert all(m["aslrOffset"] == 2**64 - 1 for m in doc["sites"]["map"])
    assert doc["threads"][0]["stackMem"]["timeprofiler"]["peakTimesteamp"] == 0
    assert {"max-stack", "addr2line", "sampling", "c", "trace", "tools"} <= set(doc["config"])


def test_unknown_format_version_is_refused() -> None:
    with pytest.raises(ValueError, match="format_version"):
        profile_to_json(build_profile(), format_version="2.0")  # type: ignore[arg-type]


def test_unknown_allocation_function_is_refused() -> None:
    with pytest.raises(ValueError, match="allocation function"):
        StackKey((1,), "operator new")


# ----------------------------------------------------------------------------------------------------------
# Field by field against the seed's examples

SEED_STACK_INFOS = """{
    "countZeros": 0, "maxAliveReq": 16, "aliveReq": 0,
    "alloc": {"count": 1, "min": 16, "max": 64, "sum": 80},
    "free": {"count": 0, "min": 0, "max": 0, "sum": 0},
    "lifetime": {"count": 2, "min": 24423, "max": 44423, "sum": 68846},
    "globalPeak": 0, "reallocCount": 0, "reallocSumDelta": 0
}"""


def test_stack_infos_match_the_seed_example() -> None:
    seed = strip_json5(SEED_STACK_INFOS)
    st = MaltStackStats(
        alloc=CountMinMaxSum(1, 16, 64, 80),
        lifetime=CountMinMaxSum(2, 24423, 44423, 68846),
        max_alive_req=16,
    )
    written = st.to_json("1.1")
    assert written == seed
    assert list(written) == list(seed)  # and in the seed's order


def test_stack_entry_shape_and_function_frame() -> None:
    p = build_profile()
    doc = dump(p)
    first = doc["stacks"]["stats"][0]
    assert list(first) == ["stack", "stackId", "infos"]
    key = p.stacks[0].key
    # The leaf frame is the allocation function itself, then the caller's return addresses, innermost first.
    assert first["stack"] == [f"0x{p.function_addresses[key.function]:x}"] + [f"0x{a:x}" for a in key.addresses]
    without = dump(p, function_frame=False)["stacks"]["stats"][0]["stack"]
    assert without == [f"0x{a:x}" for a in key.addresses]
    # malloc and free called from the same function are separate stacks with distinct leaves.
    leaves = {s["stack"][0] for s in doc["stacks"]["stats"]}
    assert {f"0x{MALLOC_AT:x}", f"0x{FREE_AT:x}", f"0x{CALLOC_AT:x}", f"0x{REALLOC_AT:x}"} <= leaves
    instr = doc["sites"]["instr"]
    strings = doc["sites"]["strings"]
    assert strings[instr[f"0x{FREE_AT:x}"]["function"]] == "free"
    assert strings[instr[f"0x{MALLOC_AT:x}"]["binary"]] == p.run.allocator


def test_run_and_globals_match_the_seed_examples() -> None:
    seed_run = strip_json5(
        """{"formatVersion":"1.1", "tool":"malt-0.0.0", "date":"2014-11-01 18:56", "runtime":416204055,
        "exe":"simple-case-finstr-linked", "command":"./simple-case-finstr-linked", "hostname":"my-host",
        "allocator": "/usr/lib/libc.so.2.6"}"""
    )
    seed_globals = strip_json5(
        """{"ticksPerSecond": 3411169769, "totalMemory": 16798138368, "freeMemoryAtStart": 4573065216,
        "cachedMemoryAtStart": 8713916416, "maxThreadCount": 8}"""
    )
    p = build_profile()
    p.run = MaltRun(
        seed_run["exe"],
        seed_run["command"],
        seed_run["hostname"],
        seed_run["allocator"],
        seed_run["date"],
        seed_run["runtime"],
        tool=seed_run["tool"],
    )
    p.globals = MaltGlobals(3411169769, 16798138368, 4573065216, 8713916416, 8)
    doc = dump(p)
    assert doc["run"] == seed_run
    assert doc["globals"] == seed_globals
    assert list(doc)[:10] == [
        "run",
        "config",
        "stacks",
        "sites",
        "timeline",
        "scatter",
        "threads",
        "memStats",
        "globals",
        "leaks",
    ]


def test_mem_stats_match_the_seed_examples() -> None:
    p = build_profile()
    p.size_map = {4: 1, 16: 13, 1048576: 1}
    p.realloc_jump = {(0, 32): 7}
    p.global_variables = {
        "/bin/simple-case-finstr": [GlobalVariable("gblString", 25, False, ".data", "gblString", 0x4010, 0x3000, "x")]
    }
    ms = dump(p)["memStats"]
    assert ms["sizeMap"] == {"4": 1, "16": 13, "1048576": 1}
    assert ms["reallocJump"] == [{"oldSize": 0, "newSize": 32, "count": 7}]
    assert ms["globalVariables"] == {"/bin/simple-case-finstr": [{"name": "gblString", "size": 25, "tls": False}]}
    ms16 = dump(p, "1.6")["memStats"]["globalVariables"]["/bin/simple-case-finstr"][0]
    assert ms16 == {
        "symbol": "gblString",
        "name": "gblString",
        "size": 25,
        "offset": 0x4010,
        "secOffset": 0x3000,
        "tls": False,
        "usedSize": 25,
        "binaryFile": "x",
    }


def test_threads_match_the_seed_example() -> None:
    seed = strip_json5(
        """{"malloc": {"count": 6, "sum": 1309, "time": 33498},
        "posix_memalign": {"count": 0, "sum": 0, "time": 0}, "aligned_alloc": {"count": 0, "sum": 0, "time": 0},
        "memalign": {"count": 0, "sum": 0, "time": 0}, "valloc": {"count": 0, "sum": 0, "time": 0},
        "pvalloc": {"count": 0, "sum": 0, "time": 0}, "free": {"count": 3, "sum": 0, "time": 0},
        "calloc": {"count": 0, "sum": 0, "time": 0}, "realloc": {"count": 1, "sum": 32, "time": 475}}"""
    )
    p = build_profile()
    p.threads = [
        MaltThread(
            7,
            {
                "malloc": ThreadFunctionStats(6, 1309, 33498),
                "free": ThreadFunctionStats(3, 0, 0),
                "realloc": ThreadFunctionStats(1, 32, 475),
            },
        )
    ]
    th = dump(p)["threads"][0]
    assert th["stats"] == seed and list(th["stats"]) == list(seed) == list(MALT_FUNCTIONS)
    assert th["cntMemOps"] == 10  # the seed: "number of memory management operations"
    assert set(th["stackMem"]) == {"size", "stack", "mem", "total", "timeprofiler"}


def test_leaks_and_sites_match_the_seed_layout() -> None:
    p = build_profile()
    doc = dump(p)

    # Still allocated at exit: the 64-byte malloc, the realloc'ed block and the malloc(0), largest first.
    def hexes(fn_at: int, key: StackKey) -> list[str]:
        return [f"0x{a:x}" for a in (fn_at, *key.addresses)]

    assert doc["leaks"] == [
        {"stack": hexes(REALLOC_AT, SITE_C), "count": 1, "memory": 100},
        {"stack": hexes(MALLOC_AT, SITE_A), "count": 1, "memory": 64},
        {"stack": hexes(MALLOC_AT, SITE_ZERO), "count": 1, "memory": 0},
    ]
    sites = doc["sites"]
    assert sites["strings"][:2] == ["??", "[0x1]"]
    assert sites["instr"]["0x1"] == {"function": 1}
    assert sites["map"] == [{"lower": "0x400000", "upper": "0x402000", "offset": "0x0", "file": "/tmp/prog"}]
    # Every address of every stack and leak has an instr entry.
    used = {a for s in doc["stacks"]["stats"] for a in s["stack"]} | {a for lk in doc["leaks"] for a in lk["stack"]}
    assert used <= set(sites["instr"])


def test_memory_timeline_matches_the_seed_layout() -> None:
    doc = dump(build_profile())
    tl = doc["timeline"]["memoryTimeline"]
    assert list(tl) == ["start", "perPoints", "peak", "values", "callsite"]
    assert tl["start"] == 100 and tl["peak"] == [4160, 1 << 20, 1 << 22, 4096, 2]
    assert len(tl["callsite"]) == len(tl["values"]) and all(len(v) == 5 for v in tl["values"])
    assert list(doc["timeline"]["systemTimeline"]) == ["start", "perPoints", "peak", "values"]
    assert list(doc["timeline"]["memoryBandwidth"]) == ["start", "perPoints", "peak", "values"]
    # A callsite names the stack that set the interval's maximum by its stackId; an empty interval is (nil).
    ids = {s["stackId"] for s in doc["stacks"]["stats"]}
    assert set(tl["callsite"]) <= ids | {"(nil)"}


def test_scatter_matches_the_seed_example_point() -> None:
    chart = ScatterChart(ScatterAxis(log=False, max=67108864), ScatterAxis(log=True))
    chart.add(13631488 + 5, 1)
    out = chart.to_json()
    assert out["points"] == [{"x": 13631488, "y": 1, "v": 1}]
    assert out["infos"]["xAxis"] == {"max": 67108864, "size": 64, "log": False}
    assert out["infos"]["yAxis"]["log"] is True and out["infos"]["yAxis"]["size"] == 64


# ----------------------------------------------------------------------------------------------------------
# Timeline binning


def test_timeline_rebins_by_doubling_for_any_run_length() -> None:
    for n in (1, 511, 512, 513, 5000, 100_000):
        b = TimelineBinner(("v",), points=512)
        for t in range(n):
            b.push(t, [t])
        s = b.series()
        expect = 1
        while (n - 1) >= 512 * expect:
            expect *= 2
        assert s.per_points == expect, n
        assert len(s.values) <= 512
        # Each interval keeps its maximum: the last sample of the interval here.
        assert s.values[0] == (min(expect, n) - 1,)
        assert s.values[-1] == (n - 1,) and s.peak == (n - 1,)


@pytest.mark.parametrize("bandwidth", [False, True])
def test_timeline_widened_in_one_pass_is_the_timeline_doubled_as_often(bandwidth: bool) -> None:
    """A sample far beyond the last interval widens them in one pass; the same samples with each doubling done
    one at a time give the same intervals, maxima (or sums) and callsites, None callsites among them."""
    rng = random.Random(7)
    for _ in range(200):
        samples, t = [], 0
        for _ in range(rng.randrange(1, 60)):
            t += rng.choice((0, 1, 3, rng.randrange(1, 50), rng.randrange(1, 5000)))
            samples.append((t, [rng.randrange(5), rng.randrange(100)], rng.choice((None, rng.randrange(9)))))
        one_pass = TimelineBinner(("a", "b"), points=8, start=0, bandwidth=bandwidth)
        for time_, values, site in samples:
            one_pass.push(time_, values, callsite=site)
        stepwise = TimelineBinner(("a", "b"), points=8, start=0, bandwidth=bandwidth)
        for time_, values, site in samples:
            while time_ // stepwise.per_points >= stepwise.points:
                stepwise._widen(2)
            stepwise.push(time_, values, callsite=site)
        assert one_pass.series() == stepwise.series(), samples


def test_timeline_bandwidth_sums_and_keeps_totals() -> None:
    b = TimelineBinner(BANDWIDTH_FIELDS, points=16, bandwidth=True, start=0)
    total = [0, 0, 0, 0]
    for t in range(0, 1000, 7):
        v = [t % 100, 1, t % 13, t % 2]
        total = [a + x for a, x in zip(total, v, strict=True)]
        b.push(t, v)
    s = b.series()
    assert [sum(v[i] for v in s.values) for i in range(4)] == total
    assert s.peak == tuple(max(v[i] for v in s.values) for i in range(4))


def test_timeline_gaps_repeat_state_and_zero_bandwidth() -> None:
    state = TimelineBinner(("v",), points=8, start=0, per_points=10)
    bw = TimelineBinner(("v",), points=8, start=0, per_points=10, bandwidth=True)
    for t, v in ((0, 5), (5, 9), (45, 2)):
        state.push(t, [v], callsite=t + 1)
        bw.push(t, [v])
    assert state.series().values == [(9,), (9,), (9,), (9,), (2,)]
    assert state.series().callsites == [6, None, None, None, 46]  # 6: the sample that set the max
    assert bw.series().values == [(14,), (0,), (0,), (0,), (2,)]


def test_timeline_rejects_bad_samples() -> None:
    b = TimelineBinner(("a", "b"), start=10)
    with pytest.raises(ValueError):
        b.push(5, [1, 2])
    b.push(20, [1, 2])
    with pytest.raises(ValueError):
        b.push(19, [1, 2])
    with pytest.raises(ValueError):
        b.push(30, [1])


# ----------------------------------------------------------------------------------------------------------
# Scatter


def test_log2_bins() -> None:
    assert [log2_bin(v) for v in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]


def test_scatter_linear_axis_doubles_and_keeps_counts() -> None:
    chart = ScatterChart(ScatterAxis(log=False, size=4), ScatterAxis(log=True, size=8))
    for t in range(100):
        chart.add(t, 1 << (t % 5))
    assert sum(chart.points.values()) == 100
    assert chart.x.max == 128  # 4 -> 8 -> ... -> 128: the first power-of-two multiple above 99
    assert max(bx for bx, _ in chart.points) < 4
    out = chart.to_json()
    assert {p["y"] for p in out["points"]} == {1, 2, 4, 8, 16}
    assert {p["x"] for p in out["points"]} <= {0, 32, 64, 96}


def test_scatter_kernel_bins() -> None:
    chart = ScatterChart.lifetime_over_size()
    chart.add_log2_bins(4, 10, 3)
    chart.add_log2_bins(70, 2, 1)  # beyond the axis: clamped to the last bin
    assert chart.to_json()["points"] == [{"x": 16, "y": 1024, "v": 3}, {"x": 2**63, "y": 4, "v": 1}]


# ----------------------------------------------------------------------------------------------------------
# Cross-checks


def test_consistent_profile_has_no_problems() -> None:
    p = build_profile()
    assert check_consistency(p) == []
    assert sum(s.stats.alloc.sum for s in p.stacks) == p.totals.alloc_bytes == 16 + 64 + 4096 + 32 + 100
    assert sum(p.size_map.values()) == p.totals.alloc_count == 6  # the zero-size malloc included


def test_consistency_catches_a_wrong_alloc_sum() -> None:
    p = build_profile()
    p.stacks[0].stats.alloc.sum += 1
    p.stacks[0].stats.alloc.max += 1
    problems = check_consistency(p)
    assert any("alloc.sum add up to" in m for m in problems)


def test_consistency_catches_a_wrong_size_map() -> None:
    p = build_profile()
    p.size_map[16] += 1
    assert any("sizeMap counts add up to 7" in m for m in check_consistency(p))
    p = build_profile()
    del p.size_map[0]  # the zero-size malloc must be in sizeMap too
    assert any("sizeMap" in m for m in check_consistency(p))


def test_consistency_catches_lost_allocations_and_bad_stacks() -> None:
    p = build_profile()
    p.stacks.pop()  # a stack missing from the map: allocations no longer add up
    assert any("alloc.count + countZeros" in m for m in check_consistency(p))
    p = build_profile()
    p.stacks[0].stats.alive_req = p.stacks[0].stats.max_alive_req + 1
    assert any("aliveReq" in m for m in check_consistency(p))
    p = build_profile()
    p.stacks[0].stats.lifetime = CountMinMaxSum(0, 0, 0, 9)
    assert any("lifetime" in m for m in check_consistency(p))
    p = build_profile()
    p.leaks = p.leaks[1:]
    assert any("leaks add up to" in m for m in check_consistency(p))


def test_group_leaks() -> None:
    a, b = StackKey((1, 2)), StackKey((3,), "calloc")
    leaks = group_leaks([(a, 10), (b, 100), (a, 30)])
    assert leaks == [MaltLeak(b, 1, 100), MaltLeak(a, 2, 40)]


# ----------------------------------------------------------------------------------------------------------
# Sites


def test_sites_use_frames_then_the_resolver() -> None:
    p = build_profile()
    p.stacks[0].frames = (
        Frame(SITE_A.addresses[0] - 1, "inner", "a.h", 3, "/tmp/prog", path="/src/a.h", inlined=True),
        Frame(SITE_A.addresses[0] - 1, "outer", "a.c", 10, "/tmp/prog", path="/src/a.c"),
        Frame(SITE_A.addresses[1] - 1, "main", "a.c", 20, "/tmp/prog", path="/src/a.c"),
        Frame(SITE_A.addresses[2] - 1, None, None, None, "/lib/libc.so.6"),
    )
    asked: list[int] = []

    def resolve(addr: int) -> list[Frame]:
        asked.append(addr)
        return [Frame(addr - 1, "resolved", "r.c", 7, "/tmp/prog", path="/src/r.c")]

    doc = dump(p, resolve=resolve)
    strings, instr = doc["sites"]["strings"], doc["sites"]["instr"]

    def named(addr: int) -> dict[str, Any]:
        e = instr[f"0x{addr:x}"]
        return {k: (strings[v] if k != "line" else v) for k, v in e.items()}

    # An inlined call: the innermost function and its location, as addr2line names an address.
    assert named(SITE_A.addresses[0]) == {"file": "/src/a.h", "function": "inner", "line": 3, "binary": "/tmp/prog"}
    assert named(SITE_A.addresses[2]) == {"function": "??", "binary": "/lib/libc.so.6"}
    assert set(asked) == {a for s in p.stacks for a in s.key.addresses} - set(SITE_A.addresses)
    assert named(SITE_B.addresses[0]) == {"file": "/src/r.c", "function": "resolved", "line": 7, "binary": "/tmp/prog"}
    assert len(strings) == len(set(strings))  # each string once


def test_sites_without_resolver_are_unknown() -> None:
    doc = dump(build_profile())
    assert doc["sites"]["instr"][f"0x{SITE_B.addresses[0]:x}"] == {"function": 0}


# ----------------------------------------------------------------------------------------------------------
# Global variables and the symbolizer, on a compiled program

GLOBALS_C = r"""
int big_array[100];                     /* .bss, 400 bytes */
int initialised[4] = {1, 2, 3, 4};      /* .data, 16 bytes */
static char local_buffer[37];           /* .bss, local */
__thread int tls_counter;               /* .tbss, 4 bytes */
__thread long tls_initialised = 5;      /* .tdata, 8 bytes */
const int read_only = 3;                /* .rodata: not a global variable for MALT */

int use(int i) { local_buffer[i] = (char)i; return big_array[i] + initialised[i % 4] + tls_counter
                 + (int)tls_initialised + read_only; }

int main(int argc, char **argv) { (void)argv; return use(argc); }
"""

EXPECTED = {
    "big_array": (400, ".bss", False),
    "initialised": (16, ".data", False),
    "local_buffer": (37, ".bss", False),
    "tls_counter": (4, ".tbss", True),
    "tls_initialised": (8, ".tdata", True),
}


@pytest.fixture(scope="module")
def globals_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("gcc")
    d = tmp_path_factory.mktemp("globals")
    (d / "globals.c").write_text(GLOBALS_C)
    exe = d / "globals"
    subprocess.run(["gcc", "-g", "-O0", "-no-pie", "-rdynamic", "-o", str(exe), str(d / "globals.c")], check=True)
    return exe


def nm_sizes(path: Path, dynamic: bool = False) -> dict[str, int]:
    args = ["nm", "-S", "--defined-only"] + (["-D"] if dynamic else []) + [str(path)]
    out: dict[str, int] = {}
    for line in subprocess.run(args, check=True, capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 4:
            out[parts[3]] = int(parts[1], 16)
    return out


def readelf(*args: str) -> list[str]:
    return subprocess.run(["readelf", *args], check=True, capture_output=True, text=True).stdout.splitlines()


def readelf_sections(path: Path) -> dict[str, str]:
    """Symbol -> section name, through `readelf -sW` (Ndx) and `readelf -SW` (index -> name)."""
    names: dict[int, str] = {}
    for line in readelf("-SW", str(path)):
        m = re.match(r"\s*\[\s*(\d+)\]\s+(\S+)", line)
        if m:
            names[int(m.group(1))] = m.group(2)
    out: dict[str, str] = {}
    for line in readelf("-sW", str(path)):
        parts = line.split()
        if len(parts) >= 8 and parts[6].isdigit():
            out[parts[7]] = names[int(parts[6])]
    return out


@pytest.mark.needs("gcc")
@pytest.mark.needs("nm", "readelf", "strip")
def test_global_variables_of_a_compiled_program(globals_exe: Path) -> None:
    found = {v.name: v for v in variables_of(str(globals_exe))}
    sizes = nm_sizes(globals_exe)
    sections = readelf_sections(globals_exe)
    for name, (size, section, tls) in EXPECTED.items():
        v = found[name]
        assert (v.size, v.section, v.tls) == (size, section, tls), name
        assert v.size == sizes[name] and v.section == sections[name], name  # the binutils agree
        assert v.binary == str(globals_exe)
    assert "read_only" not in found and "main" not in found and "use" not in found
    # Everything reported sits in the four sections, with the size nm gives.
    for v in found.values():
        assert v.section in {".data", ".bss", ".tdata", ".tbss"}
        assert sizes.get(v.symbol) == v.size, v.symbol
    elf = open_elf(str(globals_exe))
    assert found["initialised"].offset == elf.find_symbol("initialised")[0]  # type: ignore[index]


@pytest.mark.needs("gcc")
@pytest.mark.needs("nm", "readelf", "strip")
def test_global_variables_of_a_stripped_program_come_from_dynsym(globals_exe: Path, tmp_path: Path) -> None:
    stripped = tmp_path / "globals.stripped"
    subprocess.run(["strip", "-o", str(stripped), str(globals_exe)], check=True)
    found = {v.name: v for v in variables_of(str(stripped))}
    dyn = nm_sizes(stripped, dynamic=True)
    # -rdynamic exported the globals: the stripped file still names them, with the same sizes.
    for name in ("big_array", "initialised", "tls_counter", "tls_initialised"):
        assert found[name].size == dyn[name] == EXPECTED[name][0]
        assert found[name].tls == EXPECTED[name][2]
    assert "local_buffer" not in found  # a static symbol is gone with .symtab


@pytest.mark.needs("gcc")
def test_global_variables_skip_unreadable_objects(globals_exe: Path, tmp_path: Path) -> None:
    text = tmp_path / "not-elf"
    text.write_text("hello")
    out = global_variables({p: p for p in (str(globals_exe), str(text), str(tmp_path / "missing"))})
    assert list(out) == [str(globals_exe)]
    doc = dump(build_profile(out), "1.6")
    VALIDATOR.validate(doc)
    written = {v["name"]: v for v in doc["memStats"]["globalVariables"][str(globals_exe)]}
    assert written["big_array"]["size"] == 400 and written["tls_counter"]["tls"] is True
    assert written["tls_counter"]["usedSize"] == 0


@pytest.mark.needs("gcc")
def test_global_variables_of_a_file_opened_through_a_process_root_are_shown_by_its_own_name(
    globals_exe: Path,
) -> None:
    """A container's object is opened through /proc/PID/root and listed by the path the process gives it; the
    file's variables are read once, whatever the path."""
    through = f"/proc/{os.getpid()}/root{globals_exe}"
    mine = global_variables({str(globals_exe): str(globals_exe)})[str(globals_exe)]
    theirs = global_variables({through: "/app/globals"})
    assert list(theirs) == ["/app/globals"]
    assert {v.binary for v in theirs["/app/globals"]} == {"/app/globals"}
    assert [replace(v, binary="") for v in theirs["/app/globals"]] == [replace(v, binary="") for v in mine]
    assert variables_of(through)[0].binary == through


@pytest.mark.needs("gcc")
def test_sites_through_the_symbolizer(globals_exe: Path) -> None:
    elf = open_elf(str(globals_exe))
    seg = next(s for s in elf.segments if s.executable)
    mapping = Mapping(seg.vaddr & ~0xFFF, seg.vaddr + seg.memsz, seg.offset & ~0xFFF, str(globals_exe))
    use_at, use_size = elf.find_symbol("use")  # type: ignore[misc]
    ret = use_at + use_size // 2  # a return address inside use()
    p = build_profile()
    p.stacks = [MaltStack(StackKey((ret,)), MaltStackStats())]
    p.leaks = []
    p.totals = MaltTotals()
    p.size_map = {}
    with Symbolizer() as sym:
        doc = dump(p, resolve=sym.resolver([mapping]))
    entry = doc["sites"]["instr"][f"0x{ret:x}"]
    strings = doc["sites"]["strings"]
    assert strings[entry["function"]] == "use"
    assert strings[entry["file"]].endswith("globals.c") and entry["line"] >= 8
    assert strings[entry["binary"]] == str(globals_exe)


def test_empty_profile_validates_in_both_formats() -> None:
    p = MaltProfile(run=MaltRun("x", "x", "h", "", "2024-01-01 00:00", 0), globals=MaltGlobals(1))
    assert check_consistency(p) == []
    for version in ("1.1", "1.6"):
        VALIDATOR.validate(dump(p, version))


def test_model_and_writer_do_not_import_bcc() -> None:
    code = "import sys, agent.model.malt, agent.export.malt, agent.symbols.globalvars; sys.exit('bcc' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
