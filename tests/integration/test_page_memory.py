"""Page-level memory: --pages-as-heap=yes and --stacks=yes on programs with known page syscalls and stacks.

programs/pages.c maps, unmaps, remaps and moves the break at known call sites; the bytes each site must hold
at the peak and at the end follow from its source and Massif's rules (FINAL and PEAK below, with the arithmetic
spelled out). The peak is also compared with real Valgrind Massif --pages-as-heap=yes, site by site. The total
must be the program's own /proc/self/maps at exit, but for the pages Massif keeps counted where the kernel
replaced them (MAP_FIXED over live pages) and the vDSO's, which Massif never counts. programs/stacks.c holds known
stack depths for --stacks=yes.
"""

from __future__ import annotations

import re
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import RUN_TIMEOUT, Completed
from tests.support.massif_reader import MassifFile, Node, parse_massif

pytestmark = pytest.mark.integration

KiB = 1024
MiB = 1024 * KiB
PAGE = 4096

# The functions of pages.c that make page syscalls, and what each holds by Massif's rules (Massif keeps a page
# mapped over with MAP_FIXED counted, under the new one: its block table holds a page once per record).
FINAL = {
    "grow_base": 2 * MiB - 1 * MiB,  # mapped 2 MiB, the upper 1 MiB unmapped again
    "grow_in_place": 1 * MiB,  # mremap 1 -> 2 MiB in place: only the new tail is its
    "move_base": PAGE,  # 1 MiB + 1 page: move_grow moves 1 MiB away; the last page, mapped over by guard_page, stays
    "guard_page": PAGE,
    "move_grow": 3 * MiB,  # mremap that moved: the whole new range is the mover's
    "brk_up": 5 * PAGE - 2 * PAGE,  # sbrk(+5 pages), then brk_down's sbrk(-2 pages) takes back the top two
    "fixed_base": 1 * MiB,  # fixed_over maps 128 KiB over its middle, which stay counted here too
    "fixed_over": 128 * KiB,
    "big_map": 64 * MiB - 32 * MiB,  # big_unmap unmaps the upper half
}
# The peak is right before big_unmap: every other site is already in its final state, big_map is whole.
PEAK = {**FINAL, "big_map": 64 * MiB}
FUNCTION = re.compile(r"^0x[0-9A-F]+: (\w+) \(")


def site_bytes(tree: Node) -> dict[str, int]:
    """Bytes under each pages.c function: the outermost node naming it on each path, summed."""
    out: dict[str, int] = {}

    def walk(node: Node) -> None:
        for child in node.children:
            m = FUNCTION.match(child.label)
            if m and m.group(1) in FINAL:
                out[m.group(1)] = out.get(m.group(1), 0) + child.bytes
            else:
                walk(child)

    walk(tree)
    return {name: n for name, n in out.items() if n}  # a site whose pages are all gone may show as 0B


def mapped_report(stdout: str) -> tuple[int, int, int, int]:
    """pages.c's last line: its mapped total, [stack], [uprobes] and vDSO sizes, from /proc/self/maps."""
    m = re.search(r"mapped (\d+) stack (\d+) uprobes (\d+) vdso (\d+)", stdout)
    assert m, f"pages.c did not report its mappings:\n{stdout}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))


def check_total_against_maps(stderr: str, stdout: str) -> None:
    """The total at the end, less the pages Massif keeps counted under MAP_FIXED ones (the summary says how
    many), is the program's mapped total at exit without the vDSO's, but for what no syscall of its own mapped:
    the [uprobes] page the kernel adds for the probes, and [stack] growth (the kernel grows the stack on page
    faults). The program uses little stack, so the growth is bounded by its [stack] size over the 128 KiB the
    kernel gives a new stack plus the argument pages. Of the pages mapped over, the program's own are a page
    under guard_page and 128 KiB under fixed_over; the loader's come with it."""
    total, stack, uprobes, vdso = mapped_report(stdout)
    m = re.search(r"mapped (\d+) B at the end, \d+ B at the peak \(at the end, (\d+) B of pages mapped over", stderr)
    assert m, stderr
    final_total, mapped_over = int(m.group(1)), int(m.group(2))
    assert mapped_over >= PAGE + 128 * KiB
    unexplained = total - uprobes - vdso - (final_total - mapped_over)
    assert 0 <= unexplained <= max(0, stack - 132 * KiB), (total, stack, uprobes, vdso, final_total, mapped_over)


