"""Valgrind's Massif on a small C program the test writes: the reference the unit tests judge the model by."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run_massif(tmp: Path, source: str, *options: str, name: str = "prog") -> Path:
    """Compile `source` and run it under Massif; returns the massif.out path."""
    exe = tmp / name
    src = tmp / f"{name}.c"
    src.write_text(source)
    subprocess.run(["gcc", "-g", "-O0", "-o", str(exe), str(src)], check=True, capture_output=True)
    out = tmp / f"{name}.massif.{abs(hash(options))}.out"
    subprocess.run(
        ["valgrind", "--tool=massif", f"--massif-out-file={out}", *options, str(exe)],
        check=True,
        capture_output=True,
        cwd=tmp,
        timeout=120,
    )
    return out
