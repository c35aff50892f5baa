"""`heapscope` with each of the phases named in $HEAPSCOPE_PHASES timed in CPU (time.thread_time), thread by thread:
the launcher bench/worker_cost.py runs the daemon under. Not part of heapscope.

    HEAPSCOPE_PHASES=agent.session.session:Session.sample,... HEAPSCOPE_PHASES_OUT=out.json \\
        .venv/bin/python bench/phase_timer.py serve ...

Each phase is a function, as module:qualified.name; its time is inclusive (a phase called inside another is counted
in both). SIGUSR1 starts the count again (after the warm-up); SIGUSR2 writes it to OUT (at the load's end): for each
thread that ran a timed phase since, its name, whether its TargetManager._profile started and ended in between (a
life counted whole), and its CPU and calls per phase.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WHOLE_LIFE = "TargetManager._profile"  # a followed process's profile thread: from its attach to its files
_lock = threading.Lock()
_threads: list[dict[str, Any]] = []  # each thread's {"name", "phases": {phase: [calls, cpu]}, "started", "ended"}
_generation = 0  # moved on by SIGUSR1
_own = threading.local()  # this thread's record (not by its ident: a new thread soon has an ended one's)


def _thread_record() -> dict[str, Any]:
    if getattr(_own, "generation", None) != _generation:
        _own.generation = _generation
        _own.record = {"name": threading.current_thread().name, "phases": {}, "started": False, "ended": False}
        _threads.append(_own.record)
    rec: dict[str, Any] = _own.record
    return rec


def _timed(qualname: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if qualname == WHOLE_LIFE:
            with _lock:
                _thread_record()["started"] = True
        began = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - began
            with _lock:
                rec = _thread_record()
                calls_cpu = rec["phases"].setdefault(qualname, [0, 0.0])
                calls_cpu[0] += 1
                calls_cpu[1] += spent
                if qualname == WHOLE_LIFE:
                    rec["ended"] = True

    return timed


def install(specs: str) -> None:
    for spec in filter(None, specs.split(",")):
        module_name, qualname = spec.split(":")
        owner: Any = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, _timed(qualname, getattr(owner, attr)))


def _restart(*_: Any) -> None:
    global _generation
    with _lock:
        _threads.clear()  # a profile running now has started before: its life is not counted whole
        _generation += 1


def _dump(*_: Any) -> None:
    target = os.environ["HEAPSCOPE_PHASES_OUT"]
    with _lock, open(target + ".tmp", "w") as out:
        json.dump(_threads, out)
    os.replace(target + ".tmp", target)  # whole when it appears


if __name__ == "__main__":
    install(os.environ.get("HEAPSCOPE_PHASES", ""))
    signal.signal(signal.SIGUSR1, _restart)
    signal.signal(signal.SIGUSR2, _dump)
    sys.argv[0] = "heapscope"
    from agent.cli import main

    sys.exit(main())
