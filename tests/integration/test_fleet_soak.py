"""bench/fleet_soak.py for one minute: services starting, forking, restarting and exiting under a selector, and
attach/detach cycles through the API, with no target crash, no wrong result, no probe left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import REPO

pytestmark = pytest.mark.integration


def test_a_one_minute_soak(bpf_ready: None, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fleet_soak.py"), "--duration", "60", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert out.exists(), done.stderr
    report = json.loads(out.read_text())
    assert report["target_crashes"] == 0, report["crashes"]
    assert report["wrong_results"] == 0, report["wrong"]
    assert report["leaked_probes"] == {} and report["targets_left"] == [], report
    assert report["daemon_bpf_fds_after"] == report["daemon_bpf_fds_before"]
    counts = report["counts"]
    assert counts["services started"] >= 2 and counts["workers restarted"] >= 1
    assert counts["attach/detach cycles"] >= 3 and counts["results checked"] >= 5
    assert counts["attach/detach cycles (exact)"] >= 1 and counts["attach/detach cycles (sampled)"] >= 1
    assert report["cyclers"] == 3
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    memory = report["daemon_memory_each_minute"]
    assert memory and all(m["RssAnon"] > 0 and m["RssFile"] > 0 and m["Threads"] >= 3 and m["fds"] > 0 for m in memory)
    assert len(report["daemon_rss_ten_minute_medians_mib"]) == 1 and report["daemon_rss_ten_minute_medians_mib"][0] > 0