def check_sites(profile: MassifFile) -> None:
    """The peak, and the last snapshot: as in Massif, the one after the first page big_unmap unmaps (Massif takes
    no snapshot after the other pages of a range it unrecords, nor at exit)."""
    peak, last = profile.peak, profile.snapshots[-1]
    assert peak is not None and peak.tree is not None and last.tree is not None
    assert site_bytes(peak.tree) == {k: v for k, v in PEAK.items() if v}, "peak"
    assert site_bytes(last.tree) == {**PEAK, "big_map": PEAK["big_map"] - PAGE}, "last"
    assert peak.heap_B - last.heap_B == PAGE
    assert peak.heap_extra_B == last.heap_extra_B == 0


@pytest.fixture(scope="module")
def pages_program(build: Callable[..., Path]) -> Path:
    return build("pages.c")


@pytest.fixture(scope="module")
def pages_run(pages_program: Path, run_heapscope: Callable[..., Completed]) -> Completed:
    done = run_heapscope(pages_program, options=("--pages-as-heap=yes",))
    assert done.returncode == 0, done.stderr
    return done


def test_pages_as_heap_gives_exact_bytes_at_each_site(pages_run: Completed) -> None:
    profile = parse_massif(pages_run.massif_text)
    assert "(page allocation syscalls) mmap/mremap/brk, --alloc-fns, etc." in pages_run.massif_text
    check_sites(profile)
    check_total_against_maps(pages_run.stderr, pages_run.stdout)
    # The loader's and the kernel's mappings are there too, under their own names.
    assert "(mapped by the kernel at exec)" in pages_run.massif_text
    assert "_dl_map_segments" in pages_run.massif_text
    assert "pages: NOT COUNTED" not in pages_run.stderr


def test_pages_as_heap_peak_agrees_with_massif(
    pages_program: Path, pages_run: Completed, run_massif: Callable[..., Completed]
) -> None:
    ref = run_massif(pages_program, options=("--pages-as-heap=yes",))
    assert ref.returncode == 0, ref.stderr
    ref_peak = parse_massif(ref.massif_text).peak
    ours_peak = parse_massif(pages_run.massif_text).peak
    assert ref_peak is not None and ref_peak.tree is not None
    assert ours_peak is not None and ours_peak.tree is not None
    theirs, ours = site_bytes(ref_peak.tree), site_bytes(ours_peak.tree)
    assert {k: ours.get(k, 0) for k in FINAL} == {k: theirs.get(k, 0) for k in FINAL}


