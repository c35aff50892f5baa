#!/usr/bin/env python3
"""The web page's size and speed with many sites, side by side with a small profile, in Debian's headless
Chromium (selenium, as the tests drive it).

    .venv/bin/python bench/webpage.py                      # the file part only: 10,000 sites beside 100
    sudo .venv/bin/python bench/webpage.py --live          # and the live daemon on bench/sites.c

1. File: a synthetic massif.out with N distinct allocation sites (each under one of 100 callers, under main),
   100 snapshots of which 11 have a tree, written by heapscope's own writer with --threshold=0 so that every
   site is in every tree; `heapscope view` makes the page. Measured: the file's and the page's sizes, view's
   time, and in the browser the time from navigation to the timeline drawn, to a tree drawn after a click, and
   to a diff drawn.
2. Live (root): `heapscope run --http` on bench/sites.c (N distinct stacks, allocating as fast as it can). After
   a few seconds the page is loaded; measured: bytes the browser received (page + JSON), the same three times,
   and each endpoint's answer size.
Results go to bench/results/webpage.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from agent.export.massif import write_massif  # noqa: E402
from agent.model.snapshot import Snapshot, SnapshotKind  # noqa: E402
from agent.model.stack import Frame  # noqa: E402
from agent.model.tree import HeapTree  # noqa: E402
from tests.support.browser import chromium  # noqa: E402

MAIN = Frame(0x400000, "main", "big.c", 1)


def synthetic(n_sites: int, n_snapshots: int = 100, every: int = 10) -> str:
    callers = [Frame(0x410000 + 16 * c, f"caller{c}", "big.c", 100 + c) for c in range(100)]
    sites = [(Frame(0x500000 + 16 * i, f"site{i}", "big.c", 1000 + i), callers[i % 100], MAIN) for i in range(n_sites)]
    snaps = []
    for k in range(n_snapshots):
        grow = k + 1
        if k % every == 0 or k == n_snapshots - 1:
            tree = HeapTree.from_stacks({s: (64 + (i * 7919 + k * 13) % 4096) * grow for i, s in enumerate(sites)})
            snaps.append(Snapshot(k * 100, tree.total, 8 * n_sites, 0, tree, SnapshotKind.DETAILED))
        else:
            total = sum(64 + (i * 7919 + k * 13) % 4096 for i in range(n_sites)) * grow
            snaps.append(Snapshot(k * 100, total, 8 * n_sites, 0, None, SnapshotKind.NORMAL))
    out = io.StringIO()
    write_massif(out, snaps, desc=["--threshold=0"], cmd="synthetic", time_unit="ms", threshold=0.0)
    return out.getvalue()


def wait_js(driver, expr: str, timeout: float = 120.0) -> object:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {expr}")
        if value is not None and value is not False:
            return value
        time.sleep(0.02)
    raise TimeoutError(expr)


CLICK_LAST_TREE = """
const pts = document.querySelectorAll('#timeline circle.point.tree');
window.heapscopeTimings.tree = null;
pts[pts.length - 1].dispatchEvent(new MouseEvent('click', {bubbles: true}));
"""
MARK_AND_DIFF = """
const pts = document.querySelectorAll('#timeline circle.point.tree');
window.heapscopeTimings.diff = null;
for (const p of [pts[0], pts[pts.length - 1]]) {
  document.querySelector(`#timeline circle.point[data-id="${p.dataset.id}"]`)
    .dispatchEvent(new MouseEvent('click', {bubbles: true, shiftKey: true}));
}
document.getElementById('compare').click();
"""
RECEIVED = """
const nav = performance.getEntriesByType('navigation')[0];
let total = nav.encodedBodySize;
for (const r of performance.getEntriesByType('resource')) total += r.encodedBodySize;
return total;
"""


def measure_page(driver, url: str, shot: Path | None = None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    driver.get(url)
    ready = float(wait_js(driver, "window.heapscopeTimings && window.heapscopeTimings.ready"))  # type: ignore[arg-type]
    points = driver.execute_script("return document.querySelectorAll('#timeline circle.point').length")
    driver.execute_script(CLICK_LAST_TREE)
    tree = float(wait_js(driver, "window.heapscopeTimings.tree"))  # type: ignore[arg-type]
    cells = driver.execute_script("return document.querySelectorAll('#tree rect.cell').length")
    if shot is not None:
        driver.save_screenshot(str(shot))
    driver.execute_script(MARK_AND_DIFF)
    diff = float(wait_js(driver, "window.heapscopeTimings.diff"))  # type: ignore[arg-type]
    return {"ready_ms": round(ready), "tree_ms": round(tree), "diff_ms": round(diff), "points": points,
            "tree_cells": cells, "received_bytes": driver.execute_script(RECEIVED)}


def file_part(n_sites: int, tmp: Path, driver) -> dict[str, object]:  # type: ignore[no-untyped-def]
    src = tmp / f"massif.out.{n_sites}"
    src.write_text(synthetic(n_sites))
    page = tmp / f"view-{n_sites}.html"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "agent.cli", "view", str(src), "-o", str(page)], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    view_s = time.monotonic() - t0
    result: dict[str, object] = {"sites": n_sites, "massif_out_bytes": src.stat().st_size,
                                 "page_bytes": page.stat().st_size, "view_seconds": round(view_s, 2)}
    result.update(measure_page(driver, page.as_uri(), BENCH / "results" / f"webpage-file-{n_sites}.png"))
    return result


def live_part(n_sites: int, tmp: Path, driver) -> dict[str, object]:  # type: ignore[no-untyped-def]
    import httpx

    sites = BENCH / "build" / "sites"
    sites.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-o", str(sites), str(BENCH / "sites.c")],
                   check=True)
    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--http", f"127.0.0.1:{port}",
                                 "--output-dir", out, "--", str(sites), str(n_sites), "120"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            time.sleep(8)  # every stack seen, some trees kept
            pid = httpx.get(f"{url}/targets").json()[0]["pid"]
            timeline = httpx.get(f"{url}/targets/{pid}/timeline", timeout=60)
            tree_ids = [p["id"] for p in timeline.json()["points"] if p["sites"] is not None]
            t0 = time.monotonic()
            tree = httpx.get(f"{url}/targets/{pid}/snapshots/{tree_ids[-1]}/tree", timeout=60)
            tree_s = time.monotonic() - t0
            result: dict[str, object] = {
                "stacks": n_sites,
                "page_bytes": len(httpx.get(url + "/").content),
                "timeline_json_bytes": len(timeline.content),
                "tree_json_bytes": len(tree.content),
                "tree_request_ms": round(1000 * tree_s),
                "tree_nodes": tree.json()["n_nodes"],
            }
            result.update(measure_page(driver, url + "/", BENCH / "results" / f"webpage-live-{n_sites}.png"))
            return result
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=10_000)
    ap.add_argument("--small", type=int, default=100, help="the small profile measured beside it")
    ap.add_argument("--live", action="store_true", help="also the live daemon on bench/sites.c (needs root)")
    args = ap.parse_args()
    results: dict[str, object] = {}
    (BENCH / "results").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, chromium() as driver:
        for n in (args.small, args.sites):
            results[f"file_{n}"] = r = file_part(n, Path(tmp), driver)
            print(json.dumps(r))
        if args.live:
            for n in (args.small, args.sites):
                results[f"live_{n}"] = r = live_part(n, Path(tmp), driver)
                print(json.dumps(r))
    out = BENCH / "results" / "webpage.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    small, big = results[f"file_{args.small}"], results[f"file_{args.sites}"]
    assert isinstance(small, dict) and isinstance(big, dict)
    for key in ("page_bytes", "ready_ms", "tree_ms", "diff_ms"):
        print(f"file {key}: {small[key]} ({args.small} sites) vs {big[key]} ({args.sites} sites), "
              f"x{big[key] / max(small[key], 1):.1f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
