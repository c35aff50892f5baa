"""A daemon's lines reach its log while a target's program compiles: the compile points fd 2 at a capture file
for seconds, and the lines other threads said meanwhile used to go into it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys, threading
from agent.cli import profiling
from agent.kernel.loader import captured_stderr
profiling._stderr_of_our_own()
with captured_stderr() as messages:
    other = threading.Thread(target=lambda: sys.stderr.write("said by another thread while compiling\\n"))
    other.start()
    other.join()
    os.write(2, b"clang: a warning\\n")
    print(messages())
"""


def test_lines_said_while_a_program_compiles_reach_the_log_and_the_capture_keeps_the_compilers() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "said by another thread while compiling" in done.stderr
    assert "clang: a warning" not in done.stderr and done.stdout.strip() == "['clang: a warning']"
