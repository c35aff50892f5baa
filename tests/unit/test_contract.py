"""The kernel contract: probes/heap.h is the one declaration; Python's mirrors of it must agree field by field."""

from __future__ import annotations

import re
import struct
from dataclasses import fields
from pathlib import Path

import pytest

from agent.contract import HEAP_H, HeaderContract
from agent.kernel import abi
from agent.kernel.interface import MaltSiteFields
from agent.kernel.loader import program_text
from agent.model.counters import Counters, PageCounters
from agent.model.functions import ALLOC_FUNCTIONS, ENTRY_ONLY_KINDS, EXACT_ONLY, SAMPLED_ONLY
from agent.model.pages import KINDS as PAGE_KINDS
from agent.symbols import unwind

# The whole program, heap.bpf.c with its parts (probes/bpf/) written in, as bcc compiles it.
BPF_SOURCE = program_text(Path(__file__).resolve().parents[2] / "probes" / "heap.bpf.c")

# struct module codes of the C types heap.h uses.
_CODES = {"__u64": "Q", "__s64": "q", "__u32": "I", "__s32": "i", "__u16": "H", "__s16": "h", "__u8": "B"}


def _format_of(struct_name: str) -> str:
    return "<" + "".join(_CODES[f.type] for f in HEAP_H.struct_fields(struct_name))


def test_every_alloc_kind_is_a_kernel_kind_with_an_entry_program() -> None:
    kinds = {f"HS_{f.kind.upper()}" for f in ALLOC_FUNCTIONS}
    members = set(HEAP_H.enum("hs_fn")) - {"HS_FN_COUNT"}
    assert kinds == members
    for kind in {f.kind for f in ALLOC_FUNCTIONS}:
        assert re.search(rf"\bint {kind}_enter\(struct pt_regs \*ctx\)", BPF_SOURCE), kind
        if kind not in ENTRY_ONLY_KINDS:
            assert f"case HS_{kind.upper()}" in BPF_SOURCE or kind in ("malloc", "valloc"), kind


def test_fn_count_counts_the_kinds() -> None:
    fn = HEAP_H.enum("hs_fn")
    assert fn["HS_FN_COUNT"] == len(fn) - 1 == len(abi.FN_KINDS)
    assert sorted(fn.values())[:-1] == list(range(len(fn) - 1))


def test_symbols_are_listed_once() -> None:
    symbols = [f.symbol for f in ALLOC_FUNCTIONS]
    assert len(symbols) == len(set(symbols))


def test_counters_mirror_hs_global() -> None:
    # Every field but the target's slot, which user space writes and the programs read (probes/bpf/common.h).
    counters = [f.name for f in HEAP_H.struct_fields("hs_global") if f.name not in ("slot", "slot_pad")]
    assert [f.name for f in fields(Counters)] == counters


def test_page_counters_mirror_the_enum() -> None:
    members = sorted((v, k) for k, v in HEAP_H.enum("hs_page_counter").items() if k != "HS_PGC_COUNT")
    assert [k.removeprefix("HS_PGC_").lower() for _, k in members] == [f.name for f in fields(PageCounters)]
    assert len(fields(PageCounters)) == abi.PAGE_COUNTER_COUNT


def test_malt_site_fields_are_hs_site_fields() -> None:
    site = {f.name for f in HEAP_H.struct_fields("hs_site")}
    assert {f.name for f in fields(MaltSiteFields)} <= site


def test_unwind_row_is_hs_row() -> None:
    assert unwind.ROW.format == _format_of("hs_row")
    assert struct.calcsize(unwind.ROW.format) == 12
    cfa = HEAP_H.enum("hs_cfa_type")
    assert (
        cfa["HS_CFA_RSP"],
        cfa["HS_CFA_RBP"],
        cfa["HS_CFA_PLT"],
        cfa["HS_CFA_NONE"],
        cfa["HS_CFA_END"],
    ) == (unwind.CFA_RSP, unwind.CFA_RBP, unwind.CFA_PLT, unwind.CFA_NONE, unwind.CFA_END)
    # Row flags must not collide with the rule cache's own flag.
    flags = (unwind.FLAG_RBP_SAVED, unwind.FLAG_RBP_UNKNOWN, HEAP_H.value("HS_RULE_MAPPED"))
    assert len(set(flags)) == 3 and all(f & (f - 1) == 0 for f in flags)


def test_page_event_is_hs_page_event() -> None:
    assert abi.PAGE_EVENT.format == _format_of("hs_page_event").replace("QQQQQQQQ", "8Q").replace("II", "2I")
    assert set(abi.PAGE_KINDS.values()) == set(PAGE_KINDS)


