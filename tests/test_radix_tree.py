"""``RadixTree`` internals: once a block has many children, partial matching compares only those that start with
the same token, and that first-token index stays exact as blocks are added and pruned."""

from __future__ import annotations

from kv_cache_manager_v2._observe.events import EventLog
from kv_cache_manager_v2._base.hashing import block_key
from kv_cache_manager_v2._pages.page import Block
from kv_cache_manager_v2._pages.radix_tree import PARTIAL_INDEX_MIN_CHILDREN, RadixTree

TPB = 4


def index_of(block: Block) -> dict[int | bytes, list[bytes]] | None:
    index = block.children_by_first
    if index is None:
        return None
    return {first: [child.key for child in children] for first, children in index.items()}


def fillers(tree: RadixTree, parent: Block, count: int) -> list[Block]:
    """``count`` children whose first tokens (100, 101, ...) nothing below asks for."""
    return [tree.add_child(parent, (100 + n, 0, 0, 0)) for n in range(count)]


def test_few_children_have_no_index_and_a_partial_match_compares_them_all() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    a = tree.add_child(root, (1, 2, 3, 4))
    b = tree.add_child(root, (1, 2, 9, 9))
    assert root.children_by_first is None
    assert tree.longest_partial_child(root, [1, 2, 9]) == (b, 3)
    assert tree.longest_partial_child(root, [1, 5]) == (a, 1)  # a tie goes to the first child
    assert tree.longest_partial_child(root, [2]) == (None, 0)


def test_many_children_are_indexed_by_first_token_with_the_same_answers() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    a = tree.add_child(root, (1, 2, 3, 4))
    b = tree.add_child(root, (1, 2, 9, 9))
    others = fillers(tree, root, PARTIAL_INDEX_MIN_CHILDREN - 3)
    assert root.children_by_first is None
    c = tree.add_child(root, (7, 2, 3, 4))  # the PARTIAL_INDEX_MIN_CHILDREN-th child builds the index
    assert tree.add_child(root, (1, 2, 3, 4)) is a  # an existing block: rebase, nothing indexed twice
    expected = {1: [a.key, b.key], **{100 + n: [block.key] for n, block in enumerate(others)}, 7: [c.key]}
    assert index_of(root) == expected
    d = tree.add_child(root, (1, 2, 3, 8))  # later children join the index
    assert index_of(root) == {**expected, 1: [a.key, b.key, d.key]}
    assert tree.longest_partial_child(root, [1, 2, 9]) == (b, 3)
    assert tree.longest_partial_child(root, [1, 2, 3, 5]) == (a, 3)
    assert tree.longest_partial_child(root, [1, 2, 3, 8]) == (d, 4)
    assert tree.longest_partial_child(root, [1, 5]) == (a, 1)
    assert tree.longest_partial_child(root, [7, 2]) == (c, 2)
    assert tree.longest_partial_child(root, [2, 2, 3, 4]) == (None, 0)
    assert tree.longest_partial_child(root, []) == (None, 0)


def test_pruning_keeps_the_first_token_index_exact() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    root.users += 1  # a live cache keeps the root
    a = tree.add_child(root, (1, 2, 3, 4))
    b = tree.add_child(root, (1, 5, 6, 7))
    c = tree.add_child(root, (8, 5, 6, 7))
    others = fillers(tree, root, PARTIAL_INDEX_MIN_CHILDREN - 3)
    assert root.children_by_first is not None
    tree.prune(a)
    tree.prune(c)
    assert index_of(root) == {1: [b.key], **{100 + n: [block.key] for n, block in enumerate(others)}}
    assert tree.longest_partial_child(root, [8, 5]) == (None, 0)
    assert tree.longest_partial_child(root, [1, 2]) == (b, 1)
    assert tree.num_blocks == PARTIAL_INDEX_MIN_CHILDREN - 2


# Ints hash to themselves modulo this Mersenne prime, so these token tuples share one ``hash()``: a child's slot
# can be taken by other tokens (an attacker can find such prompts; the tree must keep them apart).
_MODULUS = (1 << 61) - 1


def test_children_whose_token_hashes_collide_stay_apart_and_are_found() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    root.users += 1  # a live cache keeps the root
    a, b, c = ((1, 2, 3, 5 + n * _MODULUS) for n in range(3))
    assert hash(a) == hash(b) == hash(c)
    block_a = tree.add_child(root, a)
    block_b = tree.add_child(root, b)
    block_c = tree.add_child(root, c)
    assert len({id(block_a), id(block_b), id(block_c)}) == 3 and tree.num_blocks == 3
    assert len({block_a.key, block_b.key, block_c.key}) == 3  # the SHA-256 keys differ as the tokens do
    assert root.collided and len(root.children()) == 3
    assert [tree.child(root, tokens) for tokens in (a, b, c)] == [block_a, block_b, block_c]
    assert tree.child(root, (1, 2, 3, 5 + 3 * _MODULUS)) is None  # same slot, no such child
    assert tree.add_child(root, b) is block_b  # a rebase onto the colliding child, not a second copy
    tree.prune(block_a)  # the child in the plain slot goes: the others are still found
    assert tree.child(root, a) is None
    assert tree.child(root, b) is block_b and tree.child(root, c) is block_c
    assert tree.add_child(root, c) is block_c and tree.num_blocks == 2
    again = tree.add_child(root, a)  # the plain slot is free again
    assert again is not block_a and tree.child(root, a) is again and tree.num_blocks == 3
    tree.prune(block_b)
    tree.prune(block_c)
    tree.prune(again)
    assert not root.has_children() and tree.num_blocks == 0


def test_keys_are_computed_on_first_use_down_a_chain_longer_than_the_recursion_limit() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    chain = [root]
    for n in range(3000):
        chain.append(tree.add_child(chain[-1], (n, n + 1, n + 2, n + 3)))
    assert all(block.known_key == b"" for block in chain[1:])  # adding computed none
    assert tree.child(chain[-2], chain[-1].tokens) is chain[-1]
    assert chain[-1].known_key == b""  # nor did a lookup
    expected = root.key
    keys = []
    for block in chain[1:]:
        expected = block_key(expected, block.tokens)
        keys.append(expected)
    assert chain[-1].key == keys[-1]  # the deepest block's key fills in its ancestors' on the way
    assert [block.known_key for block in chain[1:]] == keys
