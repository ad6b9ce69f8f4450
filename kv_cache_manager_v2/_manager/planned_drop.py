"""Planned drops of a finished turn's sliding-window blocks and SSM endpoint snapshot (TensorRT-LLM's
``plan_committed_block_drop``).

A multi-turn engine keeps a conversation's prefix cached for its next turn. The window blocks (and the SSM state
snapshotted) at the end of a turn only serve a next turn that continues exactly there; once the engine knows that
turn will not come (it expired), dropping them frees room without touching the full-attention blocks (and sink
blocks, earlier snapshots) that any later request sharing the prefix still needs. The plan is taken while the cache is open; the drop happens whenever the engine
decides, on whatever pages are still the ones planned."""

from __future__ import annotations

from typing import TYPE_CHECKING, final

from .._cache.cache_view import KVCacheStatus
from .core import check_alive, internals_of
from .._base.types import Handle

if TYPE_CHECKING:
    from .._cache.kv_cache import CacheState
    from .._cache.services import CacheServices
    from .core import ManagerCore
    from .._pages.page import Page


@final
class PlannedDropHandle(Handle):
    """The pages one ``plan_committed_block_drop`` chose; ``drop`` evicts those still cached and unused. A handle
    garbage-collected before ``drop`` applies its plan then (an engine lets expired turns fall out of a queue): at
    the entry of the manager's next call, never inside the call during which the collector ran."""

    def __init__(self, manager: ManagerCore, planned: list[tuple[Page, int]]) -> None:
        self._manager = manager
        self._plan = PlannedDrop(internals_of(manager).services, planned)
        self._dropped = False

    @property
    def is_dropped(self) -> bool:
        """Whether ``drop`` ran (by a call or when the handle was collected)."""
        return self._dropped

    def drop(self) -> None:
        """Drop every planned page that is still the content it was at planning time, that nobody uses and that no
        other undropped handle plans to drop (two turns planned over the same window: the page goes with the last
        of their drops); a page a cache uses again is left cached. RuntimeError on a second call, and (changing
        nothing) while another call of the manager is in flight."""
        if self._dropped:
            raise RuntimeError("this PlannedDropHandle has already been dropped")
        check_alive(self._manager)
        with internals_of(self._manager).guard.entering("PlannedDropHandle.drop"):
            self._dropped = True
            self._plan.close()

    def __del__(self) -> None:
        """Queue the plan of a handle nobody dropped (the collector may run this inside any manager call), unless
        its manager is shut down."""
        if not self._dropped and not self._manager.is_shut_down:
            internals_of(self._manager).guard.dropped.append(self._plan)


class PlannedDrop:
    """What a ``PlannedDropHandle`` plans: each page with its generation at planning time (its content). ``close``
    applies it once (``drop``, or the manager's ``CallGuard`` when the handle was collected undropped)."""

    def __init__(self, services: CacheServices, planned: list[tuple[Page, int]]) -> None:
        self._services = services
        self._planned = planned
        for page, _ in planned:
            page.planned_drop_count += 1

    def close(self) -> None:
        """Drop the planned pages still holding the planned content, unused and planned by no other handle."""
        store = self._services.store
        planned, self._planned = self._planned, []
        for page, generation in planned:
            if page.generation != generation:
                continue  # the page holds other content now (its count started again with it)
            page.planned_drop_count -= 1
            # Same content, maybe another block's now: a wider sibling took the page over (``offer_page``), its first
            # rows being these tokens. Out of the tree (a cache's private page now), there is nothing to drop.
            unused = page.lock_count == 0 and page.hold_count == 0 and page.claim_count == 0
            if unused and page.planned_drop_count == 0 and page.block is not None:
                store.drop(page)
        self._services.after_call()


def plan_committed_block_drop(state: CacheState, manager: ManagerCore) -> PlannedDropHandle | None:
    """Plan dropping the committed blocks inside each sliding window at the end of ``state``'s committed tokens,
    and the SSM snapshot there. None when nothing was committed or the tree no longer serves every committed
    token."""
    if state.status == KVCacheStatus.CLOSED:
        raise ValueError(f"plan_committed_block_drop(): cache {state.id} is closed")
    if not state.is_committing_stopped:
        raise RuntimeError("plan_committed_block_drop() requires stop_committing() first")
    committed = state.num_committed_tokens
    if committed == 0:
        return None
    services = internals_of(manager).services
    match = services.matcher.longest(state.reuse_scope, state.committed_tokens)
    if match.length != committed or not match.blocks:
        return None
    end = len(match.blocks)
    # A turn ending inside a block ends on the partial tree block of exactly its trailing tokens (published by
    # ``stop_committing``), not on a sibling the match copies rows from.
    tail = tuple(state.committed_tokens[end * services.tokens_per_block :])
    partial = services.tree.child(match.blocks[-1], tail) if tail else None
    planned: list[tuple[Page, int]] = []
    for life_cycle in services.life_cycles:
        if life_cycle.is_ssm:
            # The snapshot at the turn's end serves only a continuation of exactly this turn; earlier snapshots
            # serve anyone sharing a shorter prefix and stay.
            ending = match.blocks[end - 1] if not tail else partial
            endpoint = None if ending is None else ending.pages[life_cycle.id]
            if ending is not None and endpoint is not None:
                planned.append((endpoint, endpoint.generation))
            continue
        if life_cycle.window_size is None:
            continue  # full attention serves any later request sharing the prefix
        window_start = min(life_cycle.stale(committed)[1], end)
        for block in match.blocks[window_start:end]:
            page = block.pages[life_cycle.id]
            if page is None:
                return None
            planned.append((page, page.generation))
        tail_page = None if partial is None else partial.pages[life_cycle.id]
        if partial is not None and tail_page is not None:
            planned.append((tail_page, tail_page.generation))
    return PlannedDropHandle(manager, planned)
