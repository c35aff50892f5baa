"""The tree Massif writes for a detailed snapshot: sorted by size, with the children below the threshold
merged into one node at every level (coregrind/m_xtree.c).

Pure Python: no bcc, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.model.tree import Tree, TreeNode


@dataclass(frozen=True)
class MassifNode:
    """A node as Massif writes it: `n<len(children)>: <bytes> <label>`."""

    bytes: int
    label: str
    children: tuple[MassifNode, ...] = ()


def threshold_text(n_places: int, threshold: float) -> str:
    """Massif's label for the children that are each below the threshold, aggregated into one node."""
    places = "place," if n_places == 1 else "places, all"
    return f"in {n_places} {places} below massif's threshold ({threshold:.2f}%)"


def significance_size(total: int, extra_B: int, stacks_B: int, threshold: float) -> int:
    """The byte size a node needs to be shown (m_xtree.c): a percentage of the snapshot's whole total
    (useful + extra + stacks). When nothing is allocated, every node is insignificant unless threshold=0."""
    if total == 0 and threshold != 0:
        return 1
    return int((total + extra_B + stacks_B) * threshold / 100)


def _sort_key(item: tuple[int, int, str]) -> tuple[int, int, str]:
    nbytes, address, label = item
    # Bigger first; on a tie the lower address first (the aggregated node counts as address 0), as Massif.
    return (-nbytes, address, label)


def _massif_children(level: Mapping[str, TreeNode], sig: int, threshold: float) -> tuple[MassifNode, ...]:
    shown: list[tuple[tuple[int, int, str], MassifNode]] = []
    insig_bytes = 0
    insig_count = 0
    for key, node in level.items():
        if node.bytes < sig:
            insig_bytes += node.bytes
            insig_count += 1
            continue
        mn = MassifNode(node.bytes, key, _massif_children(node.children, sig, threshold))
        shown.append(((node.bytes, node.frame.address, key), mn))
    if insig_count:
        label = threshold_text(insig_count, threshold)
        shown.append(((insig_bytes, 0, ""), MassifNode(insig_bytes, label)))
    shown.sort(key=lambda pair: _sort_key(pair[0]))
    return tuple(mn for _, mn in shown)


def massif_tree(tree: Tree, *, threshold: float, extra_B: int = 0, stacks_B: int = 0) -> MassifNode:
    """The tree Massif writes for a detailed snapshot: children sorted by size, and at every level the
    children below the threshold (percent of useful + extra + stacks bytes) merged into one node,
    `in N places, all below massif's threshold (T%)`. threshold=0 keeps everything."""
    if not 0.0 <= threshold <= 100.0:
        raise ValueError(f"threshold must be between 0.0 and 100.0, got {threshold}")
    sig = significance_size(tree.total, extra_B, stacks_B, threshold)
    return MassifNode(tree.total, tree.root_label, _massif_children(tree.children, sig, threshold))


