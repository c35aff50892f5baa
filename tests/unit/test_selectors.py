"""agent.model.selector and agent.model.fleet.Limits: which processes a selector chooses, what a bad selector says,
and when a new target is refused. Plus the fleet's options on the command line (agent.daemon.fleetopts) and the
selectors and refusals through the API, over the fake daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import build_parser
from agent.daemon.fleetopts import byte_size, fleet_config_from
from agent.errors import TargetRefused, UsageError
from agent.model.cgroup import CgroupPlacement
from agent.model.fleet import Limits, TargetOrigin
from agent.model.sampling import ProfileMode
from agent.model.selector import ProcessFacts, Selector, cgroup_matches, check_cgroup_pattern, first_match
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget

CID = "4f1d0c8a9b7e6d5c4b3a29180716f5e4d3c2b1a09f8e7d6c5b4a3928171605f4"
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
POD_CGROUP = (
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
    f"cri-containerd-{CID}.scope"
)


def facts(comm: str = "nginx", cmdline: str = "nginx: master process", cgroup: str = "/system.slice/nginx.service"):
    return ProcessFacts(pid=100, ppid=1, start_time=5, comm=comm, cmdline=cmdline, cgroup=cgroup)


def test_comm_and_cmdline_are_searched_as_pgrep_does() -> None:
    assert Selector.make(comm="ngin").matches(facts())
    assert Selector.make(comm="^nginx$").matches(facts())
    assert not Selector.make(comm="^ngin$").matches(facts())
    assert Selector.make(cmdline="master process").matches(facts())
    assert not Selector.make(cmdline="worker").matches(facts())


def test_every_condition_of_one_selector_must_hold() -> None:
    s = Selector.make(comm="nginx", cgroup="/system.slice/nginx.service")
    assert s.matches(facts())
    assert not s.matches(facts(cgroup="/system.slice/other.service"))
    assert not s.matches(facts(comm="redis"))


def test_kernel_threads_are_never_chosen() -> None:
    assert not Selector.make(comm=".").matches(facts(comm="kworker/0:1", cmdline=""))


def test_cgroup_paths_select_a_subtree() -> None:
    assert cgroup_matches("/system.slice", "/system.slice/nginx.service")
    assert cgroup_matches("/system.slice/nginx.service", "/system.slice/nginx.service")
    assert not cgroup_matches("/system.slice/nginx", "/system.slice/nginx.service")  # a component, not a prefix
    assert cgroup_matches("/", "/anything/at/all")
    assert cgroup_matches("/kubepods.slice", POD_CGROUP)


def test_cgroup_patterns_match_the_cgroup_or_an_ancestor() -> None:
    assert cgroup_matches("*/nginx.service", "/system.slice/nginx.service")
    assert cgroup_matches(f"*pod{UID.replace('-', '_')}*", POD_CGROUP)
    assert cgroup_matches("/kubepods.slice/kubepods-burstable.slice", POD_CGROUP)
    assert cgroup_matches("/kubepods.slice/*-burstable.slice", POD_CGROUP)  # an ancestor matches
    assert not cgroup_matches("/kubepods.slice/*-besteffort.slice", POD_CGROUP)


def test_pod_and_container_selectors_read_the_path() -> None:
    assert cgroup_matches(check_cgroup_pattern(f"pod:{UID}"), POD_CGROUP)
    assert cgroup_matches(check_cgroup_pattern(f"pod:{UID.replace('-', '_').upper()}"), POD_CGROUP)
    assert cgroup_matches(check_cgroup_pattern(f"container:{CID[:12]}"), POD_CGROUP)
    assert cgroup_matches(check_cgroup_pattern(f"container:containerd://{CID}"), POD_CGROUP)
    assert not cgroup_matches(check_cgroup_pattern(f"container:{'0' * 12}"), POD_CGROUP)
    assert not cgroup_matches(check_cgroup_pattern(f"pod:{UID}"), "/system.slice/nginx.service")


def test_cgroup_paths_under_the_mount_point_are_taken_from_the_root() -> None:
    assert check_cgroup_pattern("/sys/fs/cgroup/system.slice/a.service/") == "/system.slice/a.service"
    assert check_cgroup_pattern("/sys/fs/cgroup") == "/"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({}, "at least one of comm, cmdline, cgroup"),
        ({"comm": "("}, "bad comm regular expression"),
        ({"cmdline": ""}, "would select every process"),
        ({"comm": "x" * 2000}, "longer than 1024"),
        ({"cgroup": "system.slice"}, "give a path from the cgroup root"),
        ({"cgroup": "pod:1234"}, "a pod UID looks like"),
        ({"cgroup": "container:abc"}, "at least the first 12 hex digits"),
    ],
)
def test_bad_selectors_are_one_clear_error(kwargs: dict[str, str], says: str) -> None:
    with pytest.raises(UsageError, match=says):
        Selector.make(**kwargs)  # type: ignore[arg-type]


def test_the_first_matching_selector_is_the_one_recorded() -> None:
    a, b = Selector.make(comm="redis", id=1), Selector.make(cgroup="/system.slice", id=2)
    found = first_match([a, b], facts())
    assert found is not None and found.id == 2
    assert first_match([a], facts()) is None


def test_limits_refuse_with_the_reason_and_the_figures() -> None:
    limits = Limits(max_targets=2, max_sites=1000, max_memory=512 << 20)
    assert limits.refusal(1, 999, 100 << 20) is None
    r = limits.refusal(2, 0, 0)
    assert r is not None and r.reason == "targets" and "2 processes" in r.message
    r = limits.refusal(0, 1000, 0)
    assert r is not None and r.reason == "sites" and "1000" in r.message
    r = limits.refusal(0, 0, 600 << 20)
    assert r is not None and r.reason == "memory" and "600 MiB" in r.message and "512 MiB" in r.message
    assert Limits().refusal(10**6, 10**9, 10**12) is None


def test_fleet_options_parse_into_selectors_and_limits(tmp_path: Path) -> None:
    args = tmp_path / "serve.args"  # the ConfigMap's form: one argument a line, read with @FILE
    args.write_text("--attach-comm=^nginx$\n--attach-cgroup=pod:" + UID + "\n--max-targets=5\n--max-memory=900M\n")
    ns = build_parser().parse_args(["serve", "--attach-cmdline", "gunicorn", f"@{args}", "--keep-exited", "30",
                                      "--max-exited", "40", "--output-max-age", "12h"])
    config = fleet_config_from(ns)
    assert [(s.comm, s.cmdline, s.cgroup) for s in config.selectors] == [
        ("^nginx$", None, None), (None, "gunicorn", None), (None, None, f"pod:{UID}")
    ]
    assert config.limits == Limits(max_targets=5, max_sites=None, max_memory=900 << 20)
    assert (config.keep_exited, config.max_exited, config.output_max_age) == (30.0, 40, 12 * 3600.0)
    none = fleet_config_from(build_parser().parse_args(["serve", "--max-targets", "0", "--max-exited", "0"]))
    assert none.limits == Limits() and none.selectors == () and none.output_max_age == 7 * 86400.0
    assert none.max_exited is None
    assert fleet_config_from(build_parser().parse_args(["serve"])).max_exited == 256  # the default users get


def test_a_bad_selector_option_names_the_option() -> None:
    ns = build_parser().parse_args(["serve", "--attach-comm", "(("])
    with pytest.raises(UsageError, match="--attach-comm: bad comm regular expression"):
        fleet_config_from(ns)


def test_byte_sizes() -> None:
    assert byte_size("900M") == 900 << 20
    assert byte_size("2GiB") == 2 << 30
    assert byte_size("1.5g") == 3 << 29
    assert byte_size("4096") == 4096


# ---- through the API, over the fake daemon --------------------------------------------------------------


class RefusingManager(FakeManager):
    def attach(self, pid: int, mode: ProfileMode | None = None) -> FakeTarget:
        raise TargetRefused(f"not profiling process {pid}: the daemon profiles 1 processes, its limit (--max-targets)")


def test_post_targets_takes_a_selector_and_lists_it() -> None:
    manager = FakeManager([FakeTarget(pid=9, origin=TargetOrigin(start_time=77, selector=1))])
    with TestClient(create_app(ApiSettings(), manager)) as client:  # type: ignore[arg-type]
        r = client.post("/targets", json={"comm": "^svc$", "cgroup": "/system.slice"})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["id"] == 1 and body["comm"] == "^svc$" and body["cgroup"] == "/system.slice"
        assert body["origin"] == "api" and body["follow_children"] is True and body["targets"] == [9]
        assert [s["id"] for s in client.get("/selectors").json()] == [1]
        t = client.get("/targets").json()[0]
        assert t["origin"]["start_time"] == 77 and t["origin"]["selector"] == 1
        assert client.delete("/selectors/1").status_code == 200
        assert client.get("/selectors").json() == []
        assert client.delete("/selectors/1").status_code == 404


@pytest.mark.parametrize(
    "body",
    [{}, {"pid": 5, "comm": "x"}, {"comm": ""}, {"comm": "x", "color": "red"}, {"follow_children": False}],
)
def test_post_targets_wants_a_pid_or_a_selector(body: dict[str, object]) -> None:
    with TestClient(create_app(ApiSettings(), FakeManager())) as client:  # type: ignore[arg-type]
        assert client.post("/targets", json=body).status_code == 422


def test_a_bad_selector_through_the_api_is_a_400_with_the_reason() -> None:
    with TestClient(create_app(ApiSettings(), FakeManager())) as client:  # type: ignore[arg-type]
        r = client.post("/targets", json={"comm": "(("})
        assert r.status_code == 400 and "bad comm regular expression" in r.json()["detail"]


def test_a_refused_target_is_a_429_with_the_reason() -> None:
    manager = RefusingManager()
    manager.refused = {"targets": 1}
    with TestClient(create_app(ApiSettings(), manager)) as client:  # type: ignore[arg-type]
        r = client.post("/targets", json={"pid": 1234})
        assert r.status_code == 429
        assert r.json() == {
            "detail": "not profiling process 1234: the daemon profiles 1 processes, its limit (--max-targets)",
            "error": "TargetRefused",
        }
        metrics = client.get("/metrics").text
        assert 'heapscope_targets_refused_total{reason="targets"} 1.0' in metrics
        assert 'heapscope_targets_refused_total{reason="memory"} 0.0' in metrics


def test_metrics_carry_the_placement_labels() -> None:
    placement = CgroupPlacement(path=POD_CGROUP, unit=f"cri-containerd-{CID}.scope", pod=UID, container=CID)
    target = FakeTarget(pid=9, command="svc", origin=TargetOrigin(start_time=1, placement=placement))
    with TestClient(create_app(ApiSettings(), FakeManager([target]))) as client:  # type: ignore[arg-type]
        text = client.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("heapscope_heap_useful_bytes{"))
    assert f'pod="{UID}"' in line and f'container="{CID}"' in line and f'cgroup="{POD_CGROUP}"' in line
    assert 'pid="9"' in line and 'command="svc"' in line
