"""The pprof encoder (agent.export.pprof) and its HTTP routes, on synthetic profiles.

Every field written is decoded again and checked. The field numbers are also checked on the raw wire, without
the encoder's own declaration of the messages: protobuf's UnknownFieldSet over an empty message gives each
field's number and wire type, and the expected numbers below are those of pprof's profile.proto. `go tool pprof`
judges the same files in tests/integration/test_pprof.py.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from google.protobuf import empty_pb2, unknown_fields

from agent.export.pprof import SAMPLE_TYPES, parse_pprof, render_pprof, scale_heap_sample
from agent.model.maps import Mapping
from agent.model.stack import Frame, SiteCounts, Stack
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import PROG_MAPPING, FakeManager, FakeTarget, sample_sites

EXE = "/usr/bin/server"
LIB = "/usr/lib/libwork.so"
EXE_TEXT = Mapping(0x5555_0000_1000, 0x5555_0000_9000, 0x1000, EXE, "r-xp")
EXE_DATA = Mapping(0x5555_0000_9000, 0x5555_0000_A000, 0x9000, EXE, "rw-p")
LIB_TEXT = Mapping(0x7F00_0000_2000, 0x7F00_0000_8000, 0x2000, LIB, "r-xp", build_id="feedface")
BUILD_IDS = {EXE: "00112233445566778899aabbccddeeff00112233"}

MAIN = Frame(0x5555_0000_1100, "main", "server.c", 50, EXE, path="/src/server.c")
HANDLER = Frame(0x5555_0000_1200, "handle", "server.c", 30, EXE, path="/src/server.c")
# An inlined call at one address: the inlined function first, the function it was inlined into last.
INLINED = Frame(0x7F00_0000_2300, "grow_buffer", "buf.h", 12, LIB, path="/src/buf.h", inlined=True)
INLINER = Frame(0x7F00_0000_2300, "work", "work.c", 77, LIB, path="/src/work.c")
NO_SYMBOL = Frame(0x7F00_0000_2400, obj=LIB)  # an address of the library with no symbol
NOT_RECORDED = Frame(0, "[stack not recorded]")

BUFFER_STACK: Stack = (INLINED, INLINER, HANDLER, MAIN)
HANDLER_STACK: Stack = (HANDLER, MAIN)
UNKNOWN_STACK: Stack = (NO_SYMBOL, MAIN)
SITES: dict[Stack, SiteCounts] = {
    BUFFER_STACK: SiteCounts(
        cur_bytes=3000, cur_blocks=3, tot_bytes=5000, tot_blocks=5, freed_bytes=2000, freed_blocks=2
    ),
    HANDLER_STACK: SiteCounts(
        cur_bytes=0, cur_blocks=0, tot_bytes=640, tot_blocks=10, freed_bytes=640, freed_blocks=10
    ),
    UNKNOWN_STACK: SiteCounts(cur_bytes=96, cur_blocks=1, tot_bytes=96, tot_blocks=1),
    (NOT_RECORDED,): SiteCounts(cur_bytes=7, cur_blocks=1, tot_bytes=7, tot_blocks=1),
    (HANDLER,): SiteCounts(),  # seen once, nothing left: no sample
}
TIME_NS = 1_763_900_000_123_456_789
DURATION_NS = 42_000_000_000


def render(**kwargs: Any) -> Any:
    data = render_pprof(
        SITES,
        [LIB_TEXT, EXE_DATA, EXE_TEXT, EXE_TEXT],  # newest first, as recorded; one line seen twice
        build_ids=BUILD_IDS,
        time_ns=TIME_NS,
        duration_ns=DURATION_NS,
        comments=("pid 42: server --port 1",),
        **kwargs,
    )
    assert data[:2] == b"\x1f\x8b", "pprof files are gzip-compressed"
    return parse_pprof(data)


class Decoded:
    """The profile with its ids and string indexes resolved."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof
        self.strings = list(prof.string_table)
        self.functions = {f.id: f for f in prof.function}
        self.locations = {loc.id: loc for loc in prof.location}
        self.mappings = {m.id: m for m in prof.mapping}

    def s(self, index: int) -> str:
        return self.strings[index]

    def frames(self, sample: Any) -> list[list[tuple[str, str, int]]]:
        """Per location, leaf first: its lines as (function, file, line), innermost first."""
        out = []
        for lid in sample.location_id:
            lines = []
            for line in self.locations[lid].line:
                f = self.functions[line.function_id]
                lines.append((self.s(f.name), self.s(f.filename), line.line))
            out.append(lines)
        return out

    def sample_of(self, leaf_function: str) -> Any:
        found = [
            s
            for s in self.prof.sample
            if self.frames(s) and self.frames(s)[0] and self.frames(s)[0][0][0] == leaf_function
        ]
        assert len(found) == 1, leaf_function
        return found[0]


