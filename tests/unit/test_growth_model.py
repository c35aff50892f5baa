"""What is growing: the verdicts of agent.model.growth on series whose truth is known (a leak, a cache that fills
then stops, a sawtooth, a flat site, sampled series with many and with few samples), the process's verdict, and
`heapscope growth` over stores written by the real writer (tests/support/growth_store.py): its ranking and rates,
its JSON and text, its errors, sites matched across segments, and work that does not grow with the window; the
daemon's /growth endpoints and growth metrics over the same stores (the daemon's own reading code)."""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import main
from agent.export.metrics import GrowthCache, HeapscopeCollector
from agent.model import growth as g
from agent.model.growth import GrowthReport
from agent.offline import growth as offline_growth
from agent.store import StoreReader
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget
from tests.support.growth_store import GrowthStore, cache, flat, leak, sawtooth

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "heapscope-alerts.yml"

LEAK_B_PER_S = 200 * 1000  # leak(200): 200 blocks of 1000 B a second


def one(times: np.ndarray, series: np.ndarray, sampling: g.Sampling | None = None) -> tuple[str, g.Trends]:
    tr = g.judge(times, series[None, :], sampling)
    return g.VERDICTS[int(tr.verdict[0])], tr


# ---- the model, on series ------------------------------------------------------------------------------


T = np.arange(0.0, 21.0)  # a 20 s window read at 1 Hz


def test_a_steady_leak_is_a_suspect_with_its_rate_and_age() -> None:
    verdict, tr = one(T, 5e6 + LEAK_B_PER_S * T)  # 5 MB there already, then 200,000 B/s
    assert verdict == g.LEAK and bool(tr.suspect[0])
    assert tr.bytes_per_s[0] == pytest.approx(LEAK_B_PER_S, rel=1e-9)
    assert tr.steadiness[0] == 1.0
    assert tr.added_B[0] == 20 * LEAK_B_PER_S
    # 5 MB as old as the window, 4 MB born evenly over it (each step counted from its middle): 15.56 s
    assert tr.age_s[0] == pytest.approx((5e6 * 20 + 4e6 * 10) / 9e6, rel=1e-9)


def test_a_cache_that_filled_then_stopped_is_not_a_suspect() -> None:
    filling = np.minimum(T, 6.0) * 400_000  # fills for 6 s of the 20, then holds
    verdict, tr = one(T, filling)
    assert verdict == g.STOPPED and not tr.suspect[0]
    assert tr.steadiness[0] == pytest.approx(3 / 8)  # the kept level rose in the sub-windows it filled in
    # one that stopped before the window is flat; one that replaces entries at its full size has stopped too
    assert one(T, np.full_like(T, 2.4e6))[0] == g.FLAT
    replacing = filling + np.where(T > 6, 1000 * (T % 2), 0)
    assert one(T, replacing)[0] == g.STOPPED


def test_a_sawtooth_is_churn_wherever_the_window_catches_it() -> None:
    for phase in np.linspace(0, 3.3, 7):
        saw = 1.5e6 * (((T + phase) % 3.3) / 3.3)
        verdict, tr = one(T, saw)
        assert verdict == g.CHURN and not tr.suspect[0], (phase, tr)
        assert abs(tr.bytes_per_s[0]) * 20 < 0.25 * 1.5e6  # the trend makes little of the movement


def test_flat() -> None:
    verdict, tr = one(T, np.full_like(T, 1e6))
    assert verdict == g.FLAT and tr.bytes_per_s[0] == 0 and tr.age_s[0] == 20.0


def test_growth_that_only_started_is_growing_not_a_suspect() -> None:
    verdict, tr = one(T, np.where(T > 16, (T - 16) * 1e5, 0.0))
    assert verdict == g.GROWING and not tr.suspect[0]
    assert one(T, 1e7 - 2e5 * T)[0] == g.SHRINKING


