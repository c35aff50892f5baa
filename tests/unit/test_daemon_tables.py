"""The kernel tables of a daemon's targets against a command's (agent/session/pipeline.py ProfileSettings): serve's
exact-mode targets share the node's block table and keep smaller tables of their own, so that 50 fit in 1 GiB;
a command's one target keeps its defaults."""

from __future__ import annotations

from agent.kernel.abi import DAEMON_PAGE_RING_BYTES, PAGE_RING_BYTES, SAMPLED_PAGE_RING_BYTES
from agent.kernel.interface import table_sizes
from agent.model.options import MassifOptions
from agent.model.sampling import DAEMON_EXACT_STACKS, DEFAULT_CAPACITY, DEFAULT_NODE_BLOCKS, ProfileMode
from agent.session.pipeline import ProfileSettings


def settings(mode: str, node_blocks: int, **kw: int) -> ProfileSettings:
    return ProfileSettings(opts=MassifOptions(), mode=ProfileMode(mode), node_blocks=node_blocks, **kw)  # type: ignore[arg-type]


def test_a_commands_exact_target_keeps_its_defaults() -> None:
    p = settings("exact", 0).probe_settings(1, launched=False)
    assert (p.max_stacks, p.max_blocks) == (DEFAULT_CAPACITY["exact"][1], DEFAULT_CAPACITY["exact"][0])
    assert p.page_ring_bytes == PAGE_RING_BYTES
    sizes = table_sizes(p)
    assert sizes["HS_TARGET_BLOCKS"] == p.max_blocks and sizes["HS_BLOCK_SLOTS"] >= p.max_blocks


def test_a_daemons_exact_target_shares_the_node_table_and_keeps_smaller_ones() -> None:
    p = settings("exact", DEFAULT_NODE_BLOCKS).probe_settings(1, launched=False)
    assert p.max_stacks == DAEMON_EXACT_STACKS < DEFAULT_CAPACITY["exact"][1]
    assert p.page_ring_bytes == DAEMON_PAGE_RING_BYTES < PAGE_RING_BYTES
    sizes = table_sizes(p)
    assert sizes["HS_TARGET_BLOCKS"] == DEFAULT_CAPACITY["exact"][0]  # each target's own limit
    assert sizes["HS_BLOCK_SLOTS"] == DEFAULT_NODE_BLOCKS  # the node's table, once for all
    assert sizes["HS_MAX_STACKS"] == DAEMON_EXACT_STACKS


def test_a_daemons_choices_give_way_to_the_users() -> None:
    p = settings("exact", DEFAULT_NODE_BLOCKS, max_stacks=1 << 16).probe_settings(1, launched=False)
    assert p.max_stacks == 1 << 16


def test_a_daemons_sampled_target_is_as_a_commands() -> None:
    daemon = settings("sampled", DEFAULT_NODE_BLOCKS).probe_settings(1, launched=False)
    command = settings("sampled", 0).probe_settings(1, launched=False)
    assert daemon.max_stacks == command.max_stacks == DEFAULT_CAPACITY["sampled"][1]
    assert daemon.page_ring_bytes == command.page_ring_bytes == SAMPLED_PAGE_RING_BYTES
