"""The ``handoff`` operation: a local prefill -> decode handoff (``disagg.plan_transfer`` / ``execute``) from one of
the world's active caches into a receiver instance of the same layout (GPU tier only), its completion delivered
late: the plan waits while the workload goes on (the sender's cache may be resized down and up again, suspended,
closed, its freed slots given to other requests), then ``execute`` runs it. Either the receiver's rows then hold
the sender's prompt (the FakeEngine's check) or ``execute`` refuses with ``ValueError`` and changes nothing on the
receiver (every pool's bytes compared): a plan completed against recycled pages must never copy another request's
bytes as the prompt's (SPEC §11, asynchronous completions)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Final

import numpy as np

from kv_cache_manager_v2 import KVCacheManager, _KVCache
from kv_cache_manager_v2._cache.attention_state import AttentionState
from kv_cache_manager_v2._cache.kv_cache import CacheState
from kv_cache_manager_v2._cache.ssm_state import SsmState
from kv_cache_manager_v2._handoff.transfer import endpoints_of
from kv_cache_manager_v2._introspection import state_of
from kv_cache_manager_v2._pages.page import Page
from kv_cache_manager_v2.disagg import KVSlice, TransferPlan, cached_tokens_per_layer_group, execute, plan_transfer
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.event_replay import EventReplay
from tests.fuzz.lifecycle_ops import LifecycleOperations
from tests.fuzz.model import pick

# ``handoff``'s ``late``: 0 executes at once, 1 leaves the plan pending, 2 rewinds its sender, then executes.
HANDOFF_CHOICES: Final = 3
# The receiver's key in ``FuzzWorld.twins`` (checked after every operation, shut down at teardown).
RECEIVER: Final = -1
# What planning may refuse for a sender the workload left so: a window's or a rewind's blocks without a GPU page
# at the slice's end, or an SSM live state computed past it.
PLANNING_REFUSALS: Final = re.compile(r"has no GPU page|may be past the prompt")


@dataclass
class PendingHandoff:
    """A plan not executed yet: the receiving cache, the FakeEngine records its rows must hold, and each page the
    plan moves (both sides) with its generation at planning, read here from the group states themselves."""

    plan: TransferPlan
    receiver: _KVCache
    written: list[int]
    pages: list[tuple[object, int]]


class HandoffOperations(LifecycleOperations):
    """Local handoffs whose plans run late."""

    pending_handoff: PendingHandoff | None = None

    def handoff(self, index: int, late: int) -> None:
        """With a plan pending: execute it (late). Else plan one from the rows an active cache computed into a new
        receiver cache, then for ``late`` 0 execute it at once, for 1 leave it pending while the workload goes on, for
        2 execute it once the engine rewound its sender and computed the rows again (new pages in the same slots)."""
        if self.pending_handoff is not None:
            self.settle_handoff()
            return
        with self._operation("handoff"):
            found = self._plan(index)
        if found is None:
            return
        choice = late % HANDOFF_CHOICES
        if choice == 1:
            self.pending_handoff = found
            return
        if choice == 2:
            self._rewind_sender(found)
        with self._operation("handoff"):
            self._complete(found)

    def _rewind_sender(self, pending: PendingHandoff) -> None:
        """Shrink the sender to the start of the plan's last block (not below its history) and grow it back,
        computing the rows again (``_resize``): that block's page is let go and a new one takes its slot (a freed
        slot comes back first), so slot numbers alone match the plan."""
        sender = _sender_of(pending.plan)
        model = next((model for model in self.live if state_of(model.cache) is sender and model.active), None)
        if model is None or self.config.ssm:  # (an SSM world's history moves only by serving)
            return
        end = pending.plan.kv_slice.token_range.end
        shrunk = max(model.history, (end - 1) // self.tpb * self.tpb)
        capacity = model.capacity
        if shrunk >= capacity:
            return
        with self._operation("handoff"):
            if self._resize(model, shrunk, None, 0):
                self._resize(model, capacity, None, 0)

    def settle_handoff(self) -> None:
        """Execute the pending plan, if any. A sender dropped unclosed meanwhile (``drop_in_cycle``) was closed at
        the next call (the plan keeps its state, not its handle): ``execute`` refuses."""
        pending = self.pending_handoff
        if pending is not None:
            self.pending_handoff = None
            with self._operation("handoff"):
                self._complete(pending)

    def teardown(self, shut_down: bool = True) -> None:
        """A plan still pending runs now, the latest of all (a broken world's receiver cache is only closed)."""
        pending = self.pending_handoff
        self.pending_handoff = None
        if pending is not None:
            if not self.broken:
                self._complete(pending)
            else:
                try:
                    pending.receiver.close()
                except Exception:  # noqa: BLE001  (already failing: release what can be released)
                    pass
        super().teardown(shut_down)

    def _receiver(self) -> KVCacheManager:
        receiver = self.twins.get(RECEIVER)
        if receiver is None:
            config = self.manager.config
            receiver = KVCacheManager(replace(config, cache_tiers=[config.cache_tiers[0]]))
            self.twins[RECEIVER] = receiver
            self.twin_events[RECEIVER] = EventReplay(receiver)
        return receiver

    def _plan(self, index: int) -> PendingHandoff | None:
        # (Not a batch request whose rows an earlier one of its batch computes, nor one whose first step waits.)
        model = pick([model for model in self.live if model.active and model.borrowed_at is None and not model.step_skipped], index)
        if model is None:
            return None
        # Rows its engine computed (past the history too: a prefill sent before the history moves), of its tokens
        # the manager knows: a later shrink and growth at the same history can hand their slots to other pages.
        known = max(model.committed, model.prompt_length)
        if model.computed <= model.history < known and not self.config.ssm:  # the prompt's next chunk first
            self._resize(model, min(known, self.config.max_capacity, model.history + 2 * self.tpb), None, 0)
        length = min(model.computed, model.capacity, known)
        if length == 0:
            return None
        receiver = self._receiver()
        cache = receiver.create_kv_cache(model.scope, model.tokens[:length])
        if not cache.resume() or not cache.resize(length, length):
            cache.close()
            return None
        counts = cached_tokens_per_layer_group(cache, length)
        try:
            plan = plan_transfer(self.manager, model.cache, receiver, cache, KVSlice(length), counts)
        except ValueError as error:
            cache.close()
            assert PLANNING_REFUSALS.search(str(error)), error
            return None
        return PendingHandoff(plan, cache, model.engine_tokens[:length], _pages(plan, state_of(model.cache), state_of(cache)))

    def _complete(self, pending: PendingHandoff) -> None:
        receiver = self._receiver()
        cache = pending.receiver
        before = _pool_bytes(receiver)
        try:
            execute(pending.plan)
        except ValueError:
            self.stats.handoffs_refused += 1
            after = _pool_bytes(receiver)
            assert all(np.array_equal(a, b) for a, b in zip(before, after)), "a refused execute wrote the receiver"
        else:
            plan = pending.plan  # an execute that ran must have found every planned page as it was
            now = _pages(plan, _sender_of(plan), state_of(cache))
            assert all(a is b and x == y for (a, x), (b, y) in zip(pending.pages, now)), "execute ran on recycled pages"
            engine = FakeEngine(receiver, self.config.index_mode)
            engine.check(cache, pending.written)
            self.stats.tokens_checked += engine.tokens_checked
            self.stats.handoffs_executed += 1
        finally:
            cache.close()
        receiver.check_invariants()


def _sender_of(plan: TransferPlan) -> CacheState:
    endpoints = endpoints_of(plan)
    assert endpoints is not None
    return endpoints.src_state


def _pages(plan: TransferPlan, sender: CacheState, receiver: CacheState) -> list[tuple[object, int]]:
    """Each (page, generation) a plan reads and writes, from the caches' group states: entries of attention
    groups, the live state of SSM groups (a closed cache's: none)."""
    found: list[tuple[object, int]] = []
    for descriptor in plan.descriptors:
        for state in (sender, receiver):
            group = state.groups[descriptor.layer_group]
            page: Page | None = None
            if isinstance(group, SsmState):
                page = group.live
            elif isinstance(group, AttentionState) and descriptor.block < len(group.entries):
                page = group.entries[descriptor.block]
            found.append((page, -1 if page is None else page.generation))
    return found


def _pool_bytes(manager: KVCacheManager) -> list[np.ndarray]:
    """A copy of every layer's every buffer on the GPU tier (what a refused execute must leave as it was)."""
    copies: list[np.ndarray] = []
    for layer in manager.config.layers:
        for buffer in layer.buffers:
            copies.append(np.array(manager.get_page_view(layer.layer_id, buffer.role), copy=True))
    return copies
