"""``CommittingCache``: a cache's commits, which make finished blocks reusable (the radix tree gets them) and move the
history (stale pages are released, SSM snapshots taken). A decode step inside the last block takes an O(1) path."""

from __future__ import annotations

from typing import Sequence, SupportsIndex

from .._base.hashing import Token, TokenSequence, check_tokens
from .._base.types import DEFAULT_BEAM_INDEX, DEFAULT_PRIORITY
from .._model.life_cycle import NEVER
from .._base.validation import as_int, as_list
from .._pages.page import Block, BlockTokens
from .._pages.partial_siblings import absorb_shorter_siblings, longer_sibling
from .cache_resize import ResizingCache
from .cache_view import KVCacheStatus
from .._base.wording import counted


class CommittingCache(ResizingCache):
    """The commit layer of ``CacheState``."""

    def commit(
        self,
        accepted_input_tokens: TokenSequence,
        beam_search_indices: Sequence[SupportsIndex] | None = None,
        is_end: bool = False,
        save_ssm_snapshot: bool = False,
    ) -> None:
        """See ``KVCache.commit``. Plain-int tokens that complete no block and leave every stale range as it is (a decode
        step inside the last block) take an O(1) path: they join the trailing partial block and move the lengths,
        nothing else."""
        if (
            type(accepted_input_tokens) is list
            and beam_search_indices is None
            and is_end is False
            and save_ssm_snapshot is False
            and self._status is KVCacheStatus.ACTIVE
            and not self._committing_stopped
            and not self._scratch_enabled
        ):
            tail = self._tail
            count = len(accepted_input_tokens)
            committed = self._committed + count
            if (
                committed <= self._capacity
                and len(tail) + count < self._tpb
                and committed < self._steady_below
                and committed > self._mid_block_snapshot_end
                and self._committed >= self._shared_end
                and committed < self._input_end
            ):
                for token in accepted_input_tokens:
                    if type(token) is not int:
                        break
                else:
                    tail.extend(accepted_input_tokens)
                    self._committed = committed
                    if committed > self._history:
                        self._history = committed
                    self._services.after_call()
                    return
        self._commit_checked(accepted_input_tokens, beam_search_indices, is_end, save_ssm_snapshot)

    def _commit_checked(
        self,
        accepted_input_tokens: TokenSequence,
        beam_search_indices: Sequence[SupportsIndex] | None,
        is_end: bool,
        save_ssm_snapshot: bool,
    ) -> None:
        self._check_active("commit")
        if self._committing_stopped:
            raise ValueError(f"commit after stop_committing on cache {self.id}")
        if not isinstance(is_end, bool):
            raise TypeError(f"is_end must be a bool, got {is_end!r}")
        if not isinstance(save_ssm_snapshot, bool):
            raise TypeError(f"save_ssm_snapshot must be a bool, got {save_ssm_snapshot!r}")
        if beam_search_indices is not None:
            for position, beam in enumerate(as_list(beam_search_indices, "beam_search_indices")):
                index = as_int(beam, f"beam_search_indices[{position}]")
                if index != DEFAULT_BEAM_INDEX:
                    raise ValueError(f"beam_search_indices[{position}] = {index}: beam width is 1")
        new_tokens = check_tokens(accepted_input_tokens, "accepted_input_tokens")
        if self._committed + len(new_tokens) > self._capacity:
            done = self._committed
            raise ValueError(
                f"accepted_input_tokens: committing {counted(len(new_tokens), 'token')} would exceed capacity "
                f"{self._capacity} ({done} already committed, a reused prefix included); commit appends after "
                f"num_committed_tokens: pass only the tokens after them (tokens[{done}:end]), and resize first where end "
                f"is past capacity"
            )
        self._check_shared_tokens(new_tokens)
        self._check_scratch_history(max(self._history, self._committed + len(new_tokens)))
        if save_ssm_snapshot:
            self._check_snapshot_request(self._committed + len(new_tokens), "save_ssm_snapshot")
        services = self._services
        tpb = services.tokens_per_block
        tail = self._tail
        tail.extend(new_tokens)
        self._committed += len(new_tokens)
        if self._committed >= self._input_end:
            self.release_input()
        full = len(tail) - len(tail) % tpb
        completed = full > 0
        if completed:
            stale = [group.life_cycle.stale(self._history) for group in self.groups]  # the same for every block
            for begin in range(0, full, tpb):
                self._commit_block(tuple(tail[begin : begin + tpb]), stale)
            del tail[:full]
        if completed and self._takes_snapshot():
            block = self._blocks[-1]
            for ssm in self.ssm:
                ssm.snapshot_into(block, services.tree)
        elif self._takes_mid_block_snapshot():
            self._snapshot_mid_block()
        if save_ssm_snapshot:
            self._save_snapshot()
        if self._committed > self._history:
            released = self._release_newly_stale(self._committed, self.num_blocks)
            self._commit_release(released)
            self._history = self._committed
            self._note_history()
            if self._history == self._capacity:
                for group in self.attention:
                    group.set_scratch((0, 0), DEFAULT_PRIORITY)
        services.store.flush(self._cuda_stream)
        if is_end:
            self.stop_committing(publish_tail=False)  # the close that follows moves the tail's pages, no copies
        services.after_call()

    def release_input(self) -> None:
        """Drop the copy of the input tokens (``known_tokens``): the commits cover them, or the cache closes. The
        commits then answer for those rows, the copy being either the same tokens or a prompt they parted from."""
        self._input_rest = []
        self._input_end = NEVER

    @property
    def kept_input_tokens(self) -> int:
        """How many input tokens this cache keeps a copy of (``_introspection.kept_input_tokens``)."""
        return len(self._input_rest)

    def stop_committing(self, save_last_ssm_snapshot: bool = False, publish_tail: bool = True) -> None:
        """See ``KVCache.stop_committing``. ``publish_tail``: copy a trailing partial block that ends on a snapshot
        point into the tree now (``_publish_snapshot_tail``); ``commit(is_end=True)`` leaves it to the close."""
        self._check_open()
        if not isinstance(save_last_ssm_snapshot, bool):
            raise TypeError(f"save_last_ssm_snapshot must be a bool, got {save_last_ssm_snapshot!r}")
        if save_last_ssm_snapshot:
            self._check_snapshot_request(self._committed, "save_last_ssm_snapshot")
            self._save_snapshot()
            self._services.store.flush(self._cuda_stream)
        if self._committing_stopped:
            return
        self._committing_stopped = True
        if publish_tail and self._snapshots_tail():
            self._publish_snapshot_tail()
            self._services.store.flush(self._cuda_stream)
        for group in self.attention:
            group.drop_uncommitted_stale(self._history, len(self._blocks))
        if self._tail and self._services.tree.merges_partial_siblings:
            self._publish_partial_tail()
        self._services.after_call()

    def committed_prefix_key(self, end: int, tpb: int) -> tuple[int, bytes]:
        """``(count, key)``: the chained block key (``hashing.block_key`` from the scope's root) of this cache's first
        ``count`` committed full blocks, ``count`` as many as fit in ``end`` tokens (0 and the root's key where none
        do, or ``tpb`` is not the tree's), read from the tree's blocks, which keep a key once computed: a handoff
        hashes only the tokens past them (``plan.prompt_key``)."""
        count = min(len(self._blocks), end // tpb) if tpb == self._tpb else 0
        return count, (self._blocks[count - 1] if count else self._root).key

    # ------------------------------------------------------------------------------------------- internals
    def _commit_block(self, block_tokens: BlockTokens, stale: list[tuple[int, int]]) -> None:
        """Add the next block to the tree; ``stale``: each group's stale range at the history."""
        tree = self._services.tree
        ordinal = len(self._blocks)
        parent = self._blocks[-1] if self._blocks else self._root
        block = tree.add_child(parent, block_tokens)
        block.users += 1
        self._blocks.append(block)
        for group in self.attention:
            group.commit_entry(block, ordinal, stale[group.id], tree)
        if tree.merges_partial_siblings:
            absorb_shorter_siblings(self._services.store, block)

    def tail_block(self) -> Block:
        """The tree block the trailing partial block's pages go to: with ``merges_partial_siblings`` a sibling
        extending its tokens when there is one (``partial_siblings.py``), else the partial block itself."""
        tree = self._services.tree
        parent = self._blocks[-1] if self._blocks else self._root
        tail = tuple(self._tail)
        longer = longer_sibling(parent, tail) if tree.merges_partial_siblings else None
        return longer if longer is not None else tree.add_child(parent, tail)

    def _publish_partial_tail(self) -> None:
        """Partial reuse without SSM layers: ``stop_committing`` publishes the trailing partial block at once, as
        ``close`` would (the cache keeps its pages; a later request copies their committed rows)."""
        tree = self._services.tree
        block = self.tail_block()
        for group in self.attention:
            group.publish_partial(block, len(self._blocks), len(self._tail))
        absorb_shorter_siblings(self._services.store, block)
        tree.prune(block)

    def _check_shared_tokens(self, new_tokens: Sequence[Token]) -> None:
        """A commit reaching into the blocks another request of the batch computes for this cache must put there the
        tokens those pages hold: any other token would publish them under its key, serving a later prompt K/V
        computed for different tokens. Refused before anything changes."""
        begin = self._committed
        for position in range(max(begin, self._shared_begin), min(self._shared_end, begin + len(new_tokens))):
            expected = self._shared_tokens[position - self._shared_begin]
            if new_tokens[position - begin] != expected:
                raise ValueError(
                    f"accepted_input_tokens[{position - begin}] is {new_tokens[position - begin]!r}, but position "
                    f"{position} of cache {self.id} holds the K/V another request of its batch computes for "
                    f"{expected!r} (its input token there): commit from num_committed_tokens ({begin}), which "
                    f"stays behind history_length ({self._history}) over such a shared prefix"
                )

    def _check_snapshot_request(self, committed: int, argument: str) -> None:
        """A snapshot asked for at ``committed`` tokens copies the live SSM state, which holds every token computed
        (``capacity``): refused (nothing changed) unless the two agree."""
        if self._services.has_live_states and committed != self._capacity:
            raise ValueError(
                f"{argument}=True needs the committed tokens to reach the computed ones (capacity {self._capacity}), "
                f"got {committed}: the live SSM state is the state after all of them"
            )

    def _save_snapshot(self) -> None:
        """The snapshot the engine asked for at the committed length: on the last committed block when it ends
        there, else on a partial tree block holding the trailing tokens (reused whole by a request that starts
        with them, with or without partial reuse). Without partial reuse a short block is reused with its own
        rows only, so it gets a copy of each attention group's rows too (as a turn's end does). Without SSM
        layers there is no state to save."""
        if not self._services.has_live_states or self._committed == 0:
            return
        if self._tail:
            if self._services.settings.partial_reuse:
                self._snapshot_mid_block(saved=True)
            else:
                self._publish_snapshot_tail(saved=True)
            return
        tree = self._services.tree
        for ssm in self.ssm:
            ssm.snapshot_into(self._blocks[-1], tree)

    def _takes_snapshot(self) -> bool:
        """Whether the commit just made ends where SSM snapshots are taken: a block boundary that is also the end of
        the computed chunk (``capacity``) and a snapshot point (``_is_snapshot_point``). The live state holds every
        token the engine computed, so a commit that stops short of them would snapshot a state from the future."""
        services = self._services
        if not services.has_live_states or self._tail or self._committed != self._capacity:
            return False
        return self._is_snapshot_point(self._committed)

    def _takes_mid_block_snapshot(self) -> bool:
        """Whether the commit just made ends inside a block (partial reuse only), at the end of the computed chunk,
        at a declared snapshot point or at the end of a prefill chunk (with ``snapshot_prefill_chunks``). Every
        commit's snapshot (``snapshot_every_commit``) waits for ``stop_committing`` or the close inside a block
        (``_snapshots_tail``): a decode step would otherwise copy the state each token."""
        committed = self._committed
        if not self._tail or committed != self._capacity or committed > self._mid_block_snapshot_end:
            return False
        if committed in self._snapshot_points:
            return True
        return self._services.settings.snapshot_prefill_chunks and committed <= self._prompt_length

    def _snapshot_mid_block(self, saved: bool = False) -> None:
        """Snapshot the live state into a partial tree block holding the trailing tokens: a leaf beside the block
        this cache goes on to fill, which a later request diverging after this point matches (its attention rows
        come from a sibling sharing them). ``saved``: the engine asked for it, which makes it a reuse point for
        longer requests without partial reuse too. Pruned again when no tier had room for the snapshot."""
        tree = self._services.tree
        parent = self._blocks[-1] if self._blocks else self._root
        ending = tree.add_child(parent, tuple(self._tail))
        for ssm in self.ssm:
            ssm.snapshot_into(ending, tree)
        if saved and all(ending.pages[ssm.id] is not None for ssm in self.ssm):
            ending.saved_snapshot = True
        tree.prune(ending)

    def _publish_snapshot_tail(self, saved: bool = False) -> None:
        """Committing stopped inside a block, where the live state is a snapshot point: the trailing partial block
        enters the tree now, with a copy of the live state and of each attention group's rows (once per request,
        not per commit), so that a plan of the turn's end (``plan_committed_block_drop``) and requests repeating
        exactly these tokens see it while this cache lives on. Closing then finds the block already filled.
        ``saved``: the engine asked for this snapshot (``_save_snapshot``), a reuse point for longer requests."""
        tree = self._services.tree
        parent = self._blocks[-1] if self._blocks else self._root
        ending = tree.add_child(parent, tuple(self._tail))
        ending.users += 1  # a copy that evicts another one's page must not prune the block under it
        for ssm in self.ssm:
            ssm.snapshot_into(ending, tree)
        for group in self.attention:
            group.copy_tail_into(ending, len(self._blocks), tree)
        ending.users -= 1
        if saved and all(ending.pages[ssm.id] is not None for ssm in self.ssm):
            ending.saved_snapshot = True
        tree.prune(ending)

    def _snapshots_tail(self) -> bool:
        """Whether stopping the commits (or closing) gives the trailing partial block a snapshot of the live state:
        the commits end inside a block, at the end of the computed chunk (so the live state is the state after
        exactly the committed tokens) and at a snapshot point. That block then is a reuse point inside a block
        (without partial reuse, for a request of exactly its tokens or one it was saved for)."""
        services = self._services
        return (
            services.has_live_states
            and len(self._tail) > 0
            and self._committed == self._capacity
            and self._is_snapshot_point(self._committed)
        )

    def _is_snapshot_point(self, committed: int) -> bool:
        """A declared snapshot point, the end of a prefill chunk (inside the prompt, with
        ``snapshot_prefill_chunks``), a multiple of the reuse interval, or any commit end with
        ``snapshot_every_commit``."""
        settings = self._services.settings
        if settings.snapshot_every_commit or committed in self._snapshot_points:
            return True
        if settings.snapshot_prefill_chunks and committed <= self._prompt_length:
            return True
        interval = settings.ssm_reuse_interval
        return interval > 0 and committed % interval == 0
