"""The HTTP API's own logic, over a fake daemon (tests.support.fake_daemon): routing, ?pid= and ?format=,
bodies identical to the writers' output, JSON with the same data, errors as 4xx JSON, the token rule, the
lifespan. The real daemon against real programs is tests/integration/test_daemon.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.errors import UsageError
from agent.model.massif_tree import massif_tree
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import FakeManager, FakeTarget
from tests.support.massif_reader import parse_massif, paths, strip_address

TOKEN = "s3cret-token"


def client_for(manager: FakeManager, **settings: object) -> TestClient:
    return TestClient(create_app(ApiSettings(**settings), manager))  # type: ignore[arg-type]


@pytest.fixture
def one() -> Iterator[tuple[TestClient, FakeTarget, FakeManager]]:
    target = FakeTarget(pid=4242)
    manager = FakeManager([target])
    with client_for(manager) as client:
        yield client, target, manager


# ---- bodies: exactly the writers' output, and the same data as JSON -------------------------------------


def test_text_bodies_are_what_the_monitor_commands_write(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, target, _ = one
    for path, expected in (
        ("/snapshot", target.snapshot_text(False)),
        ("/detailed_snapshot", target.snapshot_text(True)),
        ("/all_snapshots", target.render("massif")),
        ("/xtmemory", target.render("xtree")),
    ):
        r = client.get(path)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert r.text == expected, path


def test_detailed_snapshot_json_has_the_same_tree_as_the_text(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, target, _ = one
    text = parse_massif(client.get("/detailed_snapshot").text)
    data = client.get("/detailed_snapshot", params={"format": "json"}).json()
    assert data["cmd"] == text.cmd and data["time_unit"] == "ms"
    [snap] = data["snapshots"]
    [tsnap] = text.snapshots
    assert snap["heap_tree"] == "detailed"
    assert (snap["time"], snap["mem_heap_B"], snap["mem_heap_extra_B"]) == (
        tsnap.time,
        tsnap.heap_B,
        tsnap.heap_extra_B,
    )

    def json_paths(node: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:  # type: ignore[type-arg]
        out = {}
        for child in node["children"]:
            p = (*prefix, child["label"])
            out[p] = child["bytes"]
            out.update(json_paths(child, p))
        return out

    from_json = {tuple(strip_address(lbl) for lbl in p): b for p, b in json_paths(snap["tree"]).items()}
    assert from_json == paths(tsnap.tree)
    # The tiny sites are merged below the threshold, in the JSON too.
    assert any("below massif's threshold" in p[0] for p in from_json)
    assert snap["tree"]["bytes"] == massif_tree(target._tree(), threshold=1.0, extra_B=tsnap.heap_extra_B).bytes


def test_normal_snapshot_json_has_no_tree(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, target, _ = one
    [snap] = client.get("/snapshot?format=json").json()["snapshots"]
    assert snap["heap_tree"] == "empty" and snap["tree"] is None
    assert snap["mem_heap_B"] == target.counters().heap


def test_all_snapshots_json_numbers_and_kinds(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, _, _ = one
    text = parse_massif(client.get("/all_snapshots").text)
    data = client.get("/all_snapshots?format=json").json()
    assert [s["snapshot"] for s in data["snapshots"]] == [0, 1, 2]
    assert [s["heap_tree"] for s in data["snapshots"]] == [s.heap_tree for s in text.snapshots]
    assert [s["mem_heap_B"] for s in data["snapshots"]] == [s.heap_B for s in text.snapshots]


def test_xtmemory_json_matches_the_callgrind_totals(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, target, _ = one
    text = client.get("/xtmemory").text
    data = client.get("/xtmemory?format=json").json()
    assert data["events"] == ["curB", "curBk", "totB", "totBk", "totFdB", "totFdBk"]
    totals_line = next(ln for ln in text.splitlines() if ln.startswith("totals:"))
    assert [int(x) for x in totals_line.split()[1:]] == [data["totals"][e] for e in data["events"]]
    assert len(data["stacks"]) == len(target.sites)
    big = max(data["stacks"], key=lambda s: s["values"]["curB"])
    assert big["frames"][0]["function"] == "make_big" and big["values"]["totFdB"] == 20_000


# ---- picking a target ------------------------------------------------------------------------------------


def test_pid_picks_among_several_targets() -> None:
    a, b = FakeTarget(pid=10, command="a"), FakeTarget(pid=20, command="b", time=999)
    with client_for(FakeManager([a, b])) as client:
        r = client.get("/snapshot")
        assert r.status_code == 400 and "pid" in r.json()["detail"]
        assert client.get("/snapshot?pid=20").text == b.snapshot_text(False)
        r = client.get("/detailed_snapshot?pid=30")
        assert r.status_code == 404 and r.json()["error"] == "NoSuchTarget"


def test_no_target_is_404() -> None:
    with client_for(FakeManager()) as client:
        r = client.get("/all_snapshots")
        assert r.status_code == 404 and r.json()["detail"]


# ---- targets ---------------------------------------------------------------------------------------------


def test_targets_list_attach_detach() -> None:
    manager = FakeManager([FakeTarget(pid=10)])
    manager.attachable[77] = FakeTarget(pid=77, command="svc")
    with client_for(manager) as client:
        assert [t["pid"] for t in client.get("/targets").json()] == [10]
        r = client.post("/targets", json={"pid": 77})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["pid"] == 77 and body["state"] == "profiling" and body["exited"] is False
        assert body["heap"]["useful_bytes"] == manager.by_pid[77].counters().heap
        assert client.post("/targets", json={"pid": 77}).status_code == 409
        assert client.post("/targets", json={"pid": 78}).status_code == 404
        r = client.delete("/targets/77")
        assert r.status_code == 200 and r.json()["state"] == "detached"
        assert [t["pid"] for t in client.get("/targets").json()] == [10]
        assert client.delete("/targets/77").status_code == 404


def test_exited_target_is_marked() -> None:
    with client_for(FakeManager([FakeTarget(pid=10, state="exited")])) as client:
        [t] = client.get("/targets").json()
        assert t["exited"] is True and t["ended_at"] is not None
        assert client.get("/detailed_snapshot").status_code == 200


def test_a_profile_that_failed_once_attached_says_why() -> None:
    failed = FakeTarget(pid=10, state="detached", error="snapshot 36: time 847 is before the previous snapshot's 855")
    with client_for(FakeManager([failed, FakeTarget(pid=11)])) as client:
        by_pid = {t["pid"]: t for t in client.get("/targets").json()}
        assert by_pid[10]["error"] == failed.error and by_pid[11]["error"] is None
        assert client.delete("/targets/10").json()["error"] == failed.error


# ---- malformed requests: 4xx JSON, never a traceback ------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("get", "/snapshot?pid=abc", {}),
        ("get", "/snapshot?pid=0", {}),
        ("get", "/snapshot?pid=99999999999999999999", {}),
        ("get", "/snapshot?format=xml", {}),
        ("post", "/targets", {"json": {"pid": "x"}}),
        ("post", "/targets", {"json": {"pid": -1}}),
        ("post", "/targets", {"json": {"pid": 5, "extra": 1}}),
        ("post", "/targets", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("post", "/monitor", {"json": {}}),
        ("post", "/monitor", {"json": {"command": 5}}),
        ("post", "/monitor", {"json": ["help"]}),
        ("delete", "/targets/abc", {}),
        ("get", "/nowhere", {}),
        ("put", "/snapshot", {}),
    ],
)
def test_malformed_requests_get_4xx_json(
    one: tuple[TestClient, FakeTarget, FakeManager], method: str, path: str, kwargs: dict  # type: ignore[type-arg]
) -> None:
    client, _, _ = one
    r = getattr(client, method)(path, **kwargs)
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    assert "detail" in r.json()
    assert "Traceback" not in r.text


def test_an_unexpected_error_is_a_500_json_without_traceback() -> None:
    target = FakeTarget(pid=10, fail_with=RuntimeError("boom at /secret/path"))
    app = create_app(ApiSettings(), FakeManager([target]))  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/detailed_snapshot")
    assert r.status_code == 500
    assert r.json() == {"detail": "internal error (see the daemon's log)", "error": "InternalError"}


# ---- security ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.invalid"])
def test_beyond_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(UsageError, match="token"):
        create_app(ApiSettings(host=host), FakeManager())  # type: ignore[arg-type]
    create_app(ApiSettings(host=host, token=TOKEN), FakeManager())  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    create_app(ApiSettings(host=host), FakeManager())  # type: ignore[arg-type]


def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEAPSCOPE_TOKEN", TOKEN)
    settings = ApiSettings(host="0.0.0.0")
    assert settings.token is not None and settings.token.get_secret_value() == TOKEN
    create_app(settings, FakeManager())  # type: ignore[arg-type]


def test_with_a_token_every_endpoint_but_healthz_requires_it(tmp_path: Path) -> None:
    manager = FakeManager([FakeTarget(pid=10)], output_dir=tmp_path)
    with client_for(manager, host="0.0.0.0", token=TOKEN) as client:
        assert client.get("/healthz").json() == {"status": "ok", "targets": 1}
        for method, path in (
            ("get", "/snapshot"),
            ("get", "/detailed_snapshot"),
            ("get", "/all_snapshots"),
            ("get", "/xtmemory"),
            ("get", "/targets"),
            ("get", "/metrics"),
            ("get", "/pprof"),
            ("get", "/debug/pprof/heap"),
            ("get", "/targets/10/debug/pprof/allocs"),
            ("delete", "/targets/10"),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
                r = getattr(client, method)(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        r = client.post("/monitor", json={"command": "help"})
        assert r.status_code == 401
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/snapshot", headers=ok).status_code == 200
        assert client.post("/monitor", json={"command": "help"}, headers=ok).status_code == 200
        schema = client.get("/openapi.json", headers=ok).json()
        assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_lifespan_starts_and_stops_the_manager() -> None:
    manager = FakeManager()
    with client_for(manager) as client:
        assert manager.calls == ["start"]
        client.get("/healthz")
    assert manager.calls == ["start", "shutdown"]


# ---- monitor commands through the API (the daemon's own run_monitor) ------------------------------------


def test_monitor_writes_under_the_output_dir(tmp_path: Path) -> None:
    target = FakeTarget(pid=4242)
    manager = FakeManager([target], output_dir=tmp_path)
    with client_for(manager, output_dir=tmp_path) as client:
        r = client.post("/monitor", json={"command": "detailed_snapshot ds.out"})
        assert r.status_code == 200, r.text
        assert r.json()["file"] == str(tmp_path / "ds.out")
        assert (tmp_path / "ds.out").read_text() == target.snapshot_text(True)
        r = client.post("/monitor", json={"command": "xtmemory"})
        assert (tmp_path / "xtmemory.kcg.4242.1").read_text() == target.render("xtree")
        client.post("/monitor", json={"command": "xtmemory xt.%p.%n"})
        assert (tmp_path / "xt.4242.2").exists()
        client.post("/monitor", json={"command": "all_snapshots"})
        assert (tmp_path / "massif.vgdb.out").read_text() == target.render("massif")
        help_text = client.post("/monitor", json={"command": "help"}).json()["output"]
        assert "detailed_snapshot [<filename>]" in help_text


@pytest.mark.parametrize(
    "name",
    ["/etc/evil", "../evil", "sub/../../evil", "link/evil", "filelink", "x.%q{HOME}", "fifo"],
)
def test_monitor_refuses_escapes(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (out / "sub").mkdir()
    (out / "link").symlink_to(outside)
    (outside / "victim").write_text("keep")
    (out / "filelink").symlink_to(outside / "victim")
    import os

    os.mkfifo(out / "fifo")
    manager = FakeManager([FakeTarget(pid=1)], output_dir=out)
    with client_for(manager, output_dir=out) as client:
        r = client.post("/monitor", json={"command": f"snapshot {name}"})
    assert 400 <= r.status_code < 500 and r.json()["detail"], r.text
    assert (outside / "victim").read_text() == "keep"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert not (tmp_path / "evil").exists()


def test_monitor_bad_commands(tmp_path: Path) -> None:
    manager = FakeManager([FakeTarget(pid=1)], output_dir=tmp_path)
    with client_for(manager) as client:
        for command in ("", "   ", "bogus", "snapshot a b", "help me"):
            r = client.post("/monitor", json={"command": command})
            assert r.status_code == 400 and r.json()["error"] == "UsageError", command


# ---- OpenAPI ----------------------------------------------------------------------------------------------


def test_openapi_documents_both_formats(one: tuple[TestClient, FakeTarget, FakeManager]) -> None:
    client, _, _ = one
    schema = client.get("/openapi.json").json()
    content = schema["paths"]["/detailed_snapshot"]["get"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/plain"}
    assert "MassifOut" in schema["components"]["schemas"]
    assert "XtreeOut" in schema["components"]["schemas"]


@pytest.mark.needs("ms_print")
def test_ms_print_reads_the_bodies(one: tuple[TestClient, FakeTarget, FakeManager], tmp_path: Path) -> None:
    client, _, _ = one
    for path in ("/detailed_snapshot", "/all_snapshots"):
        f = tmp_path / "m.out"
        f.write_text(client.get(path).text)
        done = subprocess.run(["ms_print", str(f)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        assert "make_big (prog.c:10)" in done.stdout
