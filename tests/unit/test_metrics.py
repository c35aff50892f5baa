"""The Prometheus collector, over a fake daemon: values, naming conventions (checked by the real promtool),
bounded site cardinality, and a fresh build at every scrape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.export.metrics import HeapscopeCollector
from agent.model.stack import SiteCounts
from tests.support.fake_daemon import FakeManager, FakeTarget, frame, sample_sites


def scrape(manager: FakeManager, top: int = 10) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeapscopeCollector(manager, top))
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """A series' value; a per-target series' placement labels are "" unless given."""
    if "pid" in labels:
        labels = {"cgroup": "", "unit": "", "container": "", "pod": "", **labels}
    return samples(text)[(name, frozenset(labels.items()))]


def test_values_per_target() -> None:
    a = FakeTarget(pid=10, command="api")
    b = FakeTarget(pid=20, command="worker", state="exited", sites=sample_sites(0))
    text = scrape(FakeManager([a, b]))
    ca = a.counters()
    assert value(text, "heapscope_targets") == 2
    assert value(text, "heapscope_heap_useful_bytes", pid="10", command="api") == ca.heap
    assert value(text, "heapscope_heap_extra_bytes", pid="10", command="api") == ca.extra
    assert value(text, "heapscope_heap_peak_useful_bytes", pid="10", command="api") == ca.peak_heap
    assert value(text, "heapscope_heap_live_blocks", pid="10", command="api") == ca.blocks
    assert value(text, "heapscope_allocated_bytes_total", pid="10", command="api") == ca.alloc_bytes
    assert value(text, "heapscope_freed_bytes_total", pid="10", command="api") == ca.freed_bytes
    assert value(text, "heapscope_allocation_calls_total", pid="10", command="api") == ca.n_allocs
    assert value(text, "heapscope_free_calls_total", pid="10", command="api") == ca.n_frees
    assert value(text, "heapscope_realloc_calls_total", pid="10", command="api") == ca.n_reallocs == 3
    assert value(text, "heapscope_untracked_frees_total", pid="10", command="api") == 2
    assert value(text, "heapscope_map_full_drops_total", pid="10", command="api", map="blocks") == 1
    assert value(text, "heapscope_map_full_drops_total", pid="10", command="api", map="malt_sizes") == 3
    pages = a.page_totals()
    assert pages is not None
    assert value(text, "heapscope_mapped_bytes", pid="10", command="api") == pages.mapped
    assert value(text, "heapscope_mapped_peak_bytes", pid="10", command="api") == pages.peak_mapped
    assert value(text, "heapscope_page_syscalls_total", pid="10", command="api") == pages.syscalls
    assert value(text, "heapscope_map_full_drops_total", pid="10", command="api", map="page_events") == 0
    assert value(text, "heapscope_target_exited", pid="20", command="worker") == 1
    assert value(text, "heapscope_target_exited", pid="10", command="api") == 0
    big = "make_big (prog.c:10)"
    assert value(text, "heapscope_site_live_bytes", pid="10", command="api", site=big) == 60_000
    assert value(text, "heapscope_site_live_blocks", pid="10", command="api", site=big) == 6


def test_site_series_are_bounded() -> None:
    many = {((frame(0x500000 + 16 * i, f"f{i}", i + 1),)): SiteCounts(cur_bytes=1000 + i, cur_blocks=1)
            for i in range(500)}
    target = FakeTarget(pid=10, sites=many)
    text = scrape(FakeManager([target]), top=10)
    sites = {dict(labels)["site"]: v for (name, labels), v in samples(text).items()
             if name == "heapscope_site_live_bytes"}
    assert len(sites) == 11
    top = sorted((1000 + i for i in range(500)), reverse=True)
    assert sorted((v for s, v in sites.items() if s != "(other sites)"), reverse=True) == top[:10]
    assert sites["(other sites)"] == sum(top[10:])
    assert sum(sites.values()) == target.counters().heap


def test_each_scrape_reads_afresh() -> None:
    target = FakeTarget(pid=10)
    manager = FakeManager([target])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeapscopeCollector(manager, 10))
    before = generate_latest(registry).decode()
    target.sites[(frame(0x409000, "late", 7),)] = SiteCounts(cur_bytes=777, cur_blocks=1, tot_bytes=777, tot_blocks=1)
    after = generate_latest(registry).decode()
    key = {"pid": "10", "command": "prog"}
    name = "heapscope_heap_useful_bytes"
    assert value(after, name, **key) == value(before, name, **key) + 777


def test_registration_does_not_collect() -> None:
    target = FakeTarget(pid=10, fail_with=AssertionError("collected at registration"))
    CollectorRegistry().register(HeapscopeCollector(FakeManager([target]), 10))


def test_no_targets() -> None:
    text = scrape(FakeManager())
    assert value(text, "heapscope_targets") == 0


@pytest.mark.needs("promtool")
def test_promtool_accepts_the_exposition() -> None:
    odd = {(frame(0x401000, 'op"er\\ator new\n', 3),): SiteCounts(cur_bytes=5, cur_blocks=1)}
    text = scrape(FakeManager([FakeTarget(pid=10), FakeTarget(pid=11, command="we ird\"", sites=odd)]))
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr
