"""``CacheState``: one request's cache, everything but the handle the engine holds (``KVCache``, beside the manager);
``open_cache`` makes one from a prefix match, and closing releases it.

Lengths: ``num_committed_tokens <= history_length <= capacity``. The pages themselves live in one state object per
layer group (``attention_state.py``, ``ssm_state.py``); the cache keeps the lengths, the status, its committed
blocks, and orders the groups' steps so that a failing call changes nothing. While ACTIVE every entry outside the
stale range is locked on the GPU; stale entries are private pages kept held until their block is committed. While
SUSPENDED every entry is held. The class is written in layers: ``CacheView`` (state, reads), ``SuspendingCache``
(suspend, placement hints), ``ResizingCache`` (resume, resize), ``CommittingCache`` (commit), this one (opening, setters,
statistics, close).
"""

from __future__ import annotations

from typing import SupportsIndex

from .._base.hashing import ReuseScope, Token
from .._base.types import CudaStream, OutOfPagesError
from .._base.validation import as_int, as_stream_handle
from .._observe.stats_delta import KVCacheStatsDelta
from .._pages.page import Block
from .._pages.lru_order import LruOrder
from .._pages.partial_siblings import absorb_shorter_siblings
from .._pages.prefix_match import Match
from .._pages.priority import PriorityCallback
from .attention_state import release_entries
from .cache_commit import CommittingCache
from .cache_view import KVCacheStatus as KVCacheStatus
from .lent_rows import forget_borrowed, lend_shared, recall_beyond
from .registry import CacheRegistry
from .services import CacheServices


def open_cache(
    services: CacheServices,
    registry: CacheRegistry,
    scope: ReuseScope | None,
    tokens: list[Token],
    cache_id: int,
    priority_callback: PriorityCallback | None,
    order: LruOrder | None = None,
) -> CacheState:
    """A suspended cache holding the longest reusable prefix of ``tokens``; ``order`` first remembers where the
    matched pages stand in their eviction lists (a batch admission may have to put them back)."""
    registry.next_id = cache_id + 1
    match = services.match_fetching_remote(scope, tokens)
    if match.root is None:
        match.root = services.tree.root(scope)
    if order is not None:
        sources = match.blocks + match.partial_blocks()
        for block in sources:
            for page in block.pages:
                if page is not None:
                    order.remember(page)
    return CacheState(services, registry, match, tokens, cache_id, priority_callback)


