"""The data heapscope's web page embeds, read back from its HTML."""

from __future__ import annotations

import json
import re


def embedded(html: str) -> dict:  # type: ignore[type-arg]
    m = re.search(r'<script type="application/json" id="heapscope-data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))  # type: ignore[no-any-return]
