"""`heapscope attach` run in the background by a test, its stderr read as it comes."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

TIMEOUT = 60.0


class Attach:
    """`heapscope attach` in the background, its stderr collected line by line."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append("")  # EOF
            self._cond.notify_all()

    @property
    def stderr(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        with self._cond:
            while not any(text in line for line in self.lines):
                if "" in self.lines or time.monotonic() > deadline:
                    raise AssertionError(f"heapscope never said {text!r}:\n{''.join(self.lines)}")
                self._cond.wait(0.5)

    def end(self, sig: int = signal.SIGINT) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(TIMEOUT)
        self._reader.join(TIMEOUT)
        assert "Traceback" not in self.stderr, self.stderr
        return code
