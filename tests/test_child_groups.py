"""``ChildGroup``: a block's children that share a first token, split where they differ. It must answer exactly as
comparing every child in insertion order did (the partial match's tie goes to the first child), and a partial
match among many children sharing a first token (a chat template's turn marker after a shared system prompt) must
read a few of the request's tokens, not a few per child."""

from __future__ import annotations

import random
from typing import Iterator, Sequence, overload

from kv_cache_manager_v2._base.hashing import Token
from kv_cache_manager_v2._observe.events import EventLog
from kv_cache_manager_v2._pages.child_groups import ChildGroup, longest_shared_prefix, shared_prefix_length
from kv_cache_manager_v2._pages.radix_tree import RadixTree

TPB = 8
TEMPLATE = (11, 12, 13, 14, 15, 16, 17)


class Child:
    def __init__(self, tokens: tuple[Token, ...]) -> None:
        self.tokens = tokens

    def __repr__(self) -> str:
        return f"Child{self.tokens}"


class CountingTokens(Sequence[Token]):
    """A request's tokens that count how often they are read."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.reads = 0

    @overload
    def __getitem__(self, index: int) -> Token: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Token]: ...
    def __getitem__(self, index: int | slice) -> Token | Sequence[Token]:
        self.reads += 1
        return self.tokens[index]

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self) -> Iterator[Token]:
        return iter(self.tokens)


def test_a_partial_match_among_children_sharing_their_first_tokens_reads_a_few_tokens_per_position() -> None:
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    children = [tree.add_child(root, (7, 7, n // 100, n % 100, 0, 0, 0, 0)) for n in range(1000)]
    query = CountingTokens([7, 7, 3, 40, 1])
    assert tree.longest_partial_child(root, query) == (children[340], 4)
    assert query.reads <= 4 * TPB, f"{query.reads} reads of the request's tokens for one partial match"
    query = CountingTokens([7, 7, 11, 99])  # no child goes on with 11: every child shares 2 tokens, the first wins
    assert tree.longest_partial_child(root, query) == (children[0], 2)
    assert query.reads <= 4 * TPB, f"{query.reads} reads of the request's tokens for one partial match"


def test_the_children_a_partial_match_may_copy_from_are_read_only_as_far_as_it_asks() -> None:
    """``partial_children`` is every child sharing a start, longest first; the matcher reads the first (which almost
    always serves) without the walk comparing the other children sharing the first tokens."""
    tree = RadixTree(TPB, 1, EventLog(False, 1))
    root = tree.root(None)
    children = [tree.add_child(root, (7, 7, n // 100, n % 100, 0, 0, 0, 0)) for n in range(1000)]
    query = CountingTokens([7, 7, 3, 40, 1])
    found = tree.partial_children(root, query)
    assert next(found) == (children[340], 4)
    assert query.reads <= 4 * TPB, f"{query.reads} reads of the request's tokens for the first child"
    rest = list(found)
    sharing_three = [(child, 3) for child in children[300:400] if child is not children[340]]
    assert rest == sharing_three + [(child, 2) for child in children[:300] + children[400:]]


def brute_longest(members: list[Child], tokens: tuple[Token, ...], limit: int) -> tuple[Child | None, int]:
    return longest_shared_prefix(members, tokens, limit)


def brute_extending(members: list[Child], tokens: tuple[Token, ...]) -> Child | None:
    for child in members:
        if len(child.tokens) > len(tokens) and child.tokens[: len(tokens)] == tokens:
            return child
    return None


def brute_shorter(members: list[Child], tokens: tuple[Token, ...]) -> list[Child]:
    return [
        child for child in members if len(child.tokens) < len(tokens) and child.tokens == tokens[: len(child.tokens)]
    ]


def brute_shared(members: list[Child], tokens: tuple[Token, ...], limit: int) -> list[tuple[Child, int]]:
    """Every member with the tokens it shares, longest first, in order on a tie (a stable sort)."""
    shared = [(child, shared_prefix_length(child.tokens, tokens, limit)) for child in members]
    return sorted(shared, key=lambda entry: entry[1], reverse=True)


def random_tokens(rng: random.Random, alphabet: int, templated: bool) -> tuple[Token, ...]:
    """At most ``TPB`` tokens starting with 0: in the template's rounds mostly a long stretch of a template then one
    or two random tokens (children sharing a run of tokens), sometimes a short stretch (a child leaving the run
    early or ending in it); else random tokens."""
    if not templated:
        return (0,) + tuple(rng.randrange(alphabet) for _ in range(rng.randrange(TPB)))
    stretch = 4 + rng.randrange(2) if rng.random() < 0.9 else rng.randrange(4)
    tail = rng.randrange(1, 3) if stretch >= 4 else rng.randrange(3)
    return (0,) + TEMPLATE[:stretch] + tuple(rng.randrange(alphabet) for _ in range(tail))


def test_child_groups_answer_as_comparing_every_child_in_order_through_adds_and_removes() -> None:
    rng = random.Random(1234)
    for alphabet, templated in ((2, False), (3, False), (5, False), (2, True), (5, True)):
        group: ChildGroup[Child] = ChildGroup(1)
        members: list[Child] = []  # insertion order
        by_tokens: dict[tuple[Token, ...], Child] = {}
        for _ in range(1500):
            tokens = random_tokens(rng, alphabet, templated)
            if tokens in by_tokens and rng.random() < 0.6 and len(members) > 1:
                child = by_tokens.pop(tokens)
                group.remove(child)
                members.remove(child)
            elif tokens not in by_tokens:
                child = Child(tokens)
                by_tokens[tokens] = child
                group.add(child)
                members.append(child)
            assert list(group) == members
            probe = random_tokens(rng, alphabet, templated)
            limit = rng.randrange(1, len(probe) + 1)  # as the tree asks: at most the request's tokens
            assert group.longest_shared(probe, limit) == brute_longest(members, probe, limit)
            assert group.first_extending(probe) is brute_extending(members, probe)
            assert group.shorter_prefixes(probe) == brute_shorter(members, probe)
            assert list(group.shared_members(probe, limit)) == brute_shared(members, probe, limit)
