"""The CLI's failures: each gives one line on stderr starting with "heapscope: ", a non-zero exit status and
never a Python traceback."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TIMEOUT = 60


def run_cli(cmd: Sequence[str], cwd: Path, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *cmd],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode != 0, f"exit status 0; stderr: {done.stderr!r}"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {done.stderr!r}"
    assert lines[0].startswith("heapscope: "), lines[0]
    return lines[0]


def dead_pid() -> int:
    """The PID of a child that has exited and been reaped: no process has it (barring immediate reuse)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# --- errors found before any probe is loaded: no root needed ------------------------------------------------

BAD_OPTIONS = [
    pytest.param(["--stacks=yes", "--pages-as-heap=yes"], id="stacks-with-pages-as-heap"),
    pytest.param(["--heap=no"], id="heap-no-without-pages-as-heap"),
    pytest.param(["--stacks=maybe"], id="stacks-not-yes-no"),
    pytest.param(["--time-unit=parsecs"], id="time-unit-unknown"),
    pytest.param(["--threshold=abc"], id="threshold-not-a-number"),
    pytest.param(["--threshold=101"], id="threshold-over-100"),
    pytest.param(["--peak-inaccuracy=lots"], id="peak-inaccuracy-not-a-number"),
    pytest.param(["--depth=0"], id="depth-zero"),
    pytest.param(["--depth=many"], id="depth-not-a-number"),
    pytest.param(["--detailed-freq=0"], id="detailed-freq-zero"),
    pytest.param(["--max-snapshots=5"], id="max-snapshots-below-10"),
    pytest.param(["--xtree-memory=sometimes"], id="xtree-memory-unknown"),
    pytest.param(["--heap-admin=-8"], id="heap-admin-negative"),
    pytest.param(["--alignment=3"], id="alignment-not-power-of-two"),
    pytest.param(["--no-such-option=1"], id="unknown-option"),
    pytest.param(["--mode=fast"], id="mode-unknown"),
    pytest.param(["--mode=sampled", "--sample-rate=0"], id="sample-rate-zero"),
    pytest.param(["--mode=sampled", "--sample-rate=lots"], id="sample-rate-not-a-number"),
    pytest.param(["--mode=sampled", f"--sample-rate={(1 << 40) + 1}"], id="sample-rate-over-the-sampler-limit"),
    pytest.param(["--mode=exact", "--sample-rate=4096"], id="sample-rate-in-exact-mode"),
    pytest.param(["--mode=sampled", "--pages-as-heap=yes"], id="sampled-pages-as-heap"),
]