def test_control_words_and_events() -> None:
    control = HEAP_H.enum("hs_control")
    assert (
        control["HS_CTL_ARMED"],
        control["HS_CTL_STOPPED"],
        control["HS_CTL_UMAPS"],
        control["HS_CTL_STACK_EPOCH"],
        control["HS_CTL_STACK_END"],
    ) == (abi.CTL_ARMED, abi.CTL_STOPPED, abi.CTL_UMAPS, abi.CTL_STACK_EPOCH, abi.CTL_STACK_END)
    # The word's count (up to HS_MAX_UMAPS) fits below its half, the half's one bit below the identity.
    assert abi.MAX_UMAPS < 1 << abi.UMAPS_HALF_SHIFT and abi.UMAPS_ID_SHIFT == abi.UMAPS_HALF_SHIFT + 1


def test_the_umaps_word_names_the_mapping_set_not_the_target() -> None:
    """Two targets that publish the same mappings (a prefork server's workers) get one identity, so they share the
    kernel's cached rules; any other set gets another (a rule found in one set is never taken for another); the
    half and the count read back as the kernel reads them."""
    libc = (0x7F0000001000, 0x7F0000100000, 0x7F0000000000, "build-id:aa")
    exe = (0x555500001000, 0x555500002000, 0x555500000000, "build-id:bb")
    word = abi.umaps_word([exe, libc], 1)
    assert word == abi.umaps_word([exe, libc], 1)
    assert word & ((1 << abi.UMAPS_HALF_SHIFT) - 1) == 2 and (word >> abi.UMAPS_HALF_SHIFT) & 1 == 1
    identity = word >> abi.UMAPS_ID_SHIFT
    assert identity == abi.umaps_word([exe, libc], 0) >> abi.UMAPS_ID_SHIFT  # the half is not the set
    others = [
        [exe],  # a mapping fewer
        [exe, (libc[0] + 0x1000, libc[1] + 0x1000, libc[2] + 0x1000, libc[3])],  # libc elsewhere
        [exe, (*libc[:3], "build-id:cc")],  # another object at the same place
        [exe, (libc[0], libc[1], libc[2] + 0x1000, libc[3])],  # another bias
    ]
    assert len({identity, *(abi.umaps_word(o, 1) >> abi.UMAPS_ID_SHIFT for o in others)}) == 1 + len(others)
    assert abi.umaps_word([], 0) == 0  # nothing published: no identity
    assert all(abi.umaps_word([m], 0) >> abi.UMAPS_ID_SHIFT for m in (exe, libc))  # a set's never 0


def test_the_parser_reads_heap_h_forms() -> None:
    h = HeaderContract(
        "#ifndef HS_X\n#define HS_X 12 /* a default */\n#endif\n"
        "enum e { A = 1, /* one */ B = 0x10, };\n"
        "struct s { __u64 a; __u32 b[4]; struct t c; };\n"
    )
    assert h.value("HS_X") == 12
    assert h.enum("e") == {"A": 1, "B": 16}
    assert [(f.type, f.name) for f in h.struct_fields("s")] == [("__u64", "a"), ("__u32", "b"), ("t", "c")]
    with pytest.raises(KeyError, match="HS_Y"):
        h.value("HS_Y")


def test_the_parser_refuses_implicit_enum_values() -> None:
    with pytest.raises(ValueError, match="no explicit value"):
        HeaderContract("enum e { A = 0, B };").enum("e")


def test_the_samplers_hooks_are_the_allocation_functions_but_for_what_is_said() -> None:
    """One table: agent.model.functions. The sampler's hooks (hs_sampler.c's define_hooks) are read from its source
    and must be the same functions, but for SAMPLED_ONLY and EXACT_ONLY, each of which says why."""
    source = (Path(__file__).resolve().parents[2] / "probes" / "sampler" / "hs_sampler.c").read_text()
    hooked = set(re.findall(r'DEF\(H_\w+, "([^"]+)", hs_hook_\w+\);', source))
    assert len(hooked) > 20, hooked
    probed = {f.symbol for f in ALLOC_FUNCTIONS}
    assert hooked == (probed - set(EXACT_ONLY)) | set(SAMPLED_ONLY), (
        f"hooked, not probed and not said: {sorted(hooked - probed - set(SAMPLED_ONLY))}; "
        f"probed, not hooked and not said: {sorted(probed - hooked - set(EXACT_ONLY))}"
    )
    assert set(EXACT_ONLY) <= probed and not set(SAMPLED_ONLY) & probed
