"""A reader of heapscope's MALT JSON documents for the tests: stacks resolved to their call sites."""

from __future__ import annotations

from typing import Any


class Profile:
    """A MALT JSON document with its stacks resolved to (function, file, line) of their call site."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        sites = doc["sites"]
        self.strings: list[str] = sites["strings"]
        self.instr: dict[str, dict[str, int]] = sites["instr"]

    def location(self, address: str) -> tuple[str, str, int] | None:
        entry = self.instr.get(address)
        if not entry or "file" not in entry:
            return None
        return self.strings[entry["function"]], self.strings[entry["file"]].rsplit("/", 1)[-1], entry["line"]

    def function_of(self, stack: dict[str, Any]) -> str:
        """The allocation function a stack called: its leaf frame is that function (as in MALT's files)."""
        return self.strings[self.instr[stack["stack"][0]]["function"]]

    def stacks_at(self, line: int, function: str, source: str = "malt_known.c") -> list[dict[str, Any]]:
        """Stacks calling `function` whose call site in the program (first frame in `source`) is `line`."""
        out = []
        for stack in self.doc["stacks"]["stats"]:
            if self.function_of(stack) != function:
                continue
            for address in stack["stack"]:
                loc = self.location(address)
                if loc and loc[1] == source:
                    if loc[2] == line:
                        out.append(stack)
                    break
        return out

    def one_stack(self, line: int, function: str = "malloc") -> dict[str, Any]:
        found = self.stacks_at(line, function)
        assert len(found) == 1, f"expected one {function} stack at malt_known.c:{line}, found {len(found)}"
        return found[0]["infos"]
