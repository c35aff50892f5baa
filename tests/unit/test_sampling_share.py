"""A daemon's total of samples a second shared among its targets (agent/model/sampling.py share_level and
share_budget, agent/daemon/share.py): the level is max-min fair, a budget moves only when the share moves it
enough, and the estimate of what each would take comes from its samples at its rate in force. The samplers here
are stand-ins (pure logic); the real ones are in tests/integration/test_sample_share.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pytest

from agent.daemon.share import SampleShare
from agent.model.sampling import MIN_SHARE, share_budget, share_level
from agent.process.sampler import within_budget
from agent.session.sampled import SamplerLink


def test_the_level_leaves_a_small_demand_alone_and_splits_the_rest() -> None:
    assert share_level([100, 200], 1000) is None  # within the total: nobody held back
    assert share_level([], 1000) is None
    # 40 busy workers and an idle master: each busy one gets a fortieth.
    assert share_level([200.0] * 40 + [0.0], 1000) == pytest.approx(25.0)
    # The small ones keep what they want; the two big ones share the rest.
    level = share_level([50, 100, 3000, 5000], 1000)
    assert level == pytest.approx(425.0)
    assert sum(min(d, level) for d in (50, 100, 3000, 5000)) == pytest.approx(1000)


def test_a_budget_is_the_level_within_the_per_process_cap_and_never_below_the_floor() -> None:
    assert share_budget(None, 500) == 500  # nobody held back: the process's own budget
    assert share_budget(None, 0) == 0
    assert share_budget(25.7, 500) == 25
    assert share_budget(800.0, 500) == 500
    assert share_budget(800.0, 0) == 800  # no per-process cap: the share is the budget
    assert share_budget(0.5, 500) == MIN_SHARE


@dataclass(eq=False)
class Link:
    """A sampler as the share sees it: its samples since arming, its rate in force, its budget."""

    rate: int = 524288
    max_samples: int = 500
    budget: int = 500
    samples: int = 0
    in_force: int = 524288
    armed: bool = True
    at: float = 0.0  # when its profile's look last read it
    writes: list[int] = field(default_factory=list)

    def sampling(self) -> tuple[float, int, int] | None:
        return (self.at, self.samples, self.in_force) if self.armed else None

    def set_budget(self, max_samples: int) -> None:
        self.writes.append(max_samples)
        self.budget = max_samples


def _tick(share: SampleShare, links: list[Link], at: float) -> None:
    """A tick after each link's look read it at `at`."""
    for link in links:
        link.at = at
    share.tick(cast(list[SamplerLink], links))


def _four_busy(share: SampleShare) -> list[Link]:
    """Four samplers that took 1,000 samples each in the second between two ticks."""
    links = [Link() for _ in range(4)]
    _tick(share, links, 0.0)
    for link in links:
        link.samples += 1000
    _tick(share, links, 1.0)
    return links


def test_busy_workers_share_the_total_and_an_idle_master_is_left_alone() -> None:
    said: list[str] = []
    share = SampleShare(1000, said.append)
    workers = [Link() for _ in range(10)]
    master = Link()
    links = [*workers, master]
    _tick(share, links, 0.0)
    assert share.level is None and not said and all(not link.writes for link in links)  # no demand known yet
    for w in workers:
        w.samples += 400  # 400 a second each at the asked rate: 4,000 together
    _tick(share, links, 1.0)
    assert share.demand == pytest.approx(4000)
    assert share.level == pytest.approx(100)
    assert [w.budget for w in workers] == [100] * 10
    assert master.budget == 100  # what it forks inherits the share
    assert len(said) == 1 and "4000 samples a second" in said[0] and "at most 100" in said[0]
    # Held at 100 a second by a rate in force four times the asked one: the demand read stays 400 each.
    for w in workers:
        w.samples += 100
        w.in_force = 4 * 524288
    _tick(share, links, 2.0)
    assert share.demand == pytest.approx(4000)
    assert all(w.writes == [100] for w in workers)  # unmoved: not written again
    assert share.held_level() == 100


def test_the_budgets_come_back_when_the_demand_falls() -> None:
    said: list[str] = []
    share = SampleShare(1000, said.append)
    links = _four_busy(share)
    assert [link.budget for link in links] == [250] * 4
    for t in range(2, 8):  # quiet: 20 a second each, the smoothed demand falls below the total
        for link in links:
            link.samples += 20
        _tick(share, links, float(t))
    assert share.level is None and share.held_level() == 0
    assert [link.budget for link in links] == [500] * 4
    assert len(said) == 2 and "each is back at its own budget" in said[1]


def test_a_small_move_is_not_written_and_a_gone_sampler_is_left_out() -> None:
    share = SampleShare(1000, lambda _: None)
    busy = [Link() for _ in range(3)]
    small = Link()
    links = [*busy, small]

    def second(at: float, small_wants: int) -> None:
        for link in busy:
            link.samples += 400
        small.samples += small_wants
        _tick(share, links, at)

    _tick(share, links, 0.0)
    second(1.0, 0)
    assert [link.budget for link in busy] == [333] * 3
    second(2.0, 120)  # the small one now wants 60 a second (smoothed): the level 313, 6% lower
    assert share.level == pytest.approx(313.3, abs=0.1)
    assert all(link.writes == [333] for link in busy)  # within MOVE: not written
    second(3.0, 250)  # 155 a second smoothed: the level 281.7, 15% lower
    assert [link.budget for link in busy] == [281] * 3
    small.armed = False  # disarmed or gone: no reading, not counted
    second(4.0, 0)
    assert share.demand == pytest.approx(1200) and share.level == pytest.approx(333.3, abs=0.1)


def test_no_total_leaves_every_budget_as_it_is() -> None:
    share = SampleShare(0, lambda _: None)
    links = [Link() for _ in range(3)]
    _tick(share, links, 0.0)
    for link in links:
        link.samples += 5000
    _tick(share, links, 1.0)
    assert share.level is None and all(not link.writes for link in links)


def test_a_forked_child_keeps_its_parents_share_but_not_a_budget_above_its_own() -> None:
    """A child forked armed comes with its parent's budget: a share below the profile's --max-samples is kept (the
    daemon moves it at its next share), a higher one or none is brought down to the profile's."""
    assert within_budget(100, 500) and within_budget(500, 500)
    assert not within_budget(800, 500) and not within_budget(0, 500)
    assert within_budget(100, 0) and within_budget(0, 0)


def test_a_reading_not_taken_again_since_the_last_tick_keeps_its_demand() -> None:
    """The share uses what the profile's look last read: a tick that comes before the next look sees the same
    reading, and neither the demand nor the budgets move."""
    share = SampleShare(1000, lambda _: None)
    links = _four_busy(share)
    assert share.demand == pytest.approx(4000) and [link.budget for link in links] == [250] * 4
    share.tick(cast(list[SamplerLink], links))  # no look since: the same readings
    assert share.demand == pytest.approx(4000) and all(link.writes == [250] for link in links)