@pytest.fixture(scope="module")
def exact() -> Decoded:
    return Decoded(render())


def test_header_fields(exact: Decoded) -> None:
    p, s = exact.prof, exact.s
    assert exact.strings[0] == ""
    assert [(s(t.type), s(t.unit)) for t in p.sample_type] == list(SAMPLE_TYPES)
    assert list(SAMPLE_TYPES) == [
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]
    assert s(p.default_sample_type) == "inuse_space"
    assert (s(p.period_type.type), s(p.period_type.unit)) == ("space", "bytes")
    assert p.period == 1  # exact: every allocation counted
    assert p.time_nanos == TIME_NS and p.duration_nanos == DURATION_NS
    assert [s(c) for c in p.comment] == ["pid 42: server --port 1"]
    assert len(set(exact.strings)) == len(exact.strings), "the string table holds each string once"


def test_sample_values_are_the_counters_in_go_order(exact: Decoded) -> None:
    values = {
        tuple(tuple(line[0] for line in loc) for loc in exact.frames(s)): list(s.value) for s in exact.prof.sample
    }
    assert values == {
        (("grow_buffer", "work"), ("handle",), ("main",)): [5, 5000, 3, 3000],
        (("handle",), ("main",)): [10, 640, 0, 0],
        ((), ("main",)): [1, 96, 1, 96],
        (("[stack not recorded]",),): [1, 7, 1, 7],
    }
    # Go's `bytes` label: the stack's mean block size.
    labels = {
        exact.frames(s)[0][0][0] if exact.frames(s)[0] else "?": [
            (exact.s(lb.key), lb.num, exact.s(lb.num_unit)) for lb in s.label
        ]
        for s in exact.prof.sample
    }
    assert labels == {
        "grow_buffer": [("bytes", 1000, "bytes")],
        "handle": [("bytes", 64, "bytes")],
        "?": [("bytes", 96, "bytes")],
        "[stack not recorded]": [("bytes", 7, "bytes")],
    }


def test_inlined_calls_are_lines_of_one_location(exact: Decoded) -> None:
    sample = exact.sample_of("grow_buffer")
    leaf = exact.locations[sample.location_id[0]]
    assert leaf.address == INLINED.address
    assert exact.frames(sample)[0] == [("grow_buffer", "/src/buf.h", 12), ("work", "/src/work.c", 77)]
    assert exact.frames(sample)[1:] == [[("handle", "/src/server.c", 30)], [("main", "/src/server.c", 50)]]
    # main and handle are one location each, shared by every stack through them
    assert len(exact.locations) == 5


def test_functions_once_each_with_their_file(exact: Decoded) -> None:
    funcs = sorted((exact.s(f.name), exact.s(f.system_name), exact.s(f.filename)) for f in exact.prof.function)
    assert funcs == [
        ("[stack not recorded]", "[stack not recorded]", ""),
        ("grow_buffer", "grow_buffer", "/src/buf.h"),
        ("handle", "handle", "/src/server.c"),
        ("main", "main", "/src/server.c"),
        ("work", "work", "/src/work.c"),
    ]
    assert sorted(exact.functions) == list(range(1, 6))


