"""The web page in a real browser: Debian's headless Chromium, driven by selenium through Debian's chromedriver.

- Live: `heapscope run --http` profiles web_growth.c (gcc); the page lists the target and its sites, draws one
  point per snapshot of the profile (checked against /all_snapshots, read by the tests' strict massif reader),
  shows a clicked point's tree with that snapshot's bytes, and the diff across the known growth
  (40 x 25000 B in grow_site).
- A file: `heapscope view` of the massif.out real Valgrind wrote for the same program: the same checks, against
  the file.
- Neither page sends a request anywhere but the loopback server (or, for the file, nowhere): every URL the
  browser requested is read from its DevTools network events.

Screenshots go to tests/artifacts/ (or $HEAPSCOPE_TEST_ARTIFACTS); each test prints their paths.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.browser import by_css, chromium, outside, requested_urls, retry, screenshot, wait_until
from tests.support.daemon import answers, free_port
from tests.support.massif_reader import parse_massif
from tests.support.sources import source_line
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

GROWTH = 40 * 25000
KEPT = 8 * 2000


GROW_SITE = f"grow_site (web_growth.c:{source_line('web_growth.c', 'grown[i] = malloc(25000)')})"
KEEP_SITE = f"keep_site (web_growth.c:{source_line('web_growth.c', 'kept[i] = malloc(2000)')})"


@pytest.fixture(scope="module")
def program(build: Callable[..., Path]) -> Path:
    return build("web_growth.c")


# The live page redraws itself every second: the DOM is read in one script (never through element handles,
# which a redraw makes stale), and clicks are tried again on a stale element.


def point_ids(driver, css: str = "#timeline circle.point") -> list[str]:  # type: ignore[no-untyped-def]
    return driver.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll(arguments[0])].map((c) => c.dataset.id)", css)


def legend(driver) -> list[str]:  # type: ignore[no-untyped-def]
    return driver.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll('#legend span')].map((s) => s.textContent)")


def mark_point(driver, sid: str) -> None:  # type: ignore[no-untyped-def]
    """Shift-click the point `sid` until the page has it marked (a redraw between finding the point and the
    click can move the point from under the pointer)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    def marked() -> bool:
        return sid in (driver.execute_script("return document.getElementById('marks').dataset.ids") or "").split()

    for _ in range(5):
        if marked():
            return

        def act() -> None:
            point = driver.find_element(*by_css(f'#timeline circle.point[data-id="{sid}"]'))
            ActionChains(driver).key_down(Keys.SHIFT).click(point).key_up(Keys.SHIFT).perform()

        retry(act)
        time.sleep(0.2)
    assert marked(), f"{sid} not marked: " + driver.find_element(*by_css("#status")).text


def click_point(driver, sid: str) -> None:  # type: ignore[no-untyped-def]
    retry(lambda: driver.find_element(*by_css(f'#timeline circle.point[data-id="{sid}"]')).click())


def tree_cells(driver) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The flame graph's cells: label -> bytes (summed where a label repeats)."""
    out: dict[str, int] = {}
    cells = driver.execute_script(
        "return [...document.querySelectorAll('#tree rect.cell')].map((r) => [r.dataset.name, r.dataset.bytes])")
    for name, nbytes in cells:
        out[name] = out.get(name, 0) + int(nbytes)
    return out


def expected_ids(snapshots) -> list[str]:  # type: ignore[no-untyped-def]
    """The page's point ids for a massif.out's snapshots: TIME.N, the Nth snapshot at that time."""
    seen: dict[int, int] = {}
    out = []
    for s in snapshots:
        out.append(f"{s.time}.{seen.get(s.time, 0)}")
        seen[s.time] = seen.get(s.time, 0) + 1
    return out


def site_bytes(tree) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """First-level bytes of a massif_reader tree, by `function (file:line)`."""
    from tests.support.massif_reader import strip_address

    out: dict[str, int] = {}
    for c in tree.children:
        name = strip_address(c.label)
        out[name] = out.get(name, 0) + c.bytes
    return out