def test_ranking_suspects_first_then_bytes_added() -> None:
    series = np.stack([
        np.minimum(T, 10) * 1e6,  # a cache that added 10 MB, then stopped
        1000 * T,  # a small leak
        1e5 * T,  # a bigger leak
        1.5e6 * ((T % 3.3) / 3.3),  # a sawtooth
    ])
    tr = g.judge(T, series)
    assert [g.VERDICTS[v] for v in tr.verdict] == [g.STOPPED, g.LEAK, g.LEAK, g.CHURN]
    assert tr.ranked()[:3].tolist() == [2, 1, 0]
    assert tr.counts()[g.LEAK] == 2


def test_stationary_churn_is_rarely_a_suspect() -> None:
    rng = np.random.default_rng(7)
    pools = rng.poisson(50, (1000, len(T))) * 100.0  # pools of ~50 blocks, drawn afresh every second
    tr = g.judge(T, pools)
    assert tr.counts()[g.LEAK] <= 10
    assert tr.counts()[g.FLAT] == 0  # they move: never called flat


def test_theil_sen_is_the_median_of_pairwise_slopes_and_ignores_a_burst() -> None:
    rng = np.random.default_rng(3)
    for m in (2, 3, 8, 21, g.MAX_POINTS):
        t = np.sort(rng.random(m) * 100)
        y = rng.normal(size=(4, m)) * 1000
        brute = [np.median([(row[b] - row[a]) / (t[b] - t[a]) for a in range(m) for b in range(a + 1, m)])
                 for row in y]
        assert np.allclose(g.theil_sen(t, y), brute)
    burst = 1000 * T
    burst[10] += 5e6  # one point far off: least squares would follow it, Theil-Sen does not
    assert g.theil_sen(T, burst[None, :])[0] == pytest.approx(1000)


def test_theil_sen_thins_a_long_series_to_max_points() -> None:
    """However many points a caller hands over, at most MAX_POINTS are paired: the work per site is bounded."""
    assert len(g.thin(100_000)) == g.MAX_POINTS
    assert g.thin(100_000)[[0, -1]].tolist() == [0, 99_999]
    assert len(g.thin(10)) == 10
    t = np.arange(100_000.0)
    assert g.theil_sen(t, (7.5 * t)[None, :])[0] == pytest.approx(7.5)


def _sampled_leak(rng: np.random.Generator, per_s: int, size: int, rate: int) -> tuple[np.ndarray, g.Sampling]:
    """A leak of `per_s` blocks of `size` bytes a second as sampled mode counts it: each block sampled with
    p = 1 - e^(-size/rate), standing for 1/p blocks (rounded at random)."""
    p = -np.expm1(-size / rate)
    sampled = rng.binomial(per_s, p, len(T) - 1)
    weights = np.array([np.floor(1 / p + rng.random(k)).sum() for k in sampled])
    blocks = np.concatenate([[0], np.cumsum(weights)])
    return blocks * size, g.Sampling(rate, np.array([blocks[-1]]), np.array([blocks[-1] * size]))


def test_sampled_mode_judges_a_leak_with_enough_samples() -> None:
    rng = np.random.default_rng(11)
    series, sampling = _sampled_leak(rng, 200, 1000, 2048)  # ~77 samples a second
    verdict, tr = one(T, series, sampling)
    assert verdict == g.LEAK
    assert tr.bytes_per_s[0] == pytest.approx(LEAK_B_PER_S, rel=0.10)
    assert tr.samples is not None and tr.samples[0] > 1000


def test_sampled_mode_says_when_a_site_has_too_few_samples() -> None:
    rng = np.random.default_rng(12)
    series, sampling = _sampled_leak(rng, 200, 1000, 524288)  # ~8 samples over the window
    verdict, tr = one(T, series, sampling)
    assert verdict == g.FEW and not tr.suspect[0]
    assert tr.samples is not None and tr.samples[0] < g.MIN_SAMPLES
    # blocks of the rate or more are always sampled: few of them are exact figures, judged as such
    big = np.minimum(T, 6.0) * (1 << 20)
    verdict, _ = one(T, big, g.Sampling(524288, np.array([6.0]), np.array([6.0 * (1 << 20)])))
    assert verdict == g.STOPPED
    # a site where nothing was sampled and nothing moved is flat
    verdict, _ = one(T, np.full_like(T, 1 << 20), g.Sampling(524288, np.array([0.0]), np.array([0.0])))
    assert verdict == g.FLAT