def test_mappings_main_first_with_build_ids_and_resolution(exact: Decoded) -> None:
    m = [exact.prof.mapping[i] for i in range(len(exact.prof.mapping))]
    assert [
        (x.id, x.memory_start, x.memory_limit, x.file_offset, exact.s(x.filename), exact.s(x.build_id)) for x in m
    ] == [
        (1, EXE_TEXT.start, EXE_TEXT.end, EXE_TEXT.offset, EXE, BUILD_IDS[EXE]),
        (2, LIB_TEXT.start, LIB_TEXT.end, LIB_TEXT.offset, LIB, "feedface"),
    ]
    exe, lib = m
    assert (exe.has_functions, exe.has_filenames, exe.has_line_numbers, exe.has_inline_frames) == (
        True,
        True,
        True,
        True,
    )
    # the library has an address without a symbol: pprof may symbolize that mapping again itself
    assert (lib.has_functions, lib.has_filenames, lib.has_line_numbers, lib.has_inline_frames) == (
        False,
        False,
        False,
        False,
    )


def test_locations_point_into_their_mappings(exact: Decoded) -> None:
    for loc in exact.prof.location:
        if loc.mapping_id == 0:
            assert loc.address == 0 and [exact.s(exact.functions[line.function_id].name) for line in loc.line] == [
                "[stack not recorded]"
            ]
            continue
        m = exact.mappings[loc.mapping_id]
        assert m.memory_start <= loc.address < m.memory_limit
    unknown = exact.locations[next(s for s in exact.prof.sample if not exact.frames(s)[0]).location_id[0]]
    assert (
        unknown.address == NO_SYMBOL.address
        and not unknown.line
        and exact.mappings[unknown.mapping_id].memory_start == LIB_TEXT.start
    )


def test_the_symbolized_object_decides_between_overlapping_mappings() -> None:
    """A range once held another object (a library unloaded, another loaded in its place): a frame goes to the
    mapping of the object it was symbolized in."""
    old = Mapping(0x7000_0000, 0x7001_0000, 0, "/lib/old.so", "r-xp")
    new = Mapping(0x7000_0000, 0x7002_0000, 0, "/lib/new.so", "r-xp")
    old_frame = Frame(0x7000_0100, "from_old", "old.c", 3, "/lib/old.so")
    new_frame = Frame(0x7000_0100, "from_new", "new.c", 4, "/lib/new.so")
    d = Decoded(
        parse_pprof(
            render_pprof(
                {
                    (old_frame,): SiteCounts(cur_bytes=1, cur_blocks=1, tot_bytes=1, tot_blocks=1),
                    (new_frame,): SiteCounts(cur_bytes=2, cur_blocks=1, tot_bytes=2, tot_blocks=1),
                },
                [new, old],
            )
        )
    )
    by_fn = {
        d.s(d.functions[loc.line[0].function_id].name): d.s(d.mappings[loc.mapping_id].filename)
        for loc in d.prof.location
    }
    assert by_fn == {"from_old": "/lib/old.so", "from_new": "/lib/new.so"}