@pytest.mark.parametrize("options", BAD_OPTIONS)
def test_bad_option_for_run(options: list[str], cli_cmd: list[str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = run_cli([*cli_cmd, "run", *options, "--", "touch", str(marker)], tmp_path)
    assert_one_line_error(done)
    assert not marker.exists(), "the program ran although the options were refused"
    assert not list(tmp_path.glob("massif.out.*"))


@pytest.mark.parametrize("options", BAD_OPTIONS)
def test_bad_option_for_attach(options: list[str], cli_cmd: list[str], tmp_path: Path) -> None:
    # A live target: the option, not the PID, must be what is refused.
    target = subprocess.Popen(["sleep", "60"])
    try:
        assert_one_line_error(run_cli([*cli_cmd, "attach", str(target.pid), *options], tmp_path))
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


def test_run_without_program(cli_cmd: list[str], tmp_path: Path) -> None:
    assert_one_line_error(run_cli([*cli_cmd, "run", "--time-unit=B"], tmp_path))


def test_attach_pid_not_a_number(cli_cmd: list[str], tmp_path: Path) -> None:
    assert_one_line_error(run_cli([*cli_cmd, "attach", "self"], tmp_path))


def _hardware_instruction_counter() -> bool:
    """Can this machine count instructions (perf_event_open of PERF_COUNT_HW_INSTRUCTIONS on ourselves)?"""
    # struct perf_event_attr: type, size, config, then fields left zero (128 bytes is PERF_ATTR_SIZE_VER7).
    attr = (ctypes.c_uint8 * 128)()
    ctypes.c_uint32.from_buffer(attr, 0).value = 0  # PERF_TYPE_HARDWARE
    ctypes.c_uint32.from_buffer(attr, 4).value = 128
    ctypes.c_uint64.from_buffer(attr, 8).value = 1  # PERF_COUNT_HW_INSTRUCTIONS
    ctypes.c_uint64.from_buffer(attr, 40).value = 1 | (1 << 5)  # disabled | exclude_kernel
    libc = ctypes.CDLL(None, use_errno=True)
    nr_perf_event_open = 298  # x86-64
    fd = libc.syscall(nr_perf_event_open, ctypes.byref(attr), 0, -1, -1, 0)
    if fd >= 0:
        os.close(fd)
        return True
    return False


def test_time_unit_instructions_without_counters(cli_cmd: list[str], tmp_path: Path) -> None:
    if _hardware_instruction_counter():
        pytest.skip("this machine has hardware instruction counters: --time-unit=i may be supported")
    marker = tmp_path / "ran"
    line = assert_one_line_error(run_cli([*cli_cmd, "run", "--time-unit=i", "--", "touch", str(marker)], tmp_path))
    assert not marker.exists()
    assert "time-unit" in line, f"the message should name the option: {line}"


# --- errors about the target: need the probes' environment -------------------------------------------------


def test_attach_to_missing_pid(heapscope_cmd: list[str], tmp_path: Path) -> None:
    pid = dead_pid()
    line = assert_one_line_error(run_cli([*heapscope_cmd, "attach", str(pid), "--time-unit=B"], tmp_path))
    assert str(pid) in line, f"the message should name the PID: {line}"


def test_attach_to_a_process_that_has_exited(heapscope_cmd: list[str], tmp_path: Path) -> None:
    """The target exited before the attach: a zombie has a /proc entry but no memory to probe."""
    child = subprocess.Popen(["true"])
    try:
        # Wait for it to become a zombie without reaping it.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert_one_line_error(run_cli([*heapscope_cmd, "attach", str(child.pid), "--time-unit=B"], tmp_path))
    finally:
        child.wait()


def test_run_program_that_does_not_exist(heapscope_cmd: list[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-program"
    line = assert_one_line_error(run_cli([*heapscope_cmd, "run", "--time-unit=B", "--", str(missing)], tmp_path))
    assert "no-such-program" in line, line


def test_run_program_not_executable(heapscope_cmd: list[str], tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    assert_one_line_error(run_cli([*heapscope_cmd, "run", "--time-unit=B", "--", str(script)], tmp_path))


@pytest.mark.parametrize("status", [0, 3])
def test_run_target_that_exits_at_once(
    status: int, heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    """A program that allocates nothing and exits at once: heapscope exits with its status and still writes
    a file ms_print reads."""
    out = tmp_path / "quick.out"
    done = run_cli(
        [
            *heapscope_cmd,
            "run",
            "--time-unit=B",
            f"--massif-out-file={out}",
            "--",
            "sh",
            "-c",
            f"exit {status}",
        ],
        tmp_path,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == status, done.stderr
    assert out.exists(), done.stderr
    printed = subprocess.run(["ms_print", str(out)], capture_output=True, text=True, check=False)
    assert printed.returncode == 0, printed.stderr


@pytest.mark.needs("setpriv")
def test_without_capabilities(heapscope_cmd: list[str], tmp_path: Path) -> None:
    """Root with every capability dropped cannot load BPF programs: a clear error, not a traceback.
    (An unprivileged user cannot run this venv's interpreter here: it lives under /root.)"""
    target = subprocess.Popen(["sleep", "30"])
    try:
        prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"]
        done = run_cli([*heapscope_cmd, "attach", str(target.pid), "--time-unit=B"], tmp_path, prefix)
        assert_one_line_error(done)
        assert target.poll() is None, "the target died"
    finally:
        target.kill()
        target.wait()
