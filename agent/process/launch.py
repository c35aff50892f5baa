"""Start a program held before exec, so probes are attached before its first instruction runs.

The child is forked and blocks on a pipe; `release()` lets it exec. Its PID is known before the loader runs,
so not even the dynamic loader's and constructors' allocations are missed (the probes arm at the exec).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence

from agent.errors import TargetError


class HeldChild:
    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        if not argv:
            raise TargetError("no program given: heapscope run [options] -- PROG [ARGS]", 2)
        path = argv[0] if "/" in argv[0] else shutil.which(argv[0])
        if path is None or not os.path.isfile(path):
            raise TargetError(f"program not found: {argv[0]}", 127)
        if not os.access(path, os.X_OK):
            raise TargetError(f"program is not executable: {path}", 126)
        self.path = os.path.abspath(path)
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self._go_r, self._go_w = os.pipe()
        self._err_r, self._err_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:  # child: wait for the go, then become the program
            try:
                os.close(self._go_w)
                os.close(self._err_r)
                if os.read(self._go_r, 1) != b"x":
                    os._exit(125)
                os.close(self._go_r)
                os.execve(self.path, self.argv, self.env)
            except BaseException as exc:  # exec failed: tell the parent why
                try:
                    os.write(self._err_w, str(exc).encode()[:200])
                finally:
                    os._exit(127)
        os.close(self._go_r)
        os.close(self._err_w)
        self._status: int | None = None

    def release(self) -> None:
        """Let the child exec; raise if the exec fails."""
        os.write(self._go_w, b"x")
        os.close(self._go_w)
        with os.fdopen(self._err_r, "rb") as err:
            message = err.read()  # EOF at a successful exec (close-on-exec), or the error text
        if message:
            self.wait()
            raise TargetError(f"cannot execute {self.path}: {message.decode(errors='replace')}", 126)

    def abandon(self) -> None:
        """Setting up failed before release: end the held child."""
        with contextlib.suppress(OSError):
            os.close(self._go_w)  # the child reads EOF and exits
        self.wait()

    def poll(self) -> int | None:
        if self._status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._status = os.waitstatus_to_exitcode(status)
        return self._status

    def wait(self) -> int:
        while self._status is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except InterruptedError:
                continue
            self._status = os.waitstatus_to_exitcode(status)
        return self._status

    def forward(self, signum: int) -> None:
        if self._status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    @staticmethod
    def exit_code(status: int) -> int:
        """Shell convention: a child killed by signal N gives 128 + N."""
        return 128 - status if status < 0 else status