def test_wire_field_numbers_are_pprofs() -> None:
    """Read the raw protobuf without the encoder's declaration: numbers and wire types as in profile.proto."""
    data = gzip.decompress(
        render_pprof(SITES, [EXE_TEXT, LIB_TEXT], time_ns=TIME_NS, duration_ns=DURATION_NS, comments=("c",))
    )
    top = empty_pb2.Empty()
    top.ParseFromString(data)
    fields: dict[int, list[Any]] = {}
    for f in unknown_fields.UnknownFieldSet(top):
        fields.setdefault(f.field_number, []).append((f.wire_type, f.data))
    varint, length = 0, 2
    # Profile: sample_type 1, sample 2, mapping 3, location 4, function 5, string_table 6, time_nanos 9,
    # duration_nanos 10, period_type 11, period 12, comment 13 (packed), default_sample_type 14
    assert sorted(fields) == [1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14]
    assert {w for n in (1, 2, 3, 4, 5, 6, 11, 13) for w, _ in fields[n]} == {length}
    assert fields[9] == [(varint, TIME_NS)] and fields[10] == [(varint, DURATION_NS)] and fields[12] == [(varint, 1)]
    strings = [d.decode() for _, d in fields[6]]
    assert strings[0] == ""
    assert strings[fields[14][0][1]] == "inuse_space"

    def sub(raw: bytes) -> dict[int, list[Any]]:
        msg = empty_pb2.Empty()
        msg.ParseFromString(raw)
        out: dict[int, list[Any]] = {}
        for f in unknown_fields.UnknownFieldSet(msg):
            out.setdefault(f.field_number, []).append((f.wire_type, f.data))
        return out

    # ValueType: type 1, unit 2
    assert [(strings[sub(d)[1][0][1]], strings[sub(d)[2][0][1]]) for _, d in fields[1]] == list(SAMPLE_TYPES)
    # Sample: location_id 1 and value 2, packed (one length-delimited field each), label 3
    first = sub(fields[2][0][1])
    assert sorted(first) == [1, 2, 3] and first[1][0][0] == length and first[2][0][0] == length
    # Mapping: id 1, memory_start 2, memory_limit 3, file_offset 4, filename 5, flags 7..10
    exe = sub(fields[3][0][1])
    assert exe[1] == [(varint, 1)] and exe[2] == [(varint, EXE_TEXT.start)] and exe[3] == [(varint, EXE_TEXT.end)]
    assert exe[4] == [(varint, EXE_TEXT.offset)] and strings[exe[5][0][1]] == EXE
    assert [exe[n] for n in (7, 8, 9, 10)] == [[(varint, 1)]] * 4
    # Location: id 1, mapping_id 2, address 3, line 4 (Line: function_id 1, line 2)
    loc = sub(fields[4][0][1])
    assert loc[3] == [(varint, INLINED.address)] and len(loc[4]) == 2
    assert [sub(d)[2][0][1] for _, d in loc[4]] == [12, 77]
    # Function: id 1, name 2, system_name 3, filename 4
    fn = sub(fields[5][0][1])
    assert strings[fn[2][0][1]] == "grow_buffer" and strings[fn[4][0][1]] == "/src/buf.h"


# ---- sampled profiles -------------------------------------------------------------------------------------


def go_scale(count: int, size: int, rate: int) -> tuple[int, int]:
    """What Go's runtime writes for `count` samples of `size` bytes at `rate`: each sample of mean size s
    stands for 1 / (1 - e^(-s/rate)) allocations."""
    p = 1 - math.exp(-(size / count) / rate)
    return int(count / p), int(size / p)


def test_a_sampled_profile_is_scaled_with_period_set_to_its_rate() -> None:
    rate = 512 * 1024
    d = Decoded(render(sample_rate=rate))
    assert d.prof.period == rate
    sample = d.sample_of("grow_buffer")
    assert list(sample.value) == [*go_scale(5, 5000, rate), *go_scale(3, 3000, rate)]
    # small blocks are rarely sampled, so each stands for many: 1000-byte blocks at 512 KiB, ~525 each
    assert sample.value[0] == int(5 / (1 - math.exp(-1000 / rate)))
    assert 520 * 5 < sample.value[0] < 530 * 5
    handler = d.sample_of("handle")
    assert list(handler.value[2:]) == [0, 0]  # nothing live: nothing to scale
    assert [lb.num for lb in sample.label] == [1000]  # the label keeps the sampled mean size, as Go's