def test_the_process_verdict_sets_the_heap_against_mapped_memory_and_rss() -> None:
    heap = g.line_trend(T, [50 << 20] * len(T))
    mapped = g.line_trend(T, [int((200 << 20) + 2.5e6 * t) for t in T])
    rss = g.line_trend(T, [int((80 << 20) + 2.5e6 * t) for t in T])
    assert heap is not None and mapped is not None and rss is not None
    assert (heap.trend, mapped.trend, rss.trend) == ("flat", "grows", "grows")
    p = g.judge_process(heap, mapped, rss)
    assert p.verdict == "grows outside the heap"
    assert p.said.startswith("the heap is flat but RSS grows")
    assert "mapped outside malloc" in p.said
    # RSS grows within what is mapped: the allocator keeping freed memory
    flat_map = g.line_trend(T, [200 << 20] * len(T))
    assert flat_map is not None
    p = g.judge_process(heap, flat_map, rss)
    assert p.verdict == "grows outside the heap" and "allocator keeps" in p.said
    growing = g.line_trend(T, [int((50 << 20) + 3e6 * t) for t in T])
    assert growing is not None
    assert g.judge_process(growing, mapped, rss).verdict == "heap grows"
    assert g.judge_process(heap, flat_map, g.line_trend(T, [80 << 20] * len(T))).verdict == "flat"
    assert g.line_trend(T, [1, None, 3]) is None  # not measured throughout


# ---- `heapscope growth` over stores -----------------------------------------------------------------------


def service(rate: int | None = None, **kw: object) -> GrowthStore:
    """45 s of a service: the leak, a cache filling for 28 s, a sawtooth (period 3.3 s), a flat table, and 20
    churning pools."""
    return GrowthStore([leak(200), cache(40, 28), sawtooth(30, 3.3), flat(50)], seconds=45, churn=20, rate=rate,
                       **kw)  # type: ignore[arg-type]


def growth_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["growth", *args])
    return code, out.getvalue(), err.getvalue()


