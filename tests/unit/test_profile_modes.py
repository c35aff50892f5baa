"""The modes' pure side: the mode value and what each output says of it (massif.out's desc:, MALT's config,
the xtree's desc:, the summary, the metrics info series, the API's /targets and mode switch, `view` of a sampled
massif.out), and the CLI's refusals of mode options. The modes end to end: tests/integration/test_modes.py."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import build_parser, main, settings_from
from agent.errors import UsageError
from agent.export.malt import write_malt
from agent.export.massif import write_massif
from agent.export.metrics import HeapscopeCollector
from agent.export.xtree import write_xtree
from agent.model.counters import Counters
from agent.model.malt import MaltConfig, MaltGlobals, MaltProfile, MaltRun
from agent.model.sampling import DEFAULT_SAMPLE_RATE, ProfileMode
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import SiteCounts
from agent.model.summary import ProfileSummary, SamplingSummary
from api.app import create_app
from api.models import profile_mode
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget, frame
from tests.support.page_reader import embedded


def test_the_mode_value() -> None:
    exact = ProfileMode()
    assert (exact.mode, exact.period, exact.sampled) == ("exact", 1, False)
    assert exact.desc() == ("--mode=exact",)
    sampled = ProfileMode("sampled", 65536)
    assert sampled.period == 65536 and sampled.sampled
    assert sampled.desc()[:3] == ("--mode=sampled", "--sample-rate=65536", "--max-samples=500")
    assert "estimates" in sampled.desc()[3]
    assert ProfileMode("sampled").rate == DEFAULT_SAMPLE_RATE == 524288
    assert "at most 500 a second" in sampled.label() and "a second" not in ProfileMode("sampled", 4096, 0).label()
    for bad in (("fast", 4096), ("sampled", 0), ("sampled", (1 << 40) + 1), ("sampled", 4096, -1)):
        with pytest.raises(ValueError):
            ProfileMode(*bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "mode", "rate"),
    [
        (["run", "--", "true"], "exact", 1),
        (["run", "--mode=sampled", "--", "true"], "sampled", DEFAULT_SAMPLE_RATE),
        (["attach", "42"], "sampled", DEFAULT_SAMPLE_RATE),
        (["attach", "--sample-rate=65536", "42"], "sampled", 65536),
        (["attach", "--mode=exact", "42"], "exact", 1),
        (["serve"], "sampled", DEFAULT_SAMPLE_RATE),
        (["serve", "--mode=exact"], "exact", 1),
    ],
)
def test_defaults_run_exact_attach_and_serve_sampled(argv: list[str], mode: str, rate: int) -> None:
    args = argv[: argv.index("--")] if "--" in argv else argv
    ns = build_parser().parse_args(args)
    s = settings_from(ns, [], daemon=ns.command == "serve")
    assert (s.mode.mode, s.mode.period) == (mode, rate)
    assert s.probe_settings(1, launched=False).sampled == (mode == "sampled")


@pytest.mark.parametrize(
    "options",
    [["--mode=exact", "--sample-rate=4096"], ["--pages-as-heap=yes"], ["--sample-rate=0"], ["--mode=both"]],
)
def test_mode_options_refused_in_one_line(options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attach", *options, "42"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("heapscope: "), err


def test_massif_desc_and_xtree_desc_say_the_mode() -> None:
    out = io.StringIO()
    snaps = [Snapshot(0, 10, 8, 0, None, SnapshotKind.NORMAL)]
    write_massif(out, snaps, desc=["--time-unit=B", *ProfileMode("sampled", 4096).desc()], cmd="./p", time_unit="B",
                 threshold=1.0)
    first = out.getvalue().splitlines()[0]
    assert first.startswith("desc: --time-unit=B --mode=sampled --sample-rate=4096") and "estimates" in first
    xt = io.StringIO()
    sites = {(frame(0x1000, "f", 3, "a.c"),): SiteCounts(cur_bytes=10, cur_blocks=1)}
    write_xtree(xt, sites, cmd="./p", pid=1, kind="allocs", desc=("Mode: sampled, estimates",))
    assert "\ndesc: Mode: sampled, estimates\n" in xt.getvalue()


@pytest.mark.parametrize("version", ["1.1", "1.6"])
def test_malt_config_says_the_mode(version: str) -> None:
    def config(cfg: MaltConfig) -> dict:  # type: ignore[type-arg]
        p = MaltProfile(run=MaltRun("x", "x", "h", "", "2024-01-01 00:00", 0), globals=MaltGlobals(1), config=cfg)
        out = io.StringIO()
        write_malt(out, p, format_version=version)  # type: ignore[arg-type]
        return json.loads(out.getvalue())["config"]  # type: ignore[no-any-return]

    sampled = config(MaltConfig(mode="sampled", sample_rate=65536))
    assert sampled["heapscope"] == {"mode": "sampled", "sample-rate": 65536, "estimates": True}
    assert sampled["sampling"]["enabled"] is True and sampled["sampling"]["volume"] == 65536
    exact = config(MaltConfig())
    assert exact["heapscope"] == {"mode": "exact", "sample-rate": 0, "estimates": False}
    assert exact["sampling"]["enabled"] is False


def test_summary_labels_estimates_only_in_sampled_mode() -> None:
    c = Counters(n_allocs=10, n_frees=4, heap=1000, blocks=6, peak_heap=1200)
    exact = "\n".join(ProfileSummary(c).lines())
    assert "ESTIMATES" not in exact and "~" not in exact
    lines = ProfileSummary(c, sampling=SamplingSummary(4096, samples=3, sampled_frees=1, unseen_frees=2)).lines()
    assert "one sample per 4096 bytes" in lines[0] and "ESTIMATES" in lines[0]
    assert any("did not fit" in line for line in lines)
    assert "10 allocations, 4 frees" in lines[-1] and "peak ~1200 B" in lines[-1]


def test_summary_reports_malt_tables_full() -> None:
    assert not any("MALT" in line for line in ProfileSummary(Counters(n_allocs=1)).lines())
    lines = ProfileSummary(Counters(n_allocs=1, dropped_sizes=5, dropped_threads=2)).lines()
    assert any("NOT COUNTED in MALT" in line and "5 request sizes" in line and "2 calls" in line for line in lines)


def test_metrics_info_series_per_target() -> None:
    a = FakeTarget(pid=10, command="api", mode="sampled", sample_rate=524288)
    b = FakeTarget(pid=20, command="worker")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeapscopeCollector(FakeManager([a, b])))
    text = generate_latest(registry).decode()
    info = sorted(line for line in text.splitlines() if line.startswith("heapscope_profile_info{"))
    assert info == [
        'heapscope_profile_info{cgroup="",command="api",container="",mode="sampled",pid="10",pod="",'
        'sample_rate="524288",unit=""} 1.0',
        'heapscope_profile_info{cgroup="",command="worker",container="",mode="exact",pid="20",pod="",'
        'sample_rate="1",unit=""} 1.0',
    ]


def test_metrics_give_a_sampled_targets_rate_in_force() -> None:
    raised = FakeTarget(pid=10, command="api", mode="sampled", sample_rate=524288, in_force=(2097152, 3), budget=40)
    asked = FakeTarget(pid=11, command="db", mode="sampled", sample_rate=524288)
    exact = FakeTarget(pid=20, command="worker")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HeapscopeCollector(FakeManager([raised, asked, exact])))
    text = generate_latest(registry).decode()

    def values(name: str) -> dict[str, float]:
        found = re.findall(rf'^{name}{{[^}}]*command="(\w+)"[^}}]*}} (\S+)$', text, re.M)
        return {command: float(v) for command, v in found}

    assert values("heapscope_sample_rate_in_force_bytes") == {"api": 2097152.0, "db": 524288.0}
    assert values("heapscope_sample_rate_changes_total") == {"api": 3.0, "db": 0.0}
    assert values("heapscope_sample_budget") == {"api": 40.0, "db": 500.0}


def test_api_attach_with_a_mode_and_switch() -> None:
    manager = FakeManager([FakeTarget(pid=1)])
    manager.attachable[7] = FakeTarget(pid=7)
    manager.attachable[8] = FakeTarget(pid=8)
    with TestClient(create_app(ApiSettings(), manager)) as client:  # type: ignore[arg-type]
        r = client.post("/targets", json={"pid": 7, "sample_rate": 65536})
        assert r.status_code == 201, r.text
        assert (r.json()["mode"], r.json()["sample_rate"], r.json()["estimate"]) == ("sampled", 65536, True)
        r = client.post("/targets", json={"pid": 8, "mode": "exact", "sample_rate": 4096})
        assert r.status_code == 400 and "sample_rate" in r.json()["detail"]
        r = client.post("/targets/7/mode", json={"mode": "exact"})
        assert r.status_code == 200 and (r.json()["mode"], r.json()["estimate"]) == ("exact", False)
        assert manager.calls[-1] == "switch 7 exact 1"
        assert client.post("/targets/9/mode", json={"mode": "exact"}).status_code == 404
        assert client.post("/targets/7/mode", json={"mode": "fast"}).status_code == 422
        listed = {t["pid"]: t for t in client.get("/targets").json()}
        assert listed[1]["mode"] == "exact" and listed[1]["sample_rate"] == 1
        assert client.get("/targets/7/timeline").json()["estimate"] is False


def test_profile_mode_of_a_request() -> None:
    assert profile_mode(None, None) is None
    assert profile_mode(None, 4096) == ProfileMode("sampled", 4096)
    assert profile_mode("sampled", None) == ProfileMode("sampled")
    with pytest.raises(UsageError):
        profile_mode("exact", 4096)


def test_view_of_a_sampled_massif_out_labels_estimates(tmp_path: Path) -> None:
    out = io.StringIO()
    tree_snap = Snapshot(5, 100, 8, 0, None, SnapshotKind.NORMAL)
    write_massif(out, [tree_snap], desc=list(ProfileMode("sampled", 4096).desc()), cmd="./p", time_unit="B",
                 threshold=1.0)
    src = tmp_path / "massif.out.1"
    src.write_text(out.getvalue())
    assert main(["view", str(src), "-o", str(tmp_path / "p.html")]) == 0
    data = embedded((tmp_path / "p.html").read_text())
    assert data["targets"][0]["mode"] == "sampled"
    assert data["timelines"]["0"]["estimate"] is True
    assert re.search(r"estimate", (tmp_path / "p.html").read_text())
