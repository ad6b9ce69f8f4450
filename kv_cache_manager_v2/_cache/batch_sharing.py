"""Requests of one batch admission that have a common prefix share its pages instead of each allocating a copy.

Two requests of a batch with a common prompt prefix that the radix tree does not hold yet both match the same
blocks and, admitted one by one, each gets private pages for the rest of the prefix. Here the later request takes
the earlier one's pages for the full blocks of the common prefix that the earlier one computes in this very step
(inside its capacity), and its history starts after them. The engine writes the batch's new keys and values before
attention reads them (one forward over the batch, layer by layer; with ``FakeEngine``, step the requests in batch
order), so those blocks are computed once. Either cache may commit such a block first: the other then finds the
same page in the tree. Only models whose layer groups are all full attention share: a sliding window's stale
and scratch ranges, or an SSM state at the shared end, would need state the earlier request has not computed yet.
"""

from __future__ import annotations

from .._base.hashing import Token
from .._model.life_cycle import FullAttentionLifeCycle
from .kv_cache import CacheState
from .services import CacheServices


class BatchShare:
    """One request's planned share: blocks ``[begin, end)`` from an earlier request of the same batch; ``sources``
    are the candidates as (request position, end block), longest first (phase 2 takes the first one admitted)."""

    def __init__(self, begin: int, sources: list[tuple[int, int]]) -> None:
        self.begin = begin
        self.sources = sources
        self.end = sources[0][1]


def batch_sharing_applies(services: CacheServices) -> bool:
    """Whether this manager's caches can share uncomputed prefix pages (every layer group is full attention)."""
    return all(type(life_cycle) is FullAttentionLifeCycle for life_cycle in services.life_cycles)


class SharePlanner:
    """Finds, request by request in batch order, the earlier request whose pages cover the most of this one's
    prefix. Candidates are indexed by the tokens up to and including their first unmatched block, so a request is
    only compared with those that agree with it that far."""

    def __init__(self, tokens_per_block: int) -> None:
        self._tpb = tokens_per_block
        self._candidates: dict[tuple[object, tuple[Token, ...]], list[tuple[int, list[Token], int]]] = {}

    def plan(self, cache: CacheState, tokens: list[Token], capacity_limit: int | None) -> BatchShare | None:
        """This request's share (None: nothing to share); ``capacity_limit``: its fixed capacity, or
        None when it is counted from the reused history (``num_new_tokens``)."""
        tpb = self._tpb
        begin = cache.history_length // tpb
        if len(tokens) < (begin + 1) * tpb:
            return None
        key = (cache.reuse_scope, tuple(tokens[: (begin + 1) * tpb]))
        limit = len(tokens) // tpb if capacity_limit is None else min(len(tokens), capacity_limit) // tpb
        sources: list[tuple[int, int]] = []
        for source, source_tokens, source_blocks in self._candidates.get(key, ()):
            end = begin + 1
            last = min(limit, source_blocks)
            while end < last and tokens[end * tpb : (end + 1) * tpb] == source_tokens[end * tpb : (end + 1) * tpb]:
                end += 1
            end = min(end, last)
            if end > begin:
                sources.append((source, end))
        if not sources:
            return None
        sources.sort(key=lambda option: -option[1])
        return BatchShare(begin, sources)

    def offer(self, position: int, cache: CacheState, tokens: list[Token], capacity: int) -> None:
        """Let later requests share the full blocks request ``position`` computes up to ``capacity``."""
        tpb = self._tpb
        begin = cache.history_length // tpb
        if min(len(tokens), capacity) < (begin + 1) * tpb:
            return
        key = (cache.reuse_scope, tuple(tokens[: (begin + 1) * tpb]))
        self._candidates.setdefault(key, []).append((position, tokens, capacity // tpb))
