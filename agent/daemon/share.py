"""The daemon's total of samples a second (--total-samples), shared among its sampled targets.

A sample costs the process that takes it some 10-20 us (docs/benchmarks.md), so the per-process budget
(--max-samples) bounds one process's cost, not a prefork server's: forty busy workers under theirs take forty
times it. Once a second the daemon takes each armed sampler's samples as its profile's look last read them,
estimates what it would take at its asked rate (the samples over the time between readings, times its rate in
force over the asked rate), and moves every budget to the max-min fair share of the total
(agent.model.sampling.share_level): a process wanting less than its share keeps its asked rate, the busy ones share
what is left. A sampler reads its budget at each sample; each sample keeps the weight of the rate it was drawn at,
so the estimates stay unbiased, from fewer samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.model.sampling import share_budget, share_level
from agent.session.sampled import SamplerLink

SHARE_EVERY = 1.0  # seconds between shares: a sampler's budget window is a second
SMOOTH = 0.5  # the latest second's weight in a target's demand: one burst does not move every budget
MOVE = 0.1  # a budget is written when the share moves it by more than this fraction


@dataclass
class _Seen:
    at: float  # time.monotonic of the reading
    samples: int  # the sampler's samples since arming
    demand: float | None  # samples a second at the asked rate, smoothed; None before a second reading


def _moved(now: int, to: int) -> bool:
    """Whether a budget of `now` is far enough from `to` to be written (0: no budget)."""
    if now == 0 or to == 0:
        return now != to
    return abs(to - now) > MOVE * now


class SampleShare:
    """The total shared among the samplers given at each tick. `total` 0: no total (each keeps its own budget)."""

    def __init__(self, total: int, say: Callable[[str], None]) -> None:
        self.total = total
        self.say = say
        self.level: float | None = None  # the share's level, samples a second; None: nobody held back
        self.demand = 0.0  # what the targets would take together at their asked rates, samples a second
        self._seen: dict[SamplerLink, _Seen] = {}
        self._held = False  # whether the last tick held some back (said when it starts and ends)

    def tick(self, links: Sequence[SamplerLink]) -> None:
        seen: dict[SamplerLink, _Seen] = {}
        for link in links:
            reading = link.sampling()
            if reading is None:
                continue
            at, samples, in_force = reading
            before = self._seen.get(link)
            demand = before.demand if before is not None else None
            if before is not None and at > before.at and samples >= before.samples:
                latest = (samples - before.samples) / (at - before.at) * in_force / link.rate
                demand = latest if demand is None else SMOOTH * latest + (1 - SMOOTH) * demand
            seen[link] = _Seen(at, samples, demand)
        self._seen = seen
        demands = [s.demand or 0.0 for s in seen.values()]
        self.demand = sum(demands)
        self.level = share_level(demands, self.total) if self.total else None
        for link in seen:
            budget = share_budget(self.level, link.max_samples)
            if _moved(link.budget, budget):
                link.set_budget(budget)
        held = self.level is not None
        if held != self._held:
            self._held = held
            if held:
                self.say(f"sampling: {len(seen)} processes would take {self.demand:.0f} samples a second, more "
                         f"than the total of {self.total} (--total-samples): the busiest take at most "
                         f"{self.held_level()} a second each, at a higher rate in force (the estimates "
                         "stay unbiased, from fewer samples)")
            else:
                self.say(f"sampling: the processes take {self.demand:.0f} samples a second, within the total of "
                         f"{self.total}: each is back at its own budget")

    def run(self, links: Callable[[], Sequence[SamplerLink]], stop: threading.Event) -> None:
        """Share once a second until `stop`."""
        failed = False
        while not stop.wait(SHARE_EVERY):
            try:
                self.tick(links())
            except Exception as exc:  # one of heapscope's own faults: said once, the daemon goes on
                if not failed:
                    failed = True
                    self.say(f"sampling: the total could not be shared ({type(exc).__name__}: {exc}); each "
                             "sampler keeps the budget it has")

    def held_level(self) -> int:
        """The share's level in samples a second (0: nobody held back), for the fleet's status."""
        return 0 if self.level is None else share_budget(self.level, 0)
