"""Answers about processes kept for a while, under what decides them: a prefork server's worker or a database's
backend asks what its parent asked (its allocator, its unsafe ranges), and finding it again took milliseconds of
each attach."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class RecentAnswers(Generic[V]):
    """At most `limit` answers, each trusted for `seconds` (a file rewritten in place keeps its inode; a debug file
    installed meanwhile would change an answer), the least recently asked for going first. Any thread."""

    def __init__(self, limit: int = 64, seconds: float = 60.0) -> None:
        self.limit, self.seconds = limit, seconds
        self._answers: OrderedDict[Hashable, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            known = self._answers.get(key)
            if known is None or time.monotonic() - known[0] >= self.seconds:
                return None
            self._answers.move_to_end(key)
            return known[1]

    def put(self, key: Hashable, answer: V) -> None:
        with self._lock:
            self._answers[key] = (time.monotonic(), answer)
            self._answers.move_to_end(key)
            while len(self._answers) > self.limit:
                self._answers.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()
