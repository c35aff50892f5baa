"""The one parser of /proc/PID/maps (agent.model.maps): every line for the page map, the file mappings for the
symbolizer, the device for the sampler's lookups."""

from __future__ import annotations

from agent.model.maps import ANON, Mapping, code_lines, parse_maps, parse_maps_full

TEXT = """\
55d0c0a00000-55d0c0a02000 r--p 00000000 fd:01 1048593                    /usr/bin/cat
55d0c0a02000-55d0c0a07000 r-xp 00002000 fd:01 1048593                    /usr/bin/cat
55d0c1e4d000-55d0c1e6e000 rw-p 00000000 00:00 0                          [heap]
7f1e2a000000-7f1e2a021000 rw-p 00000000 00:00 0
7f1e2a200000-7f1e2a228000 r-xp 00028000 103:02 2490378                   /usr/lib/libc.so.6 (deleted)
not a line
7ffd1d7f1000-7ffd1d7f1000 r--p 00000000 00:00 0                          [empty]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def test_every_well_formed_line_is_an_entry() -> None:
    entries = parse_maps_full(TEXT)
    assert [e.path for e in entries] == [
        "/usr/bin/cat", "/usr/bin/cat", "[heap]", ANON, "/usr/lib/libc.so.6 (deleted)", "[vsyscall]",
    ]  # fmt: skip
    libc = entries[4]
    assert (libc.start, libc.size, libc.perms, libc.offset, libc.inode) == (0x7F1E2A200000, 0x28000, "r-xp", 0x28000,
                                                                            2490378)  # fmt: skip
    assert libc.device == (0x103, 0x02)
    assert entries[0].is_file and not entries[2].is_file


def test_the_symbolizer_gets_the_file_mappings_of_the_same_lines() -> None:
    assert parse_maps(TEXT) == [
        Mapping(0x55D0C0A00000, 0x55D0C0A02000, 0, "/usr/bin/cat", "r--p"),
        Mapping(0x55D0C0A02000, 0x55D0C0A07000, 0x2000, "/usr/bin/cat", "r-xp"),
        Mapping(0x7F1E2A200000, 0x7F1E2A228000, 0x28000, "/usr/lib/libc.so.6", "r-xp"),  # (deleted) dropped
    ]


def test_code_lines_are_the_executable_ones_whatever_their_width() -> None:
    """The recorder parses only the executable lines (agent.process.maps.MapsRecorder.refresh): the same code
    mappings as the whole text gives, for any address width, the malformed lines left out."""
    code = code_lines(TEXT)
    assert [line.split()[5] for line in code.splitlines()] == ["/usr/bin/cat", "/usr/lib/libc.so.6", "[vsyscall]"]
    assert [m for m in parse_maps(TEXT) if "x" in m.perms] == parse_maps(code)
    assert code_lines("") == "" and code_lines("x\n\n r-xp") == ""