def test_ms_print_reads_the_pages_as_heap_profile(pages_run: Completed) -> None:
    done = subprocess.run(["ms_print", str(pages_run.massif_out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "(page allocation syscalls) mmap/mremap/brk" in done.stdout
    assert "big_map (pages.c:" in done.stdout


def test_pages_as_heap_attach_charges_earlier_mappings_to_their_own_entry(
    heapscope_cmd: list[str], pages_program: Path, tmp_path: Path
) -> None:
    out = tmp_path / "attach.out"
    target = subprocess.Popen([str(pages_program), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert target.stdout is not None and target.stdin is not None
    assert target.stdout.readline() == b"ready\n"
    cmd = [*heapscope_cmd, "attach", str(target.pid), "--mode=exact", "--pages-as-heap=yes", "--time-unit=B",
           "--threshold=0.0", "--detailed-freq=1"]
    profiler = subprocess.Popen([*cmd, f"--massif-out-file={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        said = _wait_for(profiler, "probes attached")
        target.stdin.write(b"x")
        target.stdin.flush()
        target_out, _ = target.communicate(timeout=RUN_TIMEOUT)
        _, err = profiler.communicate(timeout=RUN_TIMEOUT)
    finally:
        for proc in (target, profiler):
            if proc.poll() is None:
                proc.kill()
    stderr = said + err.decode()
    assert profiler.returncode == 0, stderr
    assert target.returncode == 0
    text = out.read_text()
    profile = parse_massif(text)
    check_sites(profile)
    check_total_against_maps(stderr, target_out.decode())
    # before_attach's 2 MiB were mapped before the attach: under the named entry, never under its stack.
    assert "before_attach" not in text
    last = profile.snapshots[-1]
    assert last.tree is not None
    earlier = [c for c in last.tree.children if "(mapped before heapscope attached)" in c.label]
    assert len(earlier) == 1 and earlier[0].bytes >= 2 * MiB


def _wait_for(proc: subprocess.Popen[bytes], text: str) -> str:
    assert proc.stderr is not None
    said = ""
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline and text not in said:
        if proc.poll() is not None:
            raise AssertionError(f"heapscope exited ({proc.returncode}):\n{said}{proc.stderr.read().decode()}")
        ready, _, _ = select.select([proc.stderr], [], [], 0.05)
        if ready:
            said += proc.stderr.readline().decode()
    assert text in said, said
    return said


# ---- --stacks=yes ---------------------------------------------------------------------------------------

MAIN_DEEP = 256 * KiB  # stacks.c
THREAD_DEEP = 128 * KiB
# The frames around the deep ones: main's and the thread's own, start_thread, the allocator's caller.
FRAMES_SLACK = 16 * KiB


def test_stacks_measures_each_threads_depth_from_its_start(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("stacks.c", flags=("-g", "-O0", "-fno-omit-frame-pointer", "-pthread"))
    done = run_heapscope(program, options=("--stacks=yes", "--time-unit=ms"))
    assert done.returncode == 0, done.stderr
    profile = parse_massif(done.massif_text)
    stacks = [s.stacks_B for s in profile.snapshots]
    # Massif's convention: the main stack starts at zero.
    assert stacks[0] < FRAMES_SLACK
    # Both threads deep at once: their depths add up.
    deepest = max(stacks)
    assert MAIN_DEEP + THREAD_DEEP <= deepest <= MAIN_DEEP + THREAD_DEEP + FRAMES_SLACK, stacks
    # Back up in main, the thread gone.
    assert stacks[-1] < FRAMES_SLACK, stacks
    ms = subprocess.run(["ms_print", str(done.massif_out)], capture_output=True, text=True, check=False)
    assert ms.returncode == 0, ms.stderr


def test_stacks_cannot_be_combined_with_pages_as_heap(cli_cmd: list[str], build: Callable[..., Path]) -> None:
    done = subprocess.run(
        [*cli_cmd, "run", "--stacks=yes", "--pages-as-heap=yes", "--", "/bin/true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2, done
    assert "cannot be combined" in done.stderr
    assert "Traceback" not in done.stderr


# ---- MALT's mmap/munmap per stack, in heap mode -----------------------------------------------------------


def test_malt_profile_has_the_mmap_and_munmap_calls_per_stack(
    pages_program: Path, run_heapscope: Callable[..., Completed], tmp_path: Path
) -> None:
    import json

    import jsonschema

    schema = json.loads((Path(__file__).resolve().parents[1] / "malt_schema.json").read_text())
    malt = tmp_path / "malt.json"
    done = run_heapscope(pages_program, options=(f"--malt-out-file={malt}", "--malt-format=1.6"))
    assert done.returncode == 0, done.stderr
    assert "inconsistent" not in done.stderr
    doc = json.loads(malt.read_text())
    jsonschema.validate(doc, schema)
    assert doc["config"]["c"]["mmap"] is True
    strings, instr = doc["sites"]["strings"], doc["sites"]["instr"]

    def calls(function: str, caller: str) -> dict[str, int]:
        """The infos of the one stack whose leaf is `function` called from `caller` (pages.c)."""
        found = []
        for s in doc["stacks"]["stats"]:
            names = [strings[instr[a]["function"]] for a in s["stack"]]
            if names[0] == function and caller in names[1:3]:
                found.append(s["infos"][function])
        assert len(found) == 1, (function, caller, found)
        return found[0]  # type: ignore[no-any-return]

    assert calls("mmap", "big_map") == {"count": 1, "min": 64 * MiB, "max": 64 * MiB, "sum": 64 * MiB}
    assert calls("munmap", "big_unmap") == {"count": 1, "min": 32 * MiB, "max": 32 * MiB, "sum": 32 * MiB}
    assert calls("mmap", "grow_base")["sum"] == 2 * MiB
    assert calls("mmap", "move_base")["sum"] == 1 * MiB + PAGE
    # The mmap stacks add up to the domains' mmap figures.
    mmaps = [s["infos"]["mmap"] for s in doc["stacks"]["stats"]]
    assert doc["domains"]["counters"]["mmap"] == sum(m["count"] for m in mmaps)
    assert doc["domains"]["mem"]["mmap"] == sum(m["sum"] for m in mmaps)