def check_diff(driver, a: str, b: str, before: int, after: int) -> None:  # type: ignore[no-untyped-def]
    """Mark a and b, compare, and find grow_site's growth in the table of sites that grew."""

    def marks() -> set[str]:
        return set((driver.execute_script("return document.getElementById('marks').dataset.ids") or "").split())

    # A live redraw can rescale the timeline between finding a point and the click, so a click may land on
    # (and mark) another point: start again from no marks until exactly a and b are marked.
    for _ in range(5):
        retry(lambda: driver.find_element(*by_css("#clear-marks")).click())
        mark_point(driver, a)
        mark_point(driver, b)
        if marks() == {a, b}:
            break
    assert marks() == {a, b}, marks()
    wait_until(driver, lambda: driver.find_element(*by_css("#compare")).is_enabled(), "the compare button")
    driver.find_element(*by_css("#compare")).click()
    wait_until(driver, lambda: driver.find_elements(*by_css("#diff table.diff-grew tr[data-name]")), "the diff")
    rows = {name: int(delta) for name, delta in driver.execute_script(
        "return [...document.querySelectorAll('#diff table.diff-grew tr[data-name]')]"
        ".map((r) => [r.dataset.name, r.dataset.delta])")}
    assert rows.get(GROW_SITE) == after - before, rows
    assert KEEP_SITE not in rows  # it did not change
    assert "grow_site" in driver.find_element(*by_css("#diff-panel")).text