class CacheState(CommittingCache):
    """One request's KV cache, made by ``KVCacheManager.create_kv_cache``: its blocks' pages in every layer group.

    The manager keeps it (among its open caches) and the engine holds it through a ``KVCache`` handle, which
    closes it when dropped.

    It starts SUSPENDED; ``resume`` locks its pages on the GPU, ``resize`` sets how many tokens it can hold
    (``capacity``) and how many of them are history, ``commit`` makes finished tokens reusable by later requests,
    ``suspend`` lets its pages move to colder tiers, ``close`` ends it. Lengths always satisfy
    ``num_committed_tokens <= history_length <= capacity``.
    """

    def __init__(
        self,
        services: CacheServices,
        registry: CacheRegistry,
        match: Match,
        tokens: list[Token],
        cache_id: int,
        priority_callback: PriorityCallback | None,
    ) -> None:
        super().__init__(services, match, tokens, cache_id, priority_callback)
        self._registry: CacheRegistry = registry
        registry.live[cache_id] = self

    def share_prefix(self, source: CacheState, begin: int, end: int, tokens: list[Token]) -> int:
        """Batch admission (suspended, before ``admit``): hold ``source``'s private pages of blocks ``[begin, end)``,
        which that admitted request of the same batch computes in this step; returns where sharing stopped (the
        first block ``source`` has no private page for). ``tokens``: this cache's input tokens, which those pages
        hold and its commits there must repeat. The rows are lent (``lent_rows.py``): recalled into this cache's
        history should their writer skip the step that writes them."""
        stop = end
        for ordinal in range(begin, end):
            for source_group in source.attention:
                entries = source_group.entries
                page = entries[ordinal] if ordinal < len(entries) else None
                if page is None or page.block is not None:
                    stop = ordinal
                    break
            if stop < end:
                break
        for group, source_group in zip(self.attention, source.attention):
            for ordinal in range(begin, stop):
                page = source_group.entries[ordinal]
                assert page is not None
                group.share_entry(ordinal, page)
        tpb = self._tpb
        self._shared_begin, self._shared_end = begin * tpb, stop * tpb
        self._shared_tokens = tokens[begin * tpb : stop * tpb]
        if stop > begin:  # the admission then starts the history at the end of the shared blocks
            lend_shared(source, self, begin * tpb, stop * tpb, stop * tpb)
        return stop

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """See ``KVCache.commit_pending_stats``."""
        self.lookup_pending: bool = False
        self._services.pending_stats.discard(self.id)
        pending = self.request_stats
        if pending is None:
            return KVCacheStatsDelta()
        self.request_stats: KVCacheStatsDelta | None = KVCacheStatsDelta()
        total = self._services.committed_stats
        total.alloc_total_blocks += pending.alloc_total_blocks
        total.alloc_new_blocks += pending.alloc_new_blocks
        total.reused_blocks += pending.reused_blocks
        total.missed_blocks += pending.missed_blocks
        return pending

    def discard_pending_stats(self) -> None:
        """See ``KVCache.discard_pending_stats``."""
        self.lookup_pending = False
        self._services.pending_stats.discard(self.id)
        if self.request_stats is not None:
            self.request_stats = KVCacheStatsDelta()

    @property
    def capacity(self) -> int:
        """See ``KVCache.capacity``; the setter refuses while scratch reuse is on (``resize`` takes both lengths)."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: SupportsIndex) -> None:
        if self._scratch_enabled:
            raise ValueError("the capacity setter is refused while SWA scratch reuse is on; use resize(capacity, history)")
        if not self.resize(value):
            raise self._setter_refused(f"capacity {int(value)}")

    @property
    def history_length(self) -> int:
        """See ``KVCache.history_length``."""
        return self._history

    @history_length.setter
    def history_length(self, value: SupportsIndex) -> None:
        history = as_int(value, "history_length")  # resize(capacity, None) would keep the history: refuse None
        if not self.resize(self._capacity, history):
            raise self._setter_refused(f"history_length {history}")

    def _setter_refused(self, setting: str) -> OutOfPagesError:
        """The error of a length setter whose ``resize`` answered False, in the words of its refusal (memory, the
        split across pool groups or the block limit: each asks for something else)."""
        refusal = self.last_refusal
        assert refusal is not None  # every False of resize records its refusal first
        return OutOfPagesError(
            f"cache {self.id}: {setting} refused: {refusal.detail} (KVCache.last_refusal holds the figures)"
        )

    @property
    def cuda_stream(self) -> CudaStream:
        """See ``KVCache.cuda_stream``."""
        return self._cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: SupportsIndex) -> None:
        self._check_open()
        stream = CudaStream(as_stream_handle(value, "cuda_stream"))
        if self._status == KVCacheStatus.ACTIVE:
            self.resume(stream)
        else:
            self._cuda_stream = stream


    def close(self) -> None:
        """See ``KVCache.close``."""
        if self._status == KVCacheStatus.CLOSED:
            return
        self._release(observed=True)

    def discard(self) -> None:
        """Close a cache that a batch admission created but did not hand out, leaving no observed length."""
        self._release(observed=False)

    def _release(self, observed: bool) -> None:
        services = self._services
        tree = services.tree
        recall_beyond(self, self._history)  # its step will not run: what it lent and has not written goes back
        forget_borrowed(self)
        if self._status == KVCacheStatus.ACTIVE:
            self._unlock_all(closing=True)
        for group in reversed(self.attention):  # the deepest block's pages, last group first (as ``hold_adopted``)
            group.release_cow_source()
        for ssm in self.ssm:
            ssm.release_snapshot_source()
        partial: Block | None = None
        if self._tail:
            partial = self.tail_block()
            if self._snapshots_tail():
                for ssm in self.ssm:
                    ssm.hand_over_live_state(partial, tree)
        for ssm in self.ssm:
            ssm.release_live_state()
        release_entries(self.attention, self._history, partial, len(self._blocks), len(self._tail))
        if partial is not None and tree.merges_partial_siblings:
            absorb_shorter_siblings(services.store, partial)
        self._root.users -= 1
        for block in self._blocks:
            block.users -= 1
        # Pruning the deepest block walks up through every ancestor it empties, the scope's root included.
        tree.prune(partial if partial is not None else (self._blocks[-1] if self._blocks else self._root))
        self._blocks = []
        self.release_input()  # a closed handle keeps no prompt alive
        self._status = KVCacheStatus.CLOSED
        self.note_held([])  # closed with a hold unreleased (its handle and hold dropped together): no longer held
        for any_kind in self.groups:
            any_kind.clear_buffer()
        del self._registry.live[self.id]
        services.pending_stats.discard(self.id)
        if observed:
            if self.id in self._registry.stats_excluded:
                self._registry.stats_excluded.discard(self.id)
            else:
                self._registry.observed.append(self._capacity, self._history)
            # Not for ``discard``: its batch admission still has claims out, and runs the check once it is done.
            services.after_call()
