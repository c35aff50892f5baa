"""The xtree memory report (callgrind format): byte-for-byte Valgrind's for the same sites, and readable by
the real callgrind_annotate."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.export.xtree import UNKNOWN_FILE, UNKNOWN_FN, write_xtree
from agent.model.stack import Frame, SiteCounts, Stack

FULL_NAMES = ("cur_bytes", "cur_blocks", "tot_bytes", "tot_blocks", "freed_bytes", "freed_blocks")


def read_valgrind_xtree(text: str) -> tuple[str, int, list[tuple[Stack, SiteCounts]]]:
    """Invert Valgrind's report: (cmd, pid, [(stack innermost first, counts)]) in file order. Every frame
    gets its own address, so no two frames look like one IP with inlined calls."""
    cmd = re.search(r"^cmd: (.*)$", text, re.M)
    pid = re.search(r"^pid: (\d+)$", text, re.M)
    assert cmd and pid
    body = text.split("\nevents:", 1)[1].split("\n", 1)[1]
    names: dict[str, dict[int, str]] = {"fl": {}, "fn": {}}
    sites: list[tuple[Stack, SiteCounts]] = []
    address = 0x1000

    def name(kind: str, value: str) -> str:
        m = re.match(r"^\((\d+)\)(?: (.*))?$", value)
        assert m, value
        n = int(m.group(1))
        if m.group(2) is not None:
            names[kind][n] = m.group(2)
        return names[kind][n]

    frames: list[Frame] = []
    file = fn = ""
    skip_cost = False
    for line in body.splitlines():
        if line.startswith("totals:"):
            break
        if not line:
            continue
        tag, _, value = line.partition("=")
        if tag in ("fl", "cfi"):
            got = name("fl", value)
            if tag == "fl":
                file = got
            continue
        if tag in ("fn", "cfn"):
            got = name("fn", value)
            if tag == "fn":
                fn = got
            continue
        if line.startswith("calls="):
            skip_cost = True
            continue
        if skip_cost:
            skip_cost = False
            continue
        fields = [int(x) for x in line.split()]
        known = file != UNKNOWN_FILE
        frames.append(
            Frame(
                address,
                None if fn == UNKNOWN_FN else fn,
                Path(file).name if known else None,
                fields[0] if known else None,
                path=file if known else None,
            )
        )
        address += 0x10
        if len(fields) > 1:  # the allocation site: the site's values
            counts = SiteCounts(**dict(zip(FULL_NAMES, fields[1:], strict=False)))
            sites.append((tuple(reversed(frames)), counts))
            frames = []
    return cmd.group(1), int(pid.group(1)), sites


PROGRAM = r"""
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
void *keep[100];
__attribute__((noinline)) void *leaf(int n) { return malloc(n); }
__attribute__((noinline)) void *mid(int n) { return leaf(n); }
void *thr(void *a) { keep[50] = malloc(3000); free(keep[51]); return 0; }
int main(void)
{
   keep[1] = strdup("hello world");
   keep[2] = mid(500);
   keep[3] = calloc(10, 10);
   keep[4] = realloc(0, 77);
   keep[4] = realloc(keep[4], 7000);
   for (int i = 0; i < 30; i++) keep[10 + i] = leaf(1 + i);
   keep[51] = mid(64);
   pthread_t t; pthread_create(&t, 0, thr, 0); pthread_join(t, 0);
   free(keep[10]);
   free(keep[2]);
   return 0;
}
"""


def valgrind_xtree(tmp: Path, mode: str) -> str:
    src = tmp / "x.c"
    src.write_text(PROGRAM)
    exe = tmp / "x"
    subprocess.run(["gcc", "-g", "-O0", "-o", str(exe), str(src), "-lpthread"], check=True, capture_output=True)
    out = tmp / f"xt.{mode}.kcg"
    subprocess.run(
        [
            "valgrind",
            "--tool=massif",
            f"--xtree-memory={mode}",
            f"--xtree-memory-file={out}",
            f"--massif-out-file={tmp / 'massif.out'}",
            str(exe),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out.read_text()


@pytest.mark.needs("valgrind", "gcc")
@pytest.mark.parametrize("mode", ["full", "allocs"])
def test_same_sites_give_valgrinds_file(tmp_path: Path, mode: str) -> None:
    ref = valgrind_xtree(tmp_path, mode)
    cmd, pid, sites = read_valgrind_xtree(ref)
    assert len(sites) >= 5
    # Empty and all-zero sites are left out, as Valgrind does; they must not change the file.
    extra: list[tuple[Stack, SiteCounts]] = [((), SiteCounts(cur_bytes=5)), ((Frame(1, "z"),), SiteCounts())]
    buf = io.StringIO()
    write_xtree(buf, dict(extra + sites), cmd=cmd, pid=pid, kind=mode)  # type: ignore[arg-type]
    assert buf.getvalue() == ref


def fr(addr: int, fn: str | None, file: str | None, line: int | None, path: str | None = None) -> Frame:
    return Frame(addr, fn, file, line, path=path)


EX = "/src/ex.c"
G5 = fr(0x10, "g", "ex.c", 5, EX)
F11 = fr(0x20, "f", "ex.c", 11, EX)
F10 = fr(0x30, "f", "ex.c", 10, EX)
M20 = fr(0x40, "main", "ex.c", 20, EX)
M23 = fr(0x50, "main", "ex.c", 23, EX)
M25 = fr(0x60, "main", "ex.c", 25, EX)
M28 = fr(0x70, "main", "ex.c", 28, EX)

EXAMPLE: dict[Stack, SiteCounts] = {
    (M20,): SiteCounts(0, 0, 10000, 10, 0, 0),
    (F10, M23): SiteCounts(2000, 1, 2000, 1, 0, 0),
    (G5, F11, M23): SiteCounts(4000, 1, 4000, 1, 0, 0),
    (G5, M25): SiteCounts(4000, 1, 4000, 1, 0, 0),
    (M28,): SiteCounts(0, 0, 0, 0, 10000, 10),
}


def test_layout() -> None:
    buf = io.StringIO()
    write_xtree(buf, EXAMPLE, cmd="./ex", pid=77, kind="full")
    text = buf.getvalue()
    head = text.split("fl=", 1)[0]
    assert head == (
        "# callgrind format\nversion: 1\ncreator: xtree-1\npid: 77\ncmd: ./ex\n\npositions: line\n"
        "event: curB : currently allocated Bytes\nevent: curBk : currently allocated Blocks\n"
        "event: totB : total allocated Bytes\nevent: totBk : total allocated Blocks\n"
        "event: totFdB : total Freed Bytes\nevent: totFdBk : total Freed Blocks\n"
        "events: curB  curBk  totB  totBk  totFdB  totFdBk \n"
    )
    assert "fl=(1) /src/ex.c\nfn=(1) main\n20 0 0 10000 10 0 0\n\n" in text
    assert "fl=(1)\nfn=(1)\n23\ncfi=(1)\ncfn=(2) f\ncalls=0 10\n23 2000 1 2000 1 0 0\n" in text
    assert text.endswith("\ntotals: 10000 3 20000 13 10000 10\n")
    allocs = io.StringIO()
    write_xtree(allocs, EXAMPLE, cmd="./ex", pid=77, kind="allocs")
    assert "events: curB  curBk \n" in allocs.getvalue()
    assert "fn=(1) main\n20" not in allocs.getvalue()  # no live bytes there: left out
    assert allocs.getvalue().endswith("\ntotals: 10000 3\n")


def test_inlined_frames_are_one_ip_and_unknowns() -> None:
    # Valgrind names an IP by its real function and the innermost inlined line.
    inl = Frame(0x100, "inl", "ex3.c", 5, path="/s/ex3.c", inlined=True)
    outer = fr(0x100, "main", "ex3.c", 10, "/s/ex3.c")
    nodebug = Frame(0x200, "nodbg_alloc", obj="/lib/libnd.so")
    unknown = Frame(0x300)
    buf = io.StringIO()
    write_xtree(
        buf,
        {(inl, outer): SiteCounts(1000, 1), (nodebug, unknown): SiteCounts(500, 1)},
        cmd="x",
        pid=1,
        kind="allocs",
    )
    text = buf.getvalue()
    assert "fl=(1) /s/ex3.c\nfn=(1) main\n5 1000 1\n\n" in text
    assert f"fl=(2) {UNKNOWN_FILE}\nfn=(2) {UNKNOWN_FN}\n0\ncfi=(2)\ncfn=(3) nodbg_alloc\ncalls=0 0\n0 500 1\n" in text
    with pytest.raises(ValueError):
        write_xtree(io.StringIO(), {}, cmd="x", pid=1, kind="peak")  # type: ignore[arg-type]


def test_nothing_to_report_still_has_totals() -> None:
    buf = io.StringIO()
    write_xtree(buf, {}, cmd="x", pid=1, kind="full")
    assert buf.getvalue().endswith("events: curB  curBk  totB  totBk  totFdB  totFdBk \ntotals: 0 0 0 0 0 0\n")


@pytest.mark.needs("callgrind_annotate")
def test_callgrind_annotate_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "xtmemory.kcg"
    with path.open("w") as out:
        write_xtree(out, EXAMPLE, cmd="./ex", pid=77, kind="full")
    res = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--auto=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*([\d,]+) .*?\s(\S+:\S+|PROGRAM TOTALS)$", line)
        if m:
            rows[m.group(2)] = int(m.group(1).replace(",", ""))
    # Inclusive curB: g holds 8,000 B (two call paths), f 6,000 B (its own 2,000 and g's 4,000 under it).
    assert rows["PROGRAM TOTALS"] == 10000
    assert rows["/src/ex.c:g"] == 8000
    assert rows["/src/ex.c:f"] == 6000
    assert rows["/src/ex.c:main"] == 10000
    assert "Events recorded:  curB curBk totB totBk totFdB totFdBk" in res.stdout