def by_site(doc: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {s["site"].split(" ")[0]: s for s in doc["sites"]}


@pytest.mark.parametrize("rate", [None, 2048])
def test_growth_json_ranks_the_leak_first(tmp_path: Path, rate: int | None) -> None:
    service(rate).write(tmp_path)
    code, out, _ = growth_cli(str(tmp_path), "--window", "20", "--format", "json", "--top", "0")
    assert code == 0
    doc = json.loads(out)
    assert doc["mode"] == ("exact" if rate is None else "sampled") and doc["window_s"] == 20.0
    assert doc["pid"] == 4242 and doc["points"] == 21 and doc["snapshots"] == 21
    first = doc["sites"][0]
    assert first["site"] == "leak_one (service.c:40)" and first["suspect"] is True
    assert first["verdict"] == "leak suspect"
    assert first["bytes_per_s"] == pytest.approx(LEAK_B_PER_S, rel=0.10)
    assert first["stack"] == ["leak_one (service.c:40)", "serve (service.c:150)", "main (service.c:200)"]
    assert len(first["line"]) == 21 and first["line"][-1] == first["live_B"]
    sites = by_site(doc)
    assert sites["cache_fill"]["verdict"] == "grew then stopped" and not sites["cache_fill"]["suspect"]
    assert sites["saw_tooth"]["verdict"] == "churn" and not sites["saw_tooth"]["suspect"]
    assert sites["flat_table"]["verdict"] == "flat"
    # every site that held bytes in the window is judged (in sampled mode a pool may have held no sample)
    assert doc["n_sites"] == sum(doc["counts"].values()) == len(doc["sites"])
    assert doc["n_sites"] == 24 if rate is None else 20 <= doc["n_sites"] <= 24
    if rate is not None:
        assert first["samples"] > 1000  # ~77 samples a second
    assert doc["process"]["verdict"] == "heap grows"


def test_growth_in_sampled_mode_says_too_few_samples(tmp_path: Path) -> None:
    service(524288).write(tmp_path)
    _, out, _ = growth_cli(str(tmp_path), "--window", "20", "--format", "json", "--top", "0")
    sites = by_site(json.loads(out))
    assert sites["leak_one"]["verdict"] == "too few samples" and sites["leak_one"]["samples"] < g.MIN_SAMPLES
    assert not any(s["suspect"] for s in sites.values())


def test_growth_counts_samples_at_the_rate_the_budget_raised(tmp_path: Path) -> None:
    """Sampled at 2,048 bytes, the leak has thousands of samples (test above); with the sampling budget's rate of
    512 KiB stored in force, its samples are counted at that rate: too few to judge, and the notes say why."""
    service(2048, in_force=524288).write(tmp_path)
    _, out, _ = growth_cli(str(tmp_path), "--window", "20", "--format", "json", "--top", "0")
    doc = json.loads(out)
    leak = by_site(doc)["leak_one"]
    assert leak["verdict"] == "too few samples" and leak["samples"] < g.MIN_SAMPLES
    assert any("budget raised the rate to one sample per 524288 bytes" in note for note in doc["notes"]), doc["notes"]
    service(2048).write(tmp_path / "asked")
    _, out, _ = growth_cli(str(tmp_path / "asked"), "--window", "20", "--format", "json", "--top", "0")
    doc = json.loads(out)
    assert by_site(doc)["leak_one"]["verdict"] == "leak suspect" and not any("budget" in n for n in doc["notes"])


def test_growth_text(tmp_path: Path) -> None:
    service().write(tmp_path)
    code, out, _ = growth_cli(str(tmp_path), "--window", "20s", "--top", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "pid 4242: /opt/app/bin/service (exact mode)"
    assert lines[2].startswith("process: the heap grows by 20")
    [row] = [ln for ln in lines if ln.startswith("  1 ")]
    assert "leak suspect" in row and "195.3 KiB/s" in row and row.endswith("leak_one (service.c:40)")
    assert "       <- main (service.c:200)" in lines  # a suspect's stack under it
    assert lines[-1] == "(21 more sites: --top 0 lists them all)"


def test_growth_since_and_whole_run(tmp_path: Path) -> None:
    service().write(tmp_path)
    # the whole run: the cache filled over 28 of the 45 s and stopped
    _, out, _ = growth_cli(str(tmp_path), "--format", "json")
    doc = json.loads(out)
    assert doc["window_s"] == 45.0 and doc["points"] == 46
    assert by_site(doc)["cache_fill"]["verdict"] == "grew then stopped"
    # from a moment on, for a while: 2027-01-15T08:00:05Z + 10 s, the cache still filling
    _, out, _ = growth_cli(str(tmp_path), "--since", "2027-01-15T08:00:05+00:00", "--window", "10",
                           "--format", "json")
    doc = json.loads(out)
    assert doc["window_s"] == 10.0
    assert by_site(doc)["cache_fill"]["verdict"] == "leak suspect"  # 10 s of steady filling looks like a leak


def test_growth_matches_sites_across_segments(tmp_path: Path) -> None:
    """Segments of 10 s each number their sites their own way: the sites are the same, and so are the figures."""
    one_seg, many = tmp_path / "one", tmp_path / "many"
    service().write(one_seg)
    service(segment_seconds=10).write(many)
    with StoreReader(many / "4242") as r:
        assert len(r.segments) >= 4
    docs = []
    for root in (one_seg, many):
        _, out, _ = growth_cli(str(root), "--window", "20", "--format", "json", "--top", "0")
        docs.append(json.loads(out))
    assert docs[0]["sites"] == docs[1]["sites"]


def test_growth_reads_at_most_max_points_however_long_the_window(tmp_path: Path) -> None:
    """The work of a window: at most MAX_POINTS snapshots decoded (checkpoints when the window holds enough of
    them), and rolled-forward deltas bounded by MAX_POINTS checkpoint intervals, not by the window's length."""
    rolled = {}
    for seconds in (600, 6000):
        root = tmp_path / str(seconds)
        GrowthStore([leak(20), flat(5)], seconds=seconds, churn=5, checkpoint_every=100).write(root)
        with StoreReader(root / "4242") as reader:
            count = 0
            for seg in reader.segments:
                roll = seg._roll

                def counting(refs, state, roll=roll):  # type: ignore[no-untyped-def]
                    nonlocal count
                    count += len(refs)
                    return roll(refs, state)

                seg._roll = counting  # type: ignore[method-assign]
            rep = offline_growth.report(reader)
        assert rep.snapshots == seconds + 1 and len(rep.times_s) <= g.MAX_POINTS
        assert rep.sites[0].verdict == g.LEAK
        rolled[seconds] = count
    # 600 snapshots: rolled through once (6 checkpoints: too few to read them alone); 6,000: checkpoints only
    assert rolled[600] <= 601
    assert rolled[6000] <= g.MAX_POINTS * 2 < rolled[600]


@pytest.mark.parametrize("args, code, message", [
    (["--window", "0"], 2, "--window: must be positive"),
    (["--window", "soon"], 2, "cannot read the duration 'soon'"),
    (["--since", "2031-01-01T00:00"], 1, "no snapshot after"),
    (["--since", "tomorrow"], 2, "cannot read the time 'tomorrow'"),
    (["--top", "-1"], 2, "--top"),
])
def test_growth_bad_input_is_one_line(tmp_path: Path, args: list[str], code: int, message: str) -> None:
    service().write(tmp_path)
    got, out, err = growth_cli(str(tmp_path), *args)
    assert got == code and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_growth_of_no_store_is_one_line(tmp_path: Path) -> None:
    got, _, err = growth_cli(str(tmp_path / "none"))
    assert got == 2 and err.strip() == f"heapscope: no store at {tmp_path / 'none'}"


# ---- the daemon: /growth and the metrics, over a real store (the daemon's own reading code) ---------------


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service().write(tmp_path_factory.mktemp("growth"))


@pytest.fixture
def client(stored: Path) -> Iterator[TestClient]:
    manager = FakeManager([FakeTarget(pid=4242, store_dir=stored), FakeTarget(pid=7)])
    with TestClient(create_app(ApiSettings(), manager)) as c:  # type: ignore[arg-type]
        yield c


def test_growth_endpoints(client: TestClient, stored: Path) -> None:
    for url, params in (("/growth", {"pid": 4242, "window": 20}), ("/targets/4242/growth", {"window": 20})):
        r = client.get(url, params=params)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["window_s"] == 20.0 and doc["mode"] == "exact" and doc["suspects"] == 1
        assert doc["sites"][0]["site"] == "leak_one (service.c:40)" and doc["sites"][0]["suspect"]
        assert doc["sites"][0]["bytes_per_s"] == pytest.approx(LEAK_B_PER_S, rel=0.10)
        assert len(doc["sites"]) == 24  # top 50 by default
    # the same document as the command line's
    _, out, _ = growth_cli(str(stored.parent), "--window", "20", "--format", "json")
    assert client.get("/targets/4242/growth", params={"window": 20}).json() == json.loads(out)
    # the default window (600 s) reaches back to the store's start: the 45 s it holds
    doc = client.get("/targets/4242/growth", params={"top": 2}).json()
    assert doc["window_s"] == 45.0 and len(doc["sites"]) == 2 and doc["n_sites"] == 24
    doc = client.get("/targets/4242/growth", params={"since": "2027-01-15T08:00:30+00:00"}).json()
    assert doc["window_s"] == 15.0


@pytest.mark.parametrize("url, params, status, says", [
    ("/targets/7/growth", {}, 409, "no history is kept"),
    ("/targets/99/growth", {}, 404, "no target with PID 99"),
    ("/growth", {}, 400, "several targets"),
    ("/targets/4242/growth", {"window": 0}, 422, "greater than 0"),
    ("/targets/4242/growth", {"since": "yesterday-ish"}, 400, "cannot read the time"),
    ("/targets/4242/growth", {"since": "2031-01-01T00:00:00+00:00"}, 404, "no snapshot after"),
])
def test_growth_endpoint_errors(client: TestClient, url: str, params: dict, status: int, says: str) -> None:  # type: ignore[type-arg]
    r = client.get(url, params=params)
    assert r.status_code == status, r.text
    assert says in r.text


def scrape(manager: FakeManager, cache: GrowthCache | None = None, top: int = 2) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeapscopeCollector(manager, top, cache))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name in ("heapscope_site_growth_bytes_per_second", "heapscope_leak_suspects"):
                out[(s.name, f"{s.labels['pid']} {s.labels.get('site', '')}".strip())] = s.value
    return out


class CountingTarget(FakeTarget):
    """A fake target that counts the growth reports asked of it (the cache's work)."""

    asked: int = 0

    def stored_growth(self, since: str | None, window_s: float | None, top: int) -> GrowthReport:
        self.asked += 1
        return super().stored_growth(since, window_s, top)


def test_growth_metrics_are_cached_per_target(stored: Path) -> None:
    target = CountingTarget(pid=4242, store_dir=stored)
    manager = FakeManager([target, FakeTarget(pid=7)])  # pid 7 keeps no history: no growth series
    cache = GrowthCache()
    got = scrape(manager, cache)
    assert got[("heapscope_leak_suspects", "4242")] == 1
    assert got[("heapscope_site_growth_bytes_per_second", "4242 leak_one (service.c:40)")] == pytest.approx(
        LEAK_B_PER_S, rel=0.10)
    sites = [k for k in got if k[0] == "heapscope_site_growth_bytes_per_second"]
    assert len(sites) == 3 and ("heapscope_site_growth_bytes_per_second", "4242 (other sites)") in sites
    assert not [k for k in got if k[1].startswith("7")]
    scrape(manager, cache)
    assert target.asked == 1  # the second scrape, within GROWTH_REFRESH_S, used the first one's report
    stale = GrowthCache(refresh_s=0.0)
    scrape(manager, stale)
    scrape(manager, stale)
    assert target.asked == 3


def test_growth_metrics_spend_at_most_their_budget(stored: Path) -> None:
    """With no time to spend, one target is recomputed per scrape (the oldest first): a scrape never waits on all."""
    targets = [CountingTarget(pid=p, store_dir=stored) for p in (4242, 4243, 4244)]
    cache = GrowthCache(budget_s=0.0)
    scrape(FakeManager(targets), cache)
    assert sorted(t.asked for t in targets) == [0, 0, 1]
    scrape(FakeManager(targets), cache)
    assert sorted(t.asked for t in targets) == [0, 1, 1]


def test_the_alerts_use_the_metrics_the_daemon_exports(stored: Path) -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = " ".join(r["expr"] for group in rules["groups"] for r in group["rules"])
    names = set(re.findall(r"heapscope_[a-z_]+", exprs))
    assert names == {"heapscope_leak_suspects", "heapscope_site_growth_bytes_per_second"}
    exported = {name for name, _ in scrape(FakeManager([FakeTarget(pid=4242, store_dir=stored)]))}
    assert names <= exported


def test_the_readers_stack_hashes_are_its_stacks_hashes(tmp_path: Path) -> None:
    """Sites are matched across segments by SegmentReader.stack_hashes, computed from the tables without making
    frames: they must be exactly the hashes of the stacks load() makes."""
    service(segment_seconds=10).write(tmp_path)
    with StoreReader(tmp_path / "4242") as reader:
        for seg in reader.segments:
            for ref in (seg.snapshots()[0], seg.snapshots()[-1]):  # as of the first tables, then all of them
                hashes = seg.stack_hashes(ref.seq)
                stacks = seg.load(ref).site_stacks
                assert hashes is not None and len(hashes) >= 24
                assert hashes[: len(stacks)].tolist() == [hash(tuple(s)) for s in stacks]
