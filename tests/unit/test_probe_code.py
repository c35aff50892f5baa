"""Whether a process's copy of a sampler probe function is left over from another process's uprobe
(agent.process.sampler.stale_probe_code): the decision that has heapscope put the library's code back in a forked
child before its probes go on (tests/integration/test_fleet.py shows it on a real worker)."""

from __future__ import annotations

from agent.process.sampler import stale_probe_code

NOP5 = bytes.fromhex("0f1f440000")  # what the library has at each probe function
AT = 0x7F00_0000_4000  # the function's address in the process
TRAMPOLINE = (0x7F00_0000_0000, 0x7F00_0000_1000)  # a [uprobes-trampoline] page


def call_to(target: int) -> bytes:
    return b"\xe8" + (target - (AT + 5)).to_bytes(4, "little", signed=True)


def test_the_library_code_and_a_probe_not_optimized_yet_are_not_stale() -> None:
    assert not stale_probe_code(NOP5, NOP5, AT, [])
    assert not stale_probe_code(b"\xcc" + NOP5[1:], NOP5, AT, [])  # an int3 on the first byte


def test_a_call_into_a_trampoline_the_process_has_is_its_own_optimized_probe() -> None:
    assert not stale_probe_code(call_to(TRAMPOLINE[0]), NOP5, AT, [TRAMPOLINE])


def test_a_call_into_nothing_is_stale() -> None:
    """A forked child's copy of its parent's optimized probe: the trampoline page was not carried into it."""
    assert stale_probe_code(call_to(TRAMPOLINE[0]), NOP5, AT, [])
    assert stale_probe_code(call_to(TRAMPOLINE[1]), NOP5, AT, [TRAMPOLINE])  # just past the page


def test_what_the_kernel_leaves_over_a_stale_call_is_stale() -> None:
    """An int3 put on top of the inherited call, and the first byte put back over it when that probe came off:
    the bytes a worker died on (0f eb b8 ff ff)."""
    stale = call_to(TRAMPOLINE[0])
    assert stale_probe_code(b"\xcc" + stale[1:], NOP5, AT, [TRAMPOLINE])
    assert stale_probe_code(bytes.fromhex("0febb8ffff"), NOP5, AT, [TRAMPOLINE])
