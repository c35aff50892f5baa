"""The web page's endpoints over the fake daemon: GET / (no token, nothing from outside), the timeline, a
snapshot's tree and the diff, with their errors. The page in a real browser is tests/integration/test_webpage.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastapi.testclient import TestClient

from agent.export.webdata import frame_name
from agent.model.memline import MemoryPoint
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.tree import HeapTree
from api.app import create_app
from api.settings import ApiSettings
from tests.support.fake_daemon import MAIN, FakeManager, FakeTarget, frame, stack

TOKEN = "s3cret-token"
BIG = stack(frame(0x401100, "make_big", 10), MAIN)
GROWS = stack(frame(0x401300, "grows", 30), MAIN)


def history() -> list[Snapshot]:
    t1 = HeapTree.from_stacks({BIG: 60_000, GROWS: 1_000})
    t2 = HeapTree.from_stacks({BIG: 50_000, GROWS: 41_000})
    return [
        Snapshot(0, 0, 0, 0, None, SnapshotKind.NORMAL),
        Snapshot(100, t1.total, 16, 0, t1, SnapshotKind.DETAILED),
        Snapshot(150, 70_000, 16, 0, None, SnapshotKind.NORMAL),
        Snapshot(200, t2.total, 32, 0, t2, SnapshotKind.PEAK),
    ]


def client(**settings: object) -> tuple[TestClient, FakeTarget]:
    target = FakeTarget(pid=77, history=history(), memory=[MemoryPoint(0, 4096, 8192), MemoryPoint(140, 9999, 20000)])
    return TestClient(create_app(ApiSettings(**settings), FakeManager([target]))), target  # type: ignore[arg-type]


def test_page_is_one_response_with_nothing_from_outside() -> None:
    c, _ = client()
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "<script>" in html and "<style>" in html
    # No element loads anything: no src=, no href=, no url(), no @import; the only absolute URL is SVG's
    # namespace name, which is never fetched.
    assert not re.search(r"""\b(src|href)\s*=|url\(|@import""", html)
    assert set(re.findall(r"https?://[^\s\"'`]+", html)) == {"http://www.w3.org/2000/svg"}
    assert "default-src 'none'" in html  # and the page's own CSP forbids any other origin


def test_page_needs_no_token_but_its_data_does() -> None:
    c, _ = client(token=TOKEN)
    assert c.get("/").status_code == 200
    assert c.get("/targets/77/timeline").status_code == 401
    r = c.get("/targets/77/timeline", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200


def test_timeline_endpoint() -> None:
    c, target = client()
    body = c.get("/targets/77/timeline").json()
    assert len(body["points"]) == len(target.snapshots()) == 4
    assert (body["pid"], body["time_unit"], body["mode"], body["estimate"]) == (77, "ms", "exact", False)
    assert body["sites"] == [frame_name(BIG[0]), frame_name(GROWS[0]), "(other sites)"]
    assert body["points"][1]["sites"] == [60_000, 1_000, 0]
    assert body["points"][2]["sites"] is None
    assert body["points"][3]["sites"] == [50_000, 41_000, 0]
    assert body["peak_index"] == 3
    assert [(p["mapped"], p["rss"]) for p in body["points"]] == [(4096, 8192), (4096, 8192), (9999, 20000),
                                                                 (9999, 20000)]
    assert c.get("/targets/78/timeline").status_code == 404


def test_tree_endpoint() -> None:
    c, _ = client()
    points = c.get("/targets/77/timeline").json()["points"]
    body = c.get(f"/targets/77/snapshots/{points[3]['id']}/tree").json()
    assert body["kind"] == "peak" and body["root"]["bytes"] == 91_000
    assert [(n["name"], n["file"], n["line"], n["bytes"]) for n in body["root"]["children"]] == [
        ("make_big", "prog.c", 10, 50_000), ("grows", "prog.c", 30, 41_000)]
    assert body["root"]["children"][0]["children"][0]["name"] == "main"
    r = c.get(f"/targets/77/snapshots/{points[2]['id']}/tree")
    assert r.status_code == 409 and "normal" in r.json()["detail"]
    assert c.get("/targets/77/snapshots/201.0/tree").status_code == 409  # not kept (culled)
    assert c.get("/targets/77/snapshots/junk/tree").status_code == 404


def test_diff_endpoint_shows_the_growth() -> None:
    c, _ = client()
    points = c.get("/targets/77/timeline").json()["points"]
    body = c.get("/targets/77/diff", params={"a": points[1]["id"], "b": points[3]["id"]}).json()
    assert [(g["name"], g["before"], g["after"], g["delta"]) for g in body["sites_grew"]] == [
        (frame_name(GROWS[0]), 1_000, 41_000, 40_000)]
    assert [(g["name"], g["delta"]) for g in body["sites_shrank"]] == [(frame_name(BIG[0]), -10_000)]
    assert (body["grew"], body["shrank"]) == (40_000, 10_000)
    assert body["stacks_grew"][0]["path"] == [frame_name(GROWS[0]), frame_name(MAIN)]
    r = c.get("/targets/77/diff", params={"a": points[0]["id"], "b": points[3]["id"]})
    assert r.status_code == 409


def test_sampled_targets_are_estimates() -> None:
    c, target = client()
    target.mode = "sampled"  # type: ignore[attr-defined]  # the field sampled mode will add
    body = c.get("/targets/77/timeline").json()
    assert body["mode"] == "sampled" and body["estimate"] is True
