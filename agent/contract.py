"""The kernel contract, read from probes/heap.h: the one place where the BPF program's sizes, enums and struct
fields are declared.

Python takes every value it shares with heap.bpf.c from here, so the two cannot drift apart:
`HEAP_H.value("HS_RULE_CACHE")`, `HEAP_H.enum("hs_fn")`, `HEAP_H.struct_fields("hs_global")`. Only the simple
forms heap.h uses are understood: `#define NAME <integer>` (a default inside `#ifndef` counts), enum members
with explicit integer values, and struct fields of one declarator each. tests/unit/test_contract.py checks the
Python mirrors (Counters, the unwind row, the page event) against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from importlib import resources

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DEFINE = re.compile(r"^\s*#\s*define\s+(HS_\w+)\s+(\(?-?(?:0x[0-9a-fA-F]+|\d+)\)?)[uUlL]*\s*$", re.M)
_ENUM = re.compile(r"\benum\s+(\w+)\s*\{(.*?)\}", re.S)
_MEMBER = re.compile(r"^\s*(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))\s*$")
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{(.*?)\};", re.S)
_FIELD = re.compile(r"^\s*(?:struct\s+)?(\w+)\s+(\w+)\s*(?:\[[^\]]*\])?\s*$")


@dataclass(frozen=True)
class StructField:
    type: str  # as written: __u64, __s16, hs_thread_stat (a nested struct)...
    name: str


class HeaderContract:
    """The integer defines, enums and structs of one C header."""

    def __init__(self, text: str) -> None:
        self._text = _COMMENT.sub(" ", text)

    @cached_property
    def _defines(self) -> dict[str, int]:
        return {name: int(value.strip("()"), 0) for name, value in _DEFINE.findall(self._text)}

    @cached_property
    def _enums(self) -> dict[str, dict[str, int]]:
        enums: dict[str, dict[str, int]] = {}
        for name, body in _ENUM.findall(self._text):
            members: dict[str, int] = {}
            for item in body.split(","):
                if not item.strip():
                    continue
                m = _MEMBER.match(item)
                if m is None:
                    raise ValueError(f"heap.h: enum {name}: member {item.strip()!r} has no explicit value")
                members[m.group(1)] = int(m.group(2), 0)
            enums[name] = members
        return enums

    @cached_property
    def _structs(self) -> dict[str, tuple[StructField, ...]]:
        structs = {}
        for name, body in _STRUCT.findall(self._text):
            fields = []
            for decl in body.split(";"):
                if not decl.strip():
                    continue
                m = _FIELD.match(decl)
                if m is None:
                    raise ValueError(f"heap.h: struct {name}: cannot read field {decl.strip()!r}")
                fields.append(StructField(m.group(1), m.group(2)))
            structs[name] = tuple(fields)
        return structs

    def value(self, name: str) -> int:
        try:
            return self._defines[name]
        except KeyError:
            raise KeyError(f"probes/heap.h defines no integer {name}") from None

    def enum(self, name: str) -> dict[str, int]:
        try:
            return dict(self._enums[name])
        except KeyError:
            raise KeyError(f"probes/heap.h has no enum {name}") from None

    def struct_fields(self, name: str) -> tuple[StructField, ...]:
        try:
            return self._structs[name]
        except KeyError:
            raise KeyError(f"probes/heap.h has no struct {name}") from None


def _read_heap_h() -> HeaderContract:
    return HeaderContract(resources.files("probes").joinpath("heap.h").read_text())


HEAP_H = _read_heap_h()
