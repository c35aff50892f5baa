"""What is growing, live: real programs profiled by the real CLI into a real store, judged by `heapscope growth`.

- growth_service.c (a steady leak of 200,000 B/s, a cache that fills at 400,000 B/s for 28 s then stops, a sawtooth
  of 1.65 MB every 3.3 s) is profiled 45 s by `heapscope attach --store`, in exact mode and in sampled mode at a
  rate that gives the leak ~124 samples a second, both at once: over the last 20 s the leak is ranked first and
  is a suspect, the cache and the sawtooth are not, and the leak's rate is within 10% of the truth the program
  printed (its own count of leaked bytes against CLOCK_REALTIME, the store's clock).
- mmap_growth.c keeps a flat heap while it maps and touches 2.5 MiB/s with mmap(2): the process verdict says the
  heap is flat but RSS grows, with memory mapped outside malloc.
- The web page (`heapscope run --http --store`): its "What is growing" panel, in headless Chromium, lists the
  leak first as a suspect with its line, and opens its stack; the daemon's /growth and /metrics say the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.attach import Attach
from tests.support.browser import by_css, chromium, outside, requested_urls, retry, screenshot, wait_until
from tests.support.daemon import answers, free_port
from tests.support.sources import source_line
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

PROFILE_S = 45  # what the issue asks: the last 20 s of a 45 s profile
WINDOW_S = 20
LEAK_B_PER_S = 200_000
SAMPLE_RATE = 1024  # the leak's 1000 B blocks: p = 0.62, ~124 samples a second, ~2,500 in the window


LEAK = f"leak_one (growth_service.c:{source_line('growth_service.c', 'malloc(1000)')})"
CACHE = f"cache_fill (growth_service.c:{source_line('growth_service.c', 'malloc(10000)')})"
SAW = f"saw_tooth (growth_service.c:{source_line('growth_service.c', 'malloc(50000)')})"


class Service:
    """A program that says "ready", starts on a line of stdin, and prints its progress (read by a thread)."""

    def __init__(self, program: Path, *args: str) -> None:
        self.proc = subprocess.Popen([str(program), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "ready\n"
        self.log: list[tuple[int, int]] = []  # (wall ns, leaked bytes), as growth_service prints them
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            wall, leaked = line.split()
            self.log.append((int(wall), int(leaked)))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def leaked_at(self, wall_ns: int) -> float:
        """The program's leaked bytes at a moment, interpolated between its lines (every 100 ms)."""
        for (t0, b0), (t1, b1) in zip(self.log, self.log[1:], strict=False):
            if t0 <= wall_ns <= t1:
                return b0 + (b1 - b0) * (wall_ns - t0) / (t1 - t0)
        raise AssertionError(f"{wall_ns} is outside the program's log ({self.log[0][0]} to {self.log[-1][0]})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Profiled:
    store: Path
    service: Service
    stderr: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def growth(cmd: list[str], store: Path, *args: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([*cmd, "growth", str(store), "--format", "json", "--top", "0", *args],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def profiled(heapscope_cmd: list[str], build: Callable[..., Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Profiled]]:
    """growth_service in exact and in sampled mode, and mmap_growth, each under its own `heapscope attach --store`,
    all at once: 45 s of profile from the moment each program starts its work."""
    tmp = tmp_path_factory.mktemp("growth")
    service, mapper = build("growth_service.c"), build("mmap_growth.c")
    runs = {
        "exact": (service, ("28", str(PROFILE_S + 15)), ("--mode=exact",)),
        "sampled": (service, ("28", str(PROFILE_S + 15)), ("--mode=sampled", f"--sample-rate={SAMPLE_RATE}")),
        "mmap": (mapper, (str(PROFILE_S + 15),), ("--mode=exact",)),
    }
    out: dict[str, Profiled] = {}
    attaches: dict[str, Attach] = {}
    try:
        for name, (program, args, mode) in runs.items():
            svc = Service(program, *args)
            store = tmp / f"store-{name}"
            out[name] = Profiled(store, svc)
            attaches[name] = Attach([
                *heapscope_cmd, "attach", *mode, "--store", str(store), "--store-interval", "0.5",
                "--store-quiet-interval", "0.5", f"--massif-out-file={tmp / name}.out", str(svc.pid),
            ], tmp)
        for name, a in attaches.items():
            a.wait_for("keeping the history in")
            a.wait_for("sampler armed" if name == "sampled" else "probes attached")
            wait_for(lambda s=out[name].store: any(s.glob("*/seg-*.hss")), 60, f"the {name} store's first sample")
        for p in out.values():
            p.service.go()
        time.sleep(PROFILE_S)
        for name, a in attaches.items():
            assert a.end() == 0, a.stderr
            out[name].stderr = a.stderr
        yield out
    finally:
        for a in attaches.values():
            if a.proc.poll() is None:
                a.proc.kill()
                a.proc.wait()
        for p in out.values():
            p.service.kill()


def check_service(cmd: list[str], p: Profiled) -> dict:  # type: ignore[type-arg]
    doc = growth(cmd, p.store, "--window", str(WINDOW_S))
    assert doc["window_s"] == pytest.approx(WINDOW_S, abs=0.01) and doc["snapshots"] >= 2 * WINDOW_S
    sites = {s["site"]: s for s in doc["sites"]}
    first = doc["sites"][0]
    assert first["site"] == LEAK and first["suspect"] and first["verdict"] == "leak suspect", doc["sites"][:4]
    assert [s["site"] for s in doc["sites"] if s["suspect"]] == [LEAK]
    assert sites[CACHE]["verdict"] in ("grew then stopped", "flat"), sites[CACHE]
    assert sites[SAW]["verdict"] == "churn", sites[SAW]
    assert LEAK in first["stack"][0] and first["stack"][-1].startswith("main (growth_service.c:")
    # the truth over the same window, from the program's own count
    start, end = doc["start_wall_ns"], doc["end_wall_ns"]
    truth = (p.service.leaked_at(end) - p.service.leaked_at(start)) / ((end - start) / 1e9)
    assert truth == pytest.approx(LEAK_B_PER_S, rel=0.05)  # the program kept its pace
    error = first["bytes_per_s"] / truth - 1
    print(f"{doc['mode']}: leak {first['bytes_per_s']:,.0f} B/s against {truth:,.0f} B/s ({100 * error:+.2f}%), "
          f"ranked {[s['site'].split()[0] for s in doc['sites'][:3]]}, verdicts {doc['counts']}")
    assert abs(error) <= 0.10
    return doc


def test_exact_mode_ranks_the_leak_first(heapscope_cmd: list[str], profiled: dict[str, Profiled]) -> None:
    doc = check_service(heapscope_cmd, profiled["exact"])
    assert doc["mode"] == "exact"
    # the cache stopped 28 s after the start, inside the window: it grew, then stopped
    cache = next(s for s in doc["sites"] if s["site"] == CACHE)
    assert cache["verdict"] == "grew then stopped" and cache["added_B"] > 0


def test_sampled_mode_ranks_the_leak_first(heapscope_cmd: list[str], profiled: dict[str, Profiled]) -> None:
    doc = check_service(heapscope_cmd, profiled["sampled"])
    assert doc["mode"] == "sampled" and doc["sample_rate"] == SAMPLE_RATE
    leak = doc["sites"][0]
    assert leak["samples"] >= 1500  # enough to judge it: ~124 a second over 20 s


def test_a_flat_heap_beside_growing_mappings_is_said(heapscope_cmd: list[str],
                                                     profiled: dict[str, Profiled]) -> None:
    doc = growth(heapscope_cmd, profiled["mmap"].store, "--window", str(WINDOW_S))
    proc = doc["process"]
    assert proc["verdict"] == "grows outside the heap", proc
    assert proc["said"].startswith("the heap is flat but RSS grows"), proc["said"]
    assert "mapped outside malloc" in proc["said"]
    assert proc["heap"]["trend"] == "flat" and proc["heap"]["start_B"] == proc["heap"]["end_B"] == 100 * 10000
    assert proc["mapped"]["trend"] == "grows" and proc["rss"]["trend"] == "grows"
    assert proc["mapped"]["bytes_per_s"] == pytest.approx(2.5 * (1 << 20), rel=0.10)
    assert doc["suspects"] == 0
    text = subprocess.run([*heapscope_cmd, "growth", str(profiled["mmap"].store), "--window", str(WINDOW_S)],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "process: the heap is flat but RSS grows" in text


# ---- the daemon and its page ------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def growth_rows(driver) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    return driver.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll('#growth-table tr.growth-row')].map((r) => ({site: r.dataset.site, "
        "verdict: r.dataset.verdict, suspect: r.dataset.suspect, points: "
        "(r.querySelector('svg.spark polyline') || {getAttribute: () => ''}).getAttribute('points')}))")


def test_the_page_shows_what_is_growing_and_opens_the_leaks_stack(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    program = build("growth_service.c")
    host = f"127.0.0.1:{free_port()}"
    url = f"http://{host}"
    # the cache fills for 3 s only: by the time the page is read it has long stopped
    proc = subprocess.Popen(
        [*heapscope_cmd, "run", "--mode=exact", "--http", host, "--output-dir", str(tmp_path), "--store",
         str(tmp_path / "store"), "--store-interval", "0.5", "--", str(program), "3", "120"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.stderr else ""
        wait_for(lambda: answers(f"{url}/healthz"), what="the daemon to answer")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(15)  # 15 s of history: the leak steady all along, the cache stopped after 3 s
        (listed,) = httpx.get(f"{url}/targets", timeout=30).json()
        pid = listed["pid"]
        doc = httpx.get(f"{url}/targets/{pid}/growth", timeout=30).json()
        assert doc["sites"][0]["site"] == LEAK and doc["sites"][0]["suspect"], doc["sites"][:3]
        assert httpx.get(f"{url}/growth", params={"window": 10}, timeout=30).json()["sites"][0]["site"] == LEAK
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric(metrics, "heapscope_leak_suspects", pid=str(pid)) == 1
        rate = metric(metrics, "heapscope_site_growth_bytes_per_second", pid=str(pid), site=LEAK)
        assert rate is not None and rate == pytest.approx(LEAK_B_PER_S, rel=0.10)
        with chromium() as driver:
            requested_urls(driver)
            driver.get(url + "/")
            wait_until(driver, lambda: growth_rows(driver), "the growth panel's rows")
            rows = growth_rows(driver)
            assert rows[0]["site"] == LEAK and rows[0]["suspect"] == "true" and rows[0]["verdict"] == "leak suspect"
            assert len(rows[0]["points"].split()) >= 20  # its line over the window, one point per stored sample
            by_site = {r["site"]: r for r in rows}
            assert by_site[CACHE]["suspect"] == "false" and by_site[SAW]["suspect"] == "false"
            assert "What is growing" in driver.find_element(*by_css("#growth-title")).text
            assert "1 leak suspect among" in driver.find_element(*by_css("#growth-info")).text
            screenshot(driver, "growth-panel")
            retry(lambda: driver.find_element(*by_css("#growth-table tr.growth-row")).click())
            wait_until(driver, lambda: driver.find_elements(*by_css("#growth-table tr.growth-stack li")), "the stack")
            frames = driver.execute_script(
                "return [...document.querySelectorAll('#growth-table tr.growth-stack li')].map((li) => li.textContent)")
            assert frames[0] == LEAK and frames[-1].startswith("main (growth_service.c:"), frames
            assert driver.find_element(*by_css(f'#growth-table tr.growth-row[data-site="{LEAK}"]')).get_attribute(
                "aria-expanded") == "true"
            screenshot(driver, "growth-stack")
            # the keyboard closes it again
            from selenium.webdriver.common.keys import Keys

            retry(lambda: driver.find_element(*by_css("#growth-table tr.growth-row")).send_keys(Keys.ENTER))
            wait_until(driver, lambda: not driver.find_elements(*by_css("#growth-table tr.growth-stack")),
                       "the stack to close")
            urls = requested_urls(driver)
            assert any(f"/targets/{pid}/growth" in u for u in urls), urls
            assert outside(urls, host) == []
            assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        if pid is not None:  # the program ends, and `run` with it (the program holds `run`'s stderr open)
            os.kill(pid, signal.SIGKILL)
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    assert "Traceback" not in proc.stderr.read()