def test_large_blocks_are_barely_scaled() -> None:
    assert scale_heap_sample(1, 100 * 1024 * 1024, 512 * 1024) == (1, 100 * 1024 * 1024)
    assert scale_heap_sample(0, 0, 512 * 1024) == (0, 0)
    assert scale_heap_sample(4, 400, 1) == (4, 400)


def test_prescaled_counters_are_written_as_they_are() -> None:
    d = Decoded(render(sample_rate=65536, prescaled=True))
    assert d.prof.period == 65536
    assert list(d.sample_of("grow_buffer").value) == [5, 5000, 3, 3000]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        render_pprof(SITES, sample_rate=0)
    with pytest.raises(ValueError, match="sample type"):
        render_pprof(SITES, default_sample_type="inuse_blocks")


def test_negative_counters_from_racy_reads_count_as_zero() -> None:
    d = Decoded(
        parse_pprof(render_pprof({HANDLER_STACK: SiteCounts(cur_bytes=-8, cur_blocks=-1, tot_bytes=64, tot_blocks=1)}))
    )
    assert [list(s.value) for s in d.prof.sample] == [[1, 64, 0, 0]]


def test_the_output_is_deterministic() -> None:
    assert render_pprof(SITES, [EXE_TEXT], time_ns=1) == render_pprof(SITES, [EXE_TEXT], time_ns=1)


# ---- the HTTP routes, over the fake daemon ----------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    manager = FakeManager([FakeTarget(pid=4242)])
    with TestClient(create_app(ApiSettings(), manager)) as c:  # type: ignore[arg-type]
        yield c


@pytest.mark.parametrize(
    ("path", "default"),
    [
        ("/pprof", "inuse_space"),
        ("/pprof?pid=4242", "inuse_space"),
        ("/pprof?sample_index=alloc_objects", "alloc_objects"),
        ("/debug/pprof/heap", "inuse_space"),
        ("/debug/pprof/heap?pid=4242&gc=1&debug=0", "inuse_space"),
        ("/debug/pprof/allocs?pid=4242", "alloc_space"),
        ("/targets/4242/debug/pprof/heap", "inuse_space"),
        ("/targets/4242/debug/pprof/allocs", "alloc_space"),
    ],
)
def test_routes_serve_the_profile(client: TestClient, path: str, default: str) -> None:
    r = client.get(path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.content == render_pprof(
        sample_sites(),
        [PROG_MAPPING],
        time_ns=1_700_000_060 * 10**9,
        duration_ns=60 * 10**9,
        default_sample_type=default,
    )
    d = Decoded(parse_pprof(r.content))
    assert d.s(d.prof.default_sample_type) == default
    assert sum(s.value[3] for s in d.prof.sample) == sum(c.cur_bytes for c in sample_sites().values())


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/pprof?pid=7", 404),
        ("/targets/7/debug/pprof/heap", 404),
        ("/debug/pprof/heap?debug=1", 400),
        ("/debug/pprof/heap?seconds=14", 400),
        ("/targets/0/debug/pprof/heap", 422),
        ("/pprof?sample_index=inuse_blocks", 422),
    ],
)
def test_route_errors(client: TestClient, path: str, status: int) -> None:
    r = client.get(path)
    assert r.status_code == status, r.text
    assert "detail" in r.json()


def test_several_targets_need_a_pid() -> None:
    manager = FakeManager([FakeTarget(pid=1), FakeTarget(pid=2)])
    with TestClient(create_app(ApiSettings(), manager)) as c:  # type: ignore[arg-type]
        assert c.get("/debug/pprof/heap").status_code == 400
        assert c.get("/debug/pprof/heap?pid=2").status_code == 200


def test_routes_are_documented(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/pprof", "/debug/pprof/heap", "/debug/pprof/allocs", "/targets/{pid}/debug/pprof/heap"):
        assert "application/octet-stream" in paths[p]["get"]["responses"]["200"]["content"], p
