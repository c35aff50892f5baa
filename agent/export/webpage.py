"""The web page: one HTML document with its style and script inline (agent/export/web/), so it needs no other
request, from the daemon (`GET /`, which then fetches its data from the JSON endpoints) or as a file
(`heapscope view`, with its data embedded). Nothing in it names an outside address."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def _asset(name: str) -> str:
    return resources.files("agent.export").joinpath("web", name).read_text(encoding="utf-8")


def embed_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: no `</` can end it, no `<!--` open a comment."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_page(data: Any | None) -> str:
    """The page; with `data` (the shapes of agent.export.webdata, see agent.offline.view) it shows that data instead of
    asking the daemon."""
    html = _asset("page.html")
    block = "" if data is None else f'<script type="application/json" id="heapscope-data">{embed_json(data)}</script>'
    # The data goes in last: no later replace() may touch it (a function name may read "/*SCRIPT*/"); the
    # assets hold no marker.
    return (
        html.replace("/*STYLE*/", _asset("page.css"))
        .replace("/*SCRIPT*/", _asset("page.js"))
        .replace("<!--DATA-->", block)
    )
