"""heapscope's own lines on standard error: one write a line, and a log that fails never ends a profile.

A log nobody reads any more is common: `heapscope attach … 2>&1 | grep -m1 'probes attached'` closes the pipe
once grep has its line, a terminal goes away, a log file's disk fills. A write that fails there raised in the
thread that said the line (the profile's), which ended the profile after its first stored seconds while the
target ran on. Now such a line is counted as lost, and the count is said once writing works again (and is
shown by the daemon's metrics).
"""

from __future__ import annotations

import sys
import threading

PROG = "heapscope"


class LineLog:
    """Lines to the current sys.stderr (the daemon points it at a duplicate of fd 2), each as one write."""

    def __init__(self, prog: str = PROG) -> None:
        self.prog = prog
        self.lost = 0  # lines that could not be written
        self._unsaid = 0  # of those, the ones not yet said to have been lost
        self._lock = threading.Lock()  # a daemon's threads say things at once

    def say(self, line: str) -> None:
        with self._lock:
            if self._unsaid:
                text = f"{self.prog}: {self._unsaid} earlier lines of this log could not be written\n"
                if not self._write(text):
                    self._lost_one()
                    return
                self._unsaid = 0
            if not self._write(f"{self.prog}: {line}\n"):
                self._lost_one()

    def _lost_one(self) -> None:
        self.lost += 1
        self._unsaid += 1

    @staticmethod
    def _write(text: str) -> bool:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):  # EPIPE, EIO, ENOSPC; ValueError: the stream was closed
            return False
        return True


LOG = LineLog()  # the process has one standard error
