"""A block's children that share their first tokens, split by the next token where they differ once there are many.

Partial reuse compares a request's block with the children of its parent block that share a prefix with it, and
committing a block looks for siblings that its tokens start or extend. A block indexes its children by first token
(``Block.children_by_first``); each token's children form a ``ChildGroup``, which keeps those walks to one group per
position where children differ however many children share the first token.
"""

from __future__ import annotations

from typing import Final, Generic, Iterable, Iterator, Protocol, Sequence, TypeVar

from .._base.hashing import Token

# A ``ChildGroup`` of more children than this splits them by the next token at which they differ.
CHILD_GROUP_SPLIT: Final = 8


class HasTokens(Protocol):
    """What a group needs of a child (``Block``): its tokens, fixed while it is a member."""

    @property
    def tokens(self) -> tuple[Token, ...]: ...


C = TypeVar("C", bound=HasTokens)


class ChildGroup(Generic[C]):
    """The children of one block whose tokens share their first ``depth`` tokens, in insertion order (``members``).

    Once more than ``CHILD_GROUP_SPLIT`` share them, the group is split at ``split_at``, the first position where
    its members differ (or one of them ends: ``ends_here``), into one group per token there, recursively; every
    member shares the tokens before ``split_at`` (a new child that does not makes the group split again, earlier).
    A partial match, and the search for a sibling that a block's tokens extend or start with, then walk one group
    per position where children differ, instead of comparing every child that shares the first token (after a
    shared system prompt, a chat template's turn marker starts thousands of them). Memory: each child is a member
    of one group per split position on its path.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.members: dict[C, None] = {}
        self.split_at = depth
        self.by_next: dict[Token, ChildGroup[C]] | None = None  # set once split
        self.ends_here: C | None = None

    def __iter__(self) -> Iterator[C]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def first(self) -> C:
        return next(iter(self.members))

    def shares_run(self, tokens: Sequence[Token], end: int) -> bool:
        """Whether ``tokens`` has the members' tokens from ``depth`` up to ``end`` (<= ``split_at``)."""
        run = self.first().tokens
        for position in range(self.depth, end):
            if run[position] != tokens[position]:
                return False
        return True

    def add(self, child: C) -> None:
        """Add a new child (its tokens start with the group's shared ones), last in the order."""
        group = self
        while True:
            group.members[child] = None
            subgroups = group.by_next
            if subgroups is None:
                if len(group.members) > CHILD_GROUP_SPLIT:
                    group.split()
                return
            tokens = child.tokens
            position = group.split_at
            if len(tokens) < position or not group.shares_run(tokens, position):
                group.split()  # the new child differs before ``split_at``: split its members again
                return
            if len(tokens) == position:
                group.ends_here = child
                return
            subgroup = subgroups.get(tokens[position])
            if subgroup is None:
                subgroup = ChildGroup(position + 1)
                subgroups[tokens[position]] = subgroup
            group = subgroup

    def split(self) -> None:
        """(Re)build the split from the members, in their order."""
        members = list(self.members)
        first = members[0].tokens
        position = self.depth
        while all(len(member.tokens) > position and member.tokens[position] == first[position] for member in members):
            position += 1
        self.split_at = position
        self.ends_here = None
        subgroups: dict[Token, ChildGroup[C]] = {}
        self.by_next = subgroups
        for member in members:
            if len(member.tokens) == position:
                self.ends_here = member
                continue
            subgroup = subgroups.get(member.tokens[position])
            if subgroup is None:
                subgroup = ChildGroup(position + 1)
                subgroups[member.tokens[position]] = subgroup
            subgroup.add(member)

    def remove(self, child: C) -> None:
        """Remove a member; the caller drops the group when it held only ``child``."""
        group = self
        while True:
            del group.members[child]
            subgroups = group.by_next
            if subgroups is None:
                return
            if group.ends_here is child:
                group.ends_here = None
                return
            token = child.tokens[group.split_at]
            subgroup = subgroups[token]
            if len(subgroup.members) == 1:
                del subgroups[token]
                return
            group = subgroup

    def run_shared(self, tokens: Sequence[Token], limit: int) -> int:
        """How many of ``tokens[:limit]`` the run every member shares (up to ``split_at``) starts with; short of
        ``split_at`` (or at ``limit``), that is exactly what each member shares with ``tokens``."""
        run = self.first().tokens
        shared = self.depth
        bound = min(limit, self.split_at)
        while shared < bound and run[shared] == tokens[shared]:
            shared += 1
        return shared

    def longest_shared(self, tokens: Sequence[Token], limit: int) -> tuple[C | None, int]:
        """The member sharing the longest prefix with ``tokens[:limit]`` (which starts with the group's shared
        tokens), the first in order on a tie, and that length."""
        group = self
        while True:
            subgroups = group.by_next
            if subgroups is None:
                return longest_shared_prefix(group.members, tokens, limit)
            position = group.split_at
            shared = group.run_shared(tokens, limit)
            if shared < position or shared == limit:
                return group.first(), shared  # every member shares exactly that much
            subgroup = subgroups.get(tokens[position])
            if subgroup is None:
                return group.first(), position
            group = subgroup

    def shared_members(self, tokens: Sequence[Token], limit: int) -> Iterator[tuple[C, int]]:
        """Every member with how many of ``tokens[:limit]`` it shares (``tokens`` starts with the group's shared
        tokens), longest first, in order on a tie, produced as far as it is read: the group ``longest_shared``
        stops in first, then, one split position at a time back up, the members that differ from ``tokens`` there
        (each shares exactly that position's tokens)."""
        path: list[tuple[ChildGroup[C], int, ChildGroup[C] | None]] = []  # (group, split_at, the group below it)
        deepest: list[tuple[C, int]] = []  # an unsplit group's members (at most CHILD_GROUP_SPLIT), sorted
        uniform: ChildGroup[C] | None = None  # a group whose every member shares ``uniform_shared`` tokens
        uniform_shared = 0
        group = self
        while True:
            subgroups = group.by_next
            if subgroups is None:
                deepest = [(member, shared_prefix_length(member.tokens, tokens, limit)) for member in group.members]
                deepest.sort(key=shared_length, reverse=True)
                break
            position = group.split_at
            shared = group.run_shared(tokens, limit)
            if shared < position or shared == limit:
                uniform = group
                uniform_shared = shared
                break
            below = subgroups.get(tokens[position])
            path.append((group, position, below))
            if below is None:
                break
            group = below
        yield from deepest
        if uniform is not None:
            for member in uniform.members:
                yield member, uniform_shared
        for group, position, below in reversed(path):
            for member in group.members:
                if below is None or member not in below.members:
                    yield member, position

    def first_extending(self, tokens: tuple[Token, ...]) -> C | None:
        """The first member whose tokens start with ``tokens`` and run longer."""
        size = len(tokens)
        group = self
        while True:
            subgroups = group.by_next
            if subgroups is None:
                for child in group.members:
                    if len(child.tokens) > size and child.tokens[:size] == tokens:
                        return child
                return None
            position = group.split_at
            if not group.shares_run(tokens, min(size, position)):
                return None
            if size <= position:
                for child in group.members:  # all but ``ends_here`` run past ``split_at``
                    if len(child.tokens) > size:
                        return child
                return None
            subgroup = subgroups.get(tokens[position])
            if subgroup is None:
                return None
            group = subgroup

    def shorter_prefixes(self, tokens: tuple[Token, ...]) -> list[C]:
        """The members whose tokens ``tokens`` starts with and runs past, in order."""
        size = len(tokens)
        found: list[C] = []
        group = self
        while True:
            subgroups = group.by_next
            if subgroups is None:
                for child in group.members:
                    length = len(child.tokens)
                    if length < size and child.tokens == tokens[:length]:
                        found.append(child)
                break
            position = group.split_at
            if position >= size or not group.shares_run(tokens, position):
                break
            if group.ends_here is not None:
                found.append(group.ends_here)
            subgroup = subgroups.get(tokens[position])
            if subgroup is None:
                break
            group = subgroup
        if len(found) > 1:  # from several depths: back into the group's order
            wanted = set(found)
            found = [child for child in self.members if child in wanted]
        return found


def longest_shared_prefix(candidates: Iterable[C], tokens: Sequence[Token], limit: int) -> tuple[C | None, int]:
    """The candidate sharing the longest prefix with ``tokens[:limit]`` (the first on a tie) and that length;
    (None, 0) when none shares a token."""
    best: C | None = None
    best_length = 0
    for candidate in candidates:
        length = shared_prefix_length(candidate.tokens, tokens, limit)
        if length > best_length:
            best = candidate
            best_length = length
    return best, best_length


def shared_prefix_length(theirs: Sequence[Token], tokens: Sequence[Token], limit: int) -> int:
    """How many of ``tokens[:limit]`` ``theirs`` starts with."""
    length = 0
    bound = min(limit, len(theirs))
    while length < bound and theirs[length] == tokens[length]:
        length += 1
    return length


def shared_length(entry: tuple[C, int]) -> int:
    """Sort key of a (child, tokens shared) pair."""
    return entry[1]
