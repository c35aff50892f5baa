"""A process that may start no thread (its RLIMIT_NPROC reached, as haproxy's workers set it after dropping to a
user of their own) cannot run the sampler, whose control thread is a thread of its own. heapscope says that
reason in one line, and the process goes on unharmed."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NOBODY = "65534"


def test_sampled_attach_to_a_process_at_its_thread_limit_says_so(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    with tempfile.TemporaryDirectory() as shared:  # world-readable: the target runs as nobody
        Path(shared).chmod(0o755)
        exe = Path(shutil.copy(build("attach_target.c"), shared))
        exe.chmod(0o755)
        target = subprocess.Popen(
            ["prlimit", "--nproc=1:1", "--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             str(exe)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            assert target.stdout is not None and target.stdin is not None
            assert target.stdout.readline() == b"ready\n"
            done = subprocess.run([*heapscope_cmd, "attach", str(target.pid)], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=120, check=False)
            errors = [line for line in done.stderr.splitlines() if "RLIMIT_NPROC" in line]
            assert done.returncode != 0 and len(errors) == 1, done.stderr
            assert "Max processes 1" in errors[0] and "--mode=exact" in errors[0], errors[0]
            assert "Traceback" not in done.stderr
            # Unharmed: it goes on and ends as it would have.
            target.stdin.write(b"x")
            target.stdin.flush()
            assert target.stdout.read() == b"allocated\ndone\n"
            assert target.wait(timeout=30) == 7
        finally:
            target.kill()
            target.wait()
