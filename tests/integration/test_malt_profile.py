"""The MALT profile of a program with known allocator calls (programs/malt_known.c), under `heapscope run`.

Every expected number comes from the program's source: the lines marked ALLOC_100, ZERO, ... in it. The
profile must validate against the schema written from the seed (tests/malt_schema.json), in both formats,
and hold the cross-checks: stacks' alloc sums equal sizeMap's bytes, sizeMap's counts equal the number of
allocations, and the leaks equal the final snapshot of the Massif profile written in the same run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from tests.support.harness import PROGRAMS, Completed
from tests.support.malt_reader import Profile
from tests.support.massif_reader import parse_massif

pytestmark = pytest.mark.integration

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "malt_schema.json").read_text())
SOURCE = PROGRAMS / "malt_known.c"


def marked_line(marker: str) -> int:
    """The source line carrying `/* MARKER...` in malt_known.c."""
    for number, text in enumerate(SOURCE.read_text().splitlines(), start=1):
        if re.search(rf"/\* {marker}\b", text):
            return number
    raise AssertionError(f"no line marked {marker} in {SOURCE}")


@pytest.fixture(scope="module")
def runs(build: Callable[..., Path], run_heapscope: Callable[..., Completed], tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    program = build("malt_known.c", flags=("-g", "-O0", "-fno-omit-frame-pointer", "-pthread"))
    out = {}
    for version in ("1.1", "1.6"):
        path = tmp_path_factory.mktemp("malt") / f"malt-{version}.json"
        done = run_heapscope(program, options=(f"--malt-out-file={path}", f"--malt-format={version}"))
        assert done.returncode == 0, done.stderr
        assert "MALT profile inconsistent" not in done.stderr, done.stderr
        out[version] = (Profile(json.loads(path.read_text())), done)
    return out


@pytest.fixture(scope="module")
def profile(runs) -> Profile:  # type: ignore[no-untyped-def]
    return runs["1.1"][0]


@pytest.mark.parametrize("version", ["1.1", "1.6"])
def test_validates_against_the_seed_schema(runs, version: str) -> None:  # type: ignore[no-untyped-def]
    doc = runs[version][0].doc
    assert doc["run"]["formatVersion"] == version
    jsonschema.validate(doc, SCHEMA)


def test_repeated_allocations_and_their_frees(profile: Profile) -> None:
    infos = profile.one_stack(marked_line("ALLOC_100"))
    assert infos["alloc"] == {"count": 10, "min": 100, "max": 100, "sum": 1000}
    assert infos["lifetime"]["count"] == 10  # every block freed, after a non-zero time
    assert infos["aliveReq"] == 0
    assert infos["maxAliveReq"] == 100  # one block alive at a time
    assert infos["globalPeak"] == 0  # freed long before the peak (the leaks come later)
    frees = profile.one_stack(marked_line("FREE_100"), "free")
    assert frees["free"] == {"count": 10, "min": 100, "max": 100, "sum": 1000}
    assert frees["alloc"]["count"] == 0


def test_zero_size_request(profile: Profile) -> None:
    infos = profile.one_stack(marked_line("ZERO"))
    assert infos["countZeros"] == 1
    assert infos["alloc"]["count"] == 0  # MALT counts a zero-size request only in countZeros


def test_realloc_chain(profile: Profile) -> None:
    first = profile.one_stack(marked_line("CHAIN_MALLOC"))
    grow1 = profile.one_stack(marked_line("CHAIN_GROW1"), "realloc")
    grow2 = profile.one_stack(marked_line("CHAIN_GROW2"), "realloc")
    assert first["alloc"] == {"count": 1, "min": 10, "max": 10, "sum": 10}
    assert (grow1["reallocCount"], grow1["reallocSumDelta"]) == (1, 10)
    assert (grow2["reallocCount"], grow2["reallocSumDelta"]) == (1, 20)
    assert grow2["aliveReq"] == 40
    jumps = {(j["oldSize"], j["newSize"]): j["count"] for j in profile.doc["memStats"]["reallocJump"]}
    assert jumps[(10, 20)] == 1
    assert jumps[(20, 40)] == 1


def test_leaks_by_stack(profile: Profile) -> None:
    infos = profile.one_stack(marked_line("LEAK"))
    assert infos["alloc"] == {"count": 3, "min": 1000, "max": 1000, "sum": 3000}
    assert infos["aliveReq"] == 3000
    assert infos["globalPeak"] == 3000  # the peak comes after them (the thread's blocks are freed)
    leaks = {}
    for leak in profile.doc["leaks"]:
        for address in leak["stack"]:
            loc = profile.location(address)
            if loc and loc[1] == "malt_known.c":
                leaks[loc[2]] = (leak["count"], leak["memory"])
                break
    assert leaks[marked_line("LEAK")] == (3, 3000)
    assert leaks[marked_line("CHAIN_GROW2")] == (1, 40)
    assert leaks[marked_line("ZERO")] == (1, 0)
    assert marked_line("ALLOC_100") not in leaks


def test_second_thread(profile: Profile) -> None:
    infos = profile.one_stack(marked_line("WORKER"))
    assert infos["alloc"] == {"count": 7, "min": 64, "max": 64, "sum": 448}
    threads = profile.doc["threads"]
    assert len(threads) == 2
    # The worker's own mallocs: at least its 7 x 64 B (libc may add its own on that thread).
    worker = [t for t in threads if t["stats"]["malloc"]["count"] >= 7 and t["stats"]["malloc"]["sum"] >= 448]
    assert worker, threads
    for t in threads:
        stats = t["stats"]
        assert t["cntMemOps"] == sum(s["count"] for s in stats.values())
        assert stats["malloc"]["time"] > 0  # entry to return, measured in the kernel


def test_size_map(profile: Profile) -> None:
    sizes = {int(k): v for k, v in profile.doc["memStats"]["sizeMap"].items()}
    assert sizes[100] == 10
    assert sizes[1000] == 3
    assert sizes[64] == 7
    assert sizes[0] >= 1
    assert sizes[10] >= 1 and sizes[20] >= 1 and sizes[40] >= 1


def test_global_variables(profile: Profile) -> None:
    gv = profile.doc["memStats"]["globalVariables"]
    ours = next(vs for path, vs in gv.items() if path.endswith("/malt_known"))
    by_name = {v["name"]: v for v in ours}
    assert (by_name["big_table"]["size"], by_name["big_table"]["tls"]) == (400, False)
    assert (by_name["small_table"]["size"], by_name["small_table"]["tls"]) == (16, False)
    assert (by_name["per_thread_total"]["size"], by_name["per_thread_total"]["tls"]) == (8, True)


def test_timelines_and_scatter(profile: Profile) -> None:
    timeline = profile.doc["timeline"]
    assert set(timeline) >= {"memoryTimeline", "systemTimeline", "memoryBandwidth"}
    assert timeline["memoryTimeline"]["values"], "no memory timeline points"
    assert profile.doc["globals"]["ticksPerSecond"] == 1_000_000_000
    points = profile.doc["scatter"]["sizeOverTime"]["points"]
    assert sum(p["v"] for p in points) == sum(profile.doc["memStats"]["sizeMap"].values())


def test_cross_checks(runs) -> None:  # type: ignore[no-untyped-def]
    prof, done = runs["1.1"]
    doc = prof.doc
    stats = [s["infos"] for s in doc["stacks"]["stats"]]
    sizes = {int(k): v for k, v in doc["memStats"]["sizeMap"].items()}
    # The sum of the stacks' alloc.sum equals the allocated bytes (sizeMap: every request, by size).
    assert sum(s["alloc"]["sum"] for s in stats) == sum(size * n for size, n in sizes.items())
    # sizeMap counts sum to the number of allocations.
    assert sum(sizes.values()) == sum(s["alloc"]["count"] + s["countZeros"] for s in stats)
    # The leaks equal the final snapshot of the Massif profile of the same run.
    final = parse_massif(done.massif_text).snapshots[-1]
    assert sum(leak["memory"] for leak in doc["leaks"]) == final.heap_B
