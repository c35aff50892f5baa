"""deploy/'s scrape configurations for heapscope's pprof profiles: Grafana Alloy's pyroscope.scrape and Parca.

Neither tool's validator installs from PyPI or Debian, so the checks are these: Parca's YAML is parsed and
held to the fields Parca's configuration accepts (Parca decodes with unknown fields refused, so a misspelt key
would stop it), and to its rules on timeouts; Alloy's file is checked for balanced blocks and the blocks and
attributes pyroscope.scrape documents. Above all, every URL either scraper would build from these files is
asked of the real API (over the fake daemon), and must answer a pprof heap profile.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from fastapi.testclient import TestClient

from agent.export.pprof import parse_pprof
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALLOY = DEPLOY / "pyroscope" / "heapscope.alloy"
PARCA = DEPLOY / "parca" / "parca.yaml"
PROFILE_KINDS = {"memory", "block", "goroutine", "mutex", "process_cpu"}

# The fields of Parca's configuration (pkg/config: Config, ScrapeConfig with Prometheus' HTTP client settings
# inline, ProfilingConfig, PprofProfilingConfig).
PARCA_TOP = {"object_storage", "scrape_configs"}
PARCA_JOB = {
    "job_name",
    "params",
    "scrape_interval",
    "scrape_timeout",
    "scheme",
    "normalized_addresses",
    "profiling_config",
    "relabel_configs",
    "static_configs",
    "dns_sd_configs",
    "file_sd_configs",
    "kubernetes_sd_configs",
    "authorization",
    "basic_auth",
    "oauth2",
    "tls_config",
    "proxy_url",
    "follow_redirects",
    "enable_http2",
}
PARCA_PROFILING = {"pprof_config", "path_prefix"}
PARCA_PPROF = {"enabled", "path", "delta", "keep_sample_type"}


def served(client: TestClient, path: str) -> Any:
    r = client.get(path)
    assert r.status_code == 200, (path, r.text)
    assert r.headers["content-type"] == "application/octet-stream"
    prof = parse_pprof(r.content)
    strings = list(prof.string_table)
    assert [strings[t.type] for t in prof.sample_type] == [
        "alloc_objects",
        "alloc_space",
        "inuse_objects",
        "inuse_space",
    ]
    return prof


def client_for(pids: list[int]) -> TestClient:
    return TestClient(create_app(ApiSettings(), FakeManager([FakeTarget(pid=p) for p in pids])))  # type: ignore[arg-type]


def seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert m, text
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


# ---- Parca -------------------------------------------------------------------------------------------------


def parca() -> dict[str, Any]:
    doc = yaml.safe_load(PARCA.read_text())
    assert isinstance(doc, dict)
    return doc


def test_parca_uses_only_fields_parca_knows() -> None:
    doc = parca()
    assert set(doc) <= PARCA_TOP and "object_storage" in doc  # Parca requires object storage
    for job in doc["scrape_configs"]:
        assert set(job) <= PARCA_JOB, set(job) - PARCA_JOB
        assert job["job_name"]
        assert set(job["profiling_config"]) <= PARCA_PROFILING
        for kind, cfg in job["profiling_config"]["pprof_config"].items():
            assert kind in PROFILE_KINDS, kind
            assert set(cfg) <= PARCA_PPROF, set(cfg) - PARCA_PPROF
        # Parca refuses a timeout not above the interval (left out, it is the interval + 3 s)
        if "scrape_timeout" in job:
            assert seconds(job["scrape_timeout"]) > seconds(job["scrape_interval"])
        for group in job["static_configs"]:
            assert all("/" not in t for t in group["targets"])  # host:port, as Parca checks


def test_parca_scrapes_what_the_daemon_serves() -> None:
    urls = []
    for job in parca()["scrape_configs"]:
        prefix = job["profiling_config"].get("path_prefix", "")
        enabled = [c["path"] for c in job["profiling_config"]["pprof_config"].values() if c.get("enabled", True)]
        assert enabled == ["/debug/pprof/allocs"], "only the heap exists: the other Go profiles are turned off"
        urls += [prefix + p for p in enabled]
    pids = [int(m.group(1)) for u in urls if (m := re.match(r"/targets/(\d+)/", u))]
    with client_for(pids or [1]) as client:
        for url in urls:
            served(client, url)


# ---- Grafana Alloy -------------------------------------------------------------------------------------------

# pyroscope.scrape's documented blocks, and the attributes used inside them.
ALLOY_BLOCKS = {"pyroscope.scrape", "pyroscope.write", "profiling_config", "endpoint"} | {
    f"profile.{k}" for k in PROFILE_KINDS
}


def alloy_text() -> str:
    return "\n".join(
        line.split("//", 1)[0] if not line.lstrip().startswith("//") else "" for line in ALLOY.read_text().splitlines()
    )


def test_alloy_blocks_balance_and_are_documented() -> None:
    text = alloy_text()
    depth = 0
    for ch in text:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    opened = re.findall(r'^\s*([a-z_.]+)(?:\s+"[^"]+")?\s*\{\s*$', text, re.M)
    assert set(opened) <= ALLOY_BLOCKS, set(opened) - ALLOY_BLOCKS
    assert "pyroscope.scrape" in opened and "forward_to" in text


def test_alloy_scrapes_what_the_daemon_serves() -> None:
    text = alloy_text()
    targets = re.findall(
        r'\{"__address__" = "([^"]+)", "__profile_path_prefix__" = "([^"]+)", "service_name" = "[^"]+"\}', text
    )
    assert targets, "no targets found"
    memory = re.search(r"profile\.memory \{([^}]*)\}", text)
    assert memory and "enabled = true" in memory.group(1)
    path = re.search(r'path\s*=\s*"([^"]+)"', memory.group(1))
    assert path
    for kind in PROFILE_KINDS - {"memory"}:
        block = re.search(rf"profile\.{kind} \{{([^}}]*)\}}", text)
        assert block and "enabled = false" in block.group(1), f"{kind} must be off: heapscope serves only the heap"
    pids = [int(re.fullmatch(r"/targets/(\d+)", prefix).group(1)) for _, prefix in targets]  # type: ignore[union-attr]
    with client_for(pids) as client:
        for _, prefix in targets:
            served(client, prefix + path.group(1))
