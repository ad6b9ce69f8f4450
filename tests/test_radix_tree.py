"""``RadixTree`` internals: partial matching compares only the children that start with the same token, and the
first-token index stays exact as blocks are added and pruned."""

from __future__ import annotations

from kv_cache_manager_v2._events import EventLog
from kv_cache_manager_v2._radix_tree import Block, RadixTree

TPB = 4


def index_of(block: Block) -> dict[int | bytes, list[bytes]]:
    return {first: [child.key for child in children] for first, children in block.children_by_first.items()}


def test_partial_match_finds_the_longest_shared_prefix_among_siblings_with_the_same_first_token() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    a = tree.add_child(root, [1, 2, 3, 4])
    b = tree.add_child(root, [1, 2, 9, 9])
    c = tree.add_child(root, [7, 2, 3, 4])
    assert tree.add_child(root, [1, 2, 3, 4]) is a  # an existing block: rebase
    assert index_of(root) == {1: [a.key, b.key], 7: [c.key]}
    assert tree.longest_partial_child(root, [1, 2, 9]) == (b, 3)
    assert tree.longest_partial_child(root, [1, 2, 3, 5]) == (a, 3)
    assert tree.longest_partial_child(root, [1, 5]) == (a, 1)  # a tie goes to the first child
    assert tree.longest_partial_child(root, [7, 2]) == (c, 2)
    assert tree.longest_partial_child(root, [2, 2, 3, 4]) == (None, 0)
    assert tree.longest_partial_child(root, []) == (None, 0)


def test_pruning_keeps_the_first_token_index_exact() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    root.users += 1  # a live cache keeps the root
    a = tree.add_child(root, [1, 2, 3, 4])
    b = tree.add_child(root, [1, 5, 6, 7])
    c = tree.add_child(root, [8, 5, 6, 7])
    tree.prune(a)
    assert index_of(root) == {1: [b.key], 8: [c.key]}
    tree.prune(c)
    assert index_of(root) == {1: [b.key]}
    assert tree.longest_partial_child(root, [8, 5]) == (None, 0)
    assert tree.longest_partial_child(root, [1, 2]) == (b, 1)
    assert tree.num_blocks == 1