def test_live_page_of_a_running_program(heapscope_cmd: list[str], program: Path, tmp_path: Path) -> None:
    port = free_port()
    host = f"127.0.0.1:{port}"
    url = f"http://{host}"
    cmd = [*heapscope_cmd, "run", "--http", host, "--output-dir", str(tmp_path), "--detailed-freq=1",
           # No culling within the test, however slow the machine: every snapshot seen stays.
           "--sample-interval=0.25", "--max-snapshots=1000", "--", str(program)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        if proc.stdout.readline() != b"ready\n":
            proc.wait(60)
            raise AssertionError(f"heapscope run did not start the program:\n{proc.stderr.read().decode()}")
        wait_for(lambda: answers(f"{url}/healthz"), what="the daemon to answer")
        with chromium() as driver:
            requested_urls(driver)  # the browser's own start-up page is not ours
            driver.get(url + "/")
            # The target and its sites.
            (listed,) = httpx.get(f"{url}/targets", timeout=30).json()
            pid = listed["pid"]  # the program's, which heapscope launched
            wait_until(driver, lambda: driver.find_elements(*by_css(f'#targets button[data-pid="{pid}"]')),
                       "the target in the list")
            assert "profiling" in driver.find_element(*by_css("#targets")).text
            wait_until(driver, lambda: KEEP_SITE in legend(driver), f"{KEEP_SITE} in the legend")
            before = point_ids(driver)
            tree_before = point_ids(driver, "#timeline circle.tree")
            assert before and tree_before
            # The known growth; the live page follows it.
            proc.stdin.write(b"\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == b"grown\n"
            wait_until(driver, lambda: GROW_SITE in legend(driver), f"{GROW_SITE} in the legend (live update)")

            def growth_drawn() -> bool:  # the page's last point is a snapshot of the whole growth
                drawn = point_ids(driver)
                snaps = parse_massif(httpx.get(f"{url}/all_snapshots", timeout=30).text).snapshots
                last = snaps[len(drawn) - 1] if 0 < len(drawn) <= len(snaps) else None
                return (len(drawn) > len(before) + 2 and last is not None and last.tree is not None
                        and site_bytes(last.tree).get(GROW_SITE) == GROWTH)

            wait_until(driver, growth_drawn, "a point of the whole growth drawn")
            # One point per snapshot: what the page drew is the profile's list of snapshots as it was then
            # (the same times in the same order, none missing, none extra; none culled: --max-snapshots=1000).
            ids = point_ids(driver)
            profile = parse_massif(httpx.get(f"{url}/all_snapshots", timeout=30).text)
            assert len(ids) <= len(profile.snapshots) < 1000
            assert ids == expected_ids(profile.snapshots)[: len(ids)]
            screenshot(driver, "live-timeline")
            # The mapped total and RSS lines, sampled beside the snapshots: after the growth the process has
            # touched the grown blocks (RSS), and mapped at least its heap.
            assert {"mapped (dashed)", "RSS (dotted)"} <= set(legend(driver))
            last_point = httpx.get(f"{url}/targets/{pid}/timeline", timeout=30).json()["points"][-1]
            assert last_point["rss"] >= GROWTH
            assert last_point["mapped"] >= last_point["heap"] + last_point["extra"] >= GROWTH
            # A click on a point shows that point's tree, with that snapshot's bytes.
            last = ids[-1]
            snap = profile.snapshots[len(ids) - 1]
            assert snap.tree is not None
            click_point(driver, last)
            wait_until(driver, lambda: f"#{len(ids) - 1} " in driver.find_element(*by_css("#tree-title")).text,
                       "the tree of the clicked point")
            cells = tree_cells(driver)
            expected = site_bytes(snap.tree)
            assert cells[GROW_SITE] == expected[GROW_SITE] == GROWTH
            assert cells[KEEP_SITE] == expected[KEEP_SITE] == KEPT
            screenshot(driver, "live-tree")
            # The diff across the growth: from the last point with a tree that the profile shows before it (read
            # from the profile, not from the page's order of points: a tick can fall between the page's last
            # redraw and the growth) to the last one.
            pre_growth = [i for i, s in enumerate(profile.snapshots[: len(ids)]) if s.tree is not None
                          and s.heap_B == KEPT and ids[i] in tree_before]
            assert pre_growth, "no snapshot with a tree before the growth"
            check_diff(driver, ids[pre_growth[-1]], last, 0, GROWTH)
            screenshot(driver, "live-diff")
            # Nothing left the machine: every request went to the loopback server.
            urls = requested_urls(driver)
            assert any("/timeline" in u for u in urls) and any("/tree" in u for u in urls), urls
            assert outside(urls, host) == [], outside(urls, host)
            assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        proc.stdin.close()
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "Traceback" not in err, err


def test_view_of_a_valgrind_massif_out(cli_cmd: list[str], program: Path, tmp_path: Path) -> None:
    out = tmp_path / "massif.out.valgrind"
    done = subprocess.run(
        ["valgrind", "-q", "--tool=massif", "--detailed-freq=1", "--time-unit=B", f"--massif-out-file={out}",
         str(program)], input=b"\n", capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()
    profile = parse_massif(out.read_text())
    page = tmp_path / "valgrind.html"
    made = subprocess.run([*cli_cmd, "view", str(out), "-o", str(page)], capture_output=True, text=True,
                          check=False)
    assert made.returncode == 0, made.stderr
    with chromium() as driver:
        requested_urls(driver)
        driver.get(page.as_uri())
        wait_until(driver, lambda: point_ids(driver), "the timeline")
        ids = point_ids(driver)
        # Exactly one point per snapshot of the file.
        assert ids == expected_ids(profile.snapshots)
        assert GROW_SITE in legend(driver) and KEEP_SITE in legend(driver)
        screenshot(driver, "view-timeline")
        # The last tree, as Valgrind wrote it (Massif marks a peak only once something is freed after it).
        peak = max(i for i, s in enumerate(profile.snapshots) if s.tree is not None)
        click_point(driver, ids[peak])
        wait_until(driver, lambda: f"#{peak} " in driver.find_element(*by_css("#tree-title")).text, "the last tree")
        cells = tree_cells(driver)
        tree = profile.snapshots[peak].tree
        assert tree is not None
        assert cells[GROW_SITE] == site_bytes(tree)[GROW_SITE] == GROWTH
        screenshot(driver, "view-tree")
        # The diff from the first snapshot with all of keep_site's blocks to the last.
        first = next(i for i, s in enumerate(profile.snapshots)
                     if s.tree is not None and site_bytes(s.tree).get(KEEP_SITE) == KEPT)
        check_diff(driver, ids[first], ids[peak], 0, GROWTH)
        screenshot(driver, "view-diff")
        # From the keyboard alone: Home, then End and Enter on the timeline; on the graph, down to the
        # biggest site.
        from selenium.webdriver.common.keys import Keys

        driver.execute_script("document.querySelector('#timeline svg').focus()")
        driver.switch_to.active_element.send_keys(Keys.HOME)
        assert driver.find_element(*by_css("#cursor-info")).text.startswith("#0 ")
        driver.switch_to.active_element.send_keys(Keys.END)
        driver.switch_to.active_element.send_keys(Keys.ENTER)
        last = len(ids) - 1
        wait_until(driver, lambda: f"#{last} " in driver.find_element(*by_css("#tree-title")).text, "the tree by keys")
        driver.execute_script("document.querySelector('#tree svg').focus()")
        driver.switch_to.active_element.send_keys(Keys.ARROW_DOWN)
        wait_until(driver, lambda: driver.find_element(*by_css("#node-info")).text.startswith(GROW_SITE),
                   "grow_site focused by the arrow keys")
        assert f"{GROWTH:,} B" in driver.find_element(*by_css("#node-info")).text
        urls = requested_urls(driver)
        assert outside(urls, None) == [], outside(urls, None)
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
