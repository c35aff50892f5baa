"""Shared constants and types of the integration tests: where the test programs are, the options of a run
comparable with Massif, and one finished run of a profiler (imported by tests/integration/conftest.py and the tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "integration" / "programs"

# Massif's options for a comparable run. --time-unit=B makes time deterministic; --threshold=0.0 keeps every
# site in the tree; --peak-inaccuracy=0.0 makes Massif record a peak on every free that beats the last one;
# --detailed-freq=1 makes every snapshot detailed, so the last snapshot (the state at exit) carries a tree
# (with the default of 10, Massif's last detailed tree is some earlier state heapscope has no reason to hit).
ORACLE_OPTIONS: tuple[str, ...] = (
    "--time-unit=B",
    "--threshold=0.0",
    "--peak-inaccuracy=0.0",
    "--detailed-freq=1",
)

DEBUG_FLAGS: tuple[str, ...] = ("-g", "-O0", "-fno-omit-frame-pointer")
OPTIMIZED_FLAGS: tuple[str, ...] = ("-g", "-O2", "-fomit-frame-pointer")

# Generous: Valgrind on a small program takes about a second; BPF compilation a few tenths.
RUN_TIMEOUT = 120


@dataclass
class Completed:
    """One finished run of a profiler (Valgrind or heapscope) on a program."""

    returncode: int
    stdout: str
    stderr: str
    massif_out: Path
    xtree_out: Path | None
    summary_out: Path | None = None  # heapscope's --summary-file

    @property
    def summary(self) -> dict[str, Any]:
        """heapscope's end-of-run summary (agent.model.summary.ProfileSummary as JSON)."""
        assert self.summary_out is not None and self.summary_out.exists(), f"no summary written:\n{self.stderr}"
        return json.loads(self.summary_out.read_text())  # type: ignore[no-any-return]

    @property
    def counters(self) -> dict[str, int]:
        return self.summary["counters"]  # type: ignore[no-any-return]

    @property
    def massif_text(self) -> str:
        assert self.massif_out.exists(), f"no massif.out written at {self.massif_out}; stderr:\n{self.stderr}"
        return self.massif_out.read_text()
