"""Waiting on a condition rather than for a fixed time: the test goes on as soon as what it waits for holds, however
loaded the machine, and says what never came when it gives up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.1) -> T:
    """Call `check` until it returns a true value, and return that value; after `timeout` seconds, fail naming
    `what`. It is called at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
