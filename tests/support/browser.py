"""Debian's headless Chromium driven by selenium (chromedriver from Debian too), for the web page's tests.

Every request the page makes is read back from the browser's own DevTools network events (the performance
log), so a test can check that no request left the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
)
# Where screenshots go: kept after the run (git ignores the directory), printed by the tests.
ARTIFACTS = Path(os.environ.get("HEAPSCOPE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts"))


def browser_available() -> None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            if os.environ.get("CI") == "true":
                pytest.fail(f"{path} is missing (scripts/apt-packages-dev.txt installs chromium and chromium-driver)")
            pytest.skip(f"{path} is missing")


@contextmanager
def chromium() -> Iterator[object]:
    """A fresh headless Chromium (its own --user-data-dir), with the performance log on."""
    browser_available()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="heapscope-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def requested_urls(driver: object) -> list[str]:
    """The URLs of every request the browser sent since the last call (DevTools Network.requestWillBeSent)."""
    urls = []
    for entry in driver.get_log("performance"):  # type: ignore[attr-defined]
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def outside(urls: list[str], allowed_host: str | None) -> list[str]:
    """The URLs that are neither on the loopback server `allowed_host` (host:port) nor the page's own file or
    inline data. The browser's own chrome:// pages (its start page) are internal and never reach a network."""
    bad = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme == "chrome":
            continue
        if parts.scheme in ("file", "data", "about", "blob"):
            if parts.scheme == "file" and allowed_host is not None:
                bad.append(url)
            continue
        if allowed_host is None or parts.netloc != allowed_host or parts.hostname not in ("127.0.0.1", "localhost"):
            bad.append(url)
    return bad


def screenshot(driver: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    print(f"screenshot: {path}")
    return path


def by_css(css: str):  # type: ignore[no-untyped-def]
    """A CSS selector as selenium's find_element takes it."""
    from selenium.webdriver.common.by import By

    return (By.CSS_SELECTOR, css)


def wait_until(driver, check: Callable[[], object], what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    """`check()`'s first true value, polled; a timeout fails with `what` and the page's status line."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda _: check())
    except TimeoutException:
        status = driver.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {what} (the page says: {status!r})") from None


def retry(action: Callable[[], None]) -> None:
    """Do `action` again while the element it acts on goes stale (the live page redraws itself every second)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(10):
        try:
            action()
            return
        except StaleElementReferenceException:
            time.sleep(0.05)
    action()
