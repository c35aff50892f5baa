"""A driver for the test programs that talk over stdin/stdout, one word a step."""

from __future__ import annotations

import subprocess


class Conversation:
    """A program that prints a word when it reaches a step and waits for a word to go on."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == word, f"expected {word!r} from the program, got {line!r} (exit {self.proc.poll()})"

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """End it if it still runs (a test's `finally`)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
