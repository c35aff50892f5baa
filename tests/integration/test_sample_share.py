"""A daemon's total of samples a second (--total-samples, agent/daemon/share.py) on real samplers: four processes
churning far above their budgets share the default total (500 a CPU), each sampler's budget moves to the share
while armed and its rate in force follows; the metrics say the total, the demand and the share. Its twin with no
total keeps each process at its own budget of 500 and samples at a lower rate in force."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.model.sampling import DEFAULT_MAX_SAMPLES, DEFAULT_SAMPLE_RATE
from tests.support.conversation import Conversation
from tests.support.daemon import start_daemon, stop_daemon
from tests.support.wait import wait_for

CHURNS = 4
SECONDS = 10
PER_CPU = 500  # DEFAULT_TOTAL_SAMPLES_PER_CPU, restated: the test checks the documented default


@pytest.fixture(scope="module")
def churn(build: Callable[..., Path]) -> Path:
    return build("budget_churn.c")


def _metric(text: str, name: str, pid: int | None = None) -> float:
    where = rf'{{[^}}]*pid="{pid}"[^}}]*}}' if pid is not None else ""
    found = re.search(rf"^{name}{where} (\S+)$", text, re.M)
    assert found is not None, (name, pid)
    return float(found[1])


def _share_run(churn: Path, heapscope_cmd: list[str], tmp: Path, settled: Callable[[str, list[int]], bool],
               *extra: str) -> tuple[str, list[int], str]:
    """CHURNS budget_churns at 2 GB a second each (some 3,600 samples a second at the default rate), attached by a
    sampled daemon; the metrics once `settled` says so, the pids, and the daemon's log."""
    daemon = start_daemon(heapscope_cmd, tmp, "--mode=sampled", *extra)
    targets = [Conversation([str(churn), str(SECONDS)]) for _ in range(CHURNS)]
    try:
        for t in targets:
            t.expect("ready")
        pids = [t.pid for t in targets]
        with daemon.client() as c:
            for pid in pids:
                r = c.post("/targets", json={"pid": pid})
                assert r.status_code == 201, r.text
            for t in targets:
                t.say("go")

            def metrics() -> str | None:
                text = c.get("/metrics").text
                return text if settled(text, pids) else None

            text = wait_for(metrics, SECONDS - 2, "the samplers settled")
        for t in targets:
            t.expect("done")
    finally:
        for t in targets:
            t.kill()
        stop_daemon(daemon)
    return text, pids, daemon.log.read_text()


def test_busy_processes_share_the_default_total_and_their_samplers_follow(
    churn: Path, heapscope_cmd: list[str], tmp_path: Path
) -> None:
    total = PER_CPU * len(os.sched_getaffinity(0))
    share = int(total / CHURNS)
    if share >= DEFAULT_MAX_SAMPLES:
        pytest.skip(f"{total} samples a second ({PER_CPU} a CPU here) exceed {CHURNS} churns' budgets together")

    def shared(text: str, pids: list[int]) -> bool:
        """Each budget at the share and each rate in force well above what the process's own budget gives."""
        return all(_metric(text, "heapscope_sample_budget", p) <= 1.1 * share and
                   _metric(text, "heapscope_sample_rate_in_force_bytes", p) > 10 * DEFAULT_SAMPLE_RATE for p in pids)

    text, pids, log = _share_run(churn, heapscope_cmd, tmp_path, shared)
    assert _metric(text, "heapscope_sampling_limit") == total
    demand = _metric(text, "heapscope_sampling_demand")
    assert demand > 2 * total, demand  # some 3,600 a second each at the asked rate
    assert 0.9 * share <= _metric(text, "heapscope_sampling_share") <= 1.1 * share
    budgets = [_metric(text, "heapscope_sample_budget", p) for p in pids]
    assert all(0.9 * share <= b <= 1.1 * share for b in budgets), budgets
    assert f"{CHURNS} processes would take" in log and f"than the total of {total}" in log, log
    shared_rates = [_metric(text, "heapscope_sample_rate_in_force_bytes", p) for p in pids]

    # The twin: no total, each at its own budget of 500, sampled at about half the rate in force.
    own = tmp_path / "own"
    own.mkdir()

    def own_budget(text: str, pids: list[int]) -> bool:
        return all(_metric(text, "heapscope_sample_rate_changes_total", p) >= 1 for p in pids)

    text, pids, log = _share_run(churn, heapscope_cmd, own, own_budget, "--total-samples=0")
    assert _metric(text, "heapscope_sampling_limit") == 0 and _metric(text, "heapscope_sampling_share") == 0
    assert [_metric(text, "heapscope_sample_budget", p) for p in pids] == [DEFAULT_MAX_SAMPLES] * CHURNS
    own_rates = [_metric(text, "heapscope_sample_rate_in_force_bytes", p) for p in pids]
    print(f"total {total}, share {share}: rates in force {shared_rates}; own budgets: {own_rates}")
    assert min(shared_rates) > 1.4 * max(own_rates), (shared_rates, own_rates)
    assert "processes would take" not in log


def test_total_samples_is_a_daemons_option(heapscope_cmd: list[str], tmp_path: Path) -> None:
    """One process has --max-samples; --total-samples without a daemon is a usage error in one line."""
    r = subprocess.run([*heapscope_cmd, "attach", str(os.getpid()), "--total-samples=100"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--total-samples applies to a daemon" in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
