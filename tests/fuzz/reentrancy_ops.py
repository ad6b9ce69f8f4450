"""Calls that must not leave a trace when user code misbehaves around them (issue #35): a priority callback that
fails for one call or calls back into the manager (refused with ``RuntimeError``), a handle dropped inside a
reference cycle with the cycle collector armed to run part way through the next manager call, on this thread or
another (the cache must be closed between calls, never inside one), copies or pickles of a handle
(``TypeError``), and page-changing calls on a cache held for an outside writer (``RuntimeError``, nothing
changed)."""

from __future__ import annotations

import copy
import gc
import pickle
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest, KVCacheStatus, ReuseScope
from kv_cache_manager_v2._cache.kv_cache import CacheState
from kv_cache_manager_v2._introspection import internals_of, state_of
from tests.fuzz.checks import assert_unchanged, check_fit_refusal, check_refusal
from tests.fuzz.limits import AMOUNT_MAX, COPY_KINDS, HELD_CALLS, FAULTS, FOLLOW_UPS, MAX_LIVE_CACHES, QUOTA_FACTORS
from tests.fuzz.model import CacheModel, CallbackFault, CallbackInterrupt, Token, lengths_of, pick
from tests.fuzz.world import FuzzWorld


@contextmanager
def collector_armed(point: int, automatic: bool = True) -> Iterator[None]:
    """Make the cycle collector run (first generation) at about the ``point``-th allocation of the body; not
    ``automatic``: only when the body runs it (``gc.collect`` works while the collector is disabled)."""
    thresholds = gc.get_threshold()
    enabled = gc.isenabled()
    gc.set_threshold(gc.get_count()[0] + 1 + point, 1 << 30, 1 << 30)
    if not automatic:
        gc.disable()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if enabled:
            gc.enable()


@contextmanager
def watching_collections(state: CacheState, closed_by_collector: list[str]) -> Iterator[None]:
    """Note the thread of any collection during which a dropped cache's ``state`` went from open to closed: a
    finalizer closed it (inside whatever call the collector interrupted) instead of queueing it for the next call.
    Takes the state, not the handle, which must stay collectable."""
    open_at_start: list[bool] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            open_at_start[:] = [state.status != KVCacheStatus.CLOSED]
        elif open_at_start and open_at_start[0] and state.status == KVCacheStatus.CLOSED:
            closed_by_collector.append(threading.current_thread().name)

    gc.callbacks.append(watch)
    try:
        yield
    finally:
        gc.callbacks.remove(watch)


def collect_young() -> None:
    """Collect the two younger generations: the dropped cycle is minutes younger than the suite's heap, and a full
    collection there cost ~35 ms each (a third of the fuzz test's time). When an older object still refers to the
    cycle, this leaves it: ``drop_in_cycle`` then collects in full before it checks ``num_live_caches``."""
    gc.collect(1)


def count_on_another_thread(manager: KVCacheManager) -> int:
    """``num_live_caches`` read on a thread of its own (a metrics thread beside the scheduler)."""
    counted: list[int] = []
    reader = threading.Thread(target=lambda: counted.append(manager.num_live_caches), name="fuzz-metrics")
    reader.start()
    reader.join()
    return counted[0]


def collects_on_another_thread(follow: int, point: int) -> bool:
    """Whether ``drop_in_cycle``'s follow-up collects from its priority callback on another thread."""
    return follow % FOLLOW_UPS == 3 and point % 2 == 0


def collect_on_another_thread() -> None:
    """Run the cycle collector on a thread of its own and wait for it: a dropped handle's finalizer then runs on
    that thread while this one is inside a manager call (the collector runs on whichever thread allocates)."""
    collector = threading.Thread(target=collect_young, name="fuzz-collector")
    collector.start()
    collector.join()


class ReentrancyOperations(FuzzWorld):
    """Misbehaving callbacks, handles dropped in cycles, handle copies."""

    def misbehave(self, index: int, fault: int, amount: int) -> None:
        """Make a cache's priority callback misbehave for one call, then grow it (active) or resume it
        (suspended): if the callback was asked, the call raises and nothing changes; otherwise it is an ordinary
        call."""
        with self._operation("misbehave"):
            model = pick([m for m in self.live if m.callback is not None], index)
            if model is None or model.callback is None:
                return
            callback = model.callback
            cache = model.cache
            calls = callback.calls
            new_capacity = min(self.config.max_capacity, model.capacity + 1 + amount)
            self.manager.get_iteration_stats()
            before = self.snapshot()
            callback.fault = 1 + fault % FAULTS
            try:
                done = cache.resize(new_capacity, model.capacity) if model.active else cache.resume()
            except (ValueError, CallbackFault, CallbackInterrupt) as error:
                assert callback.calls > calls, f"{error!r} without asking the callback"
                assert_unchanged(before, self.snapshot(), "a call whose priority callback failed")
                self._assert_no_statistics("a call whose priority callback failed")
                self.stats.callback_faults += 1
                return
            finally:
                callback.fault = 0
            assert callback.calls == calls, "a misbehaving callback's answer was accepted"
            if not done:
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), "a refused call with a misbehaving callback")
                return
            self._follow_growth(model, new_capacity)

    def drop_in_cycle(self, index: int, point: int, follow: int) -> None:
        """Drop a cache's only handle inside a reference cycle, then make one more manager call (``follow``:
        create in the same scope and prefix, a batch of the same, a GPU quota change, a cache's growth whose
        priority callback runs the collector) with the collector armed at about its ``point``-th allocation: the
        dropped cache must be closed at a call boundary, never half way through that call."""
        with self._operation("drop_in_cycle"):
            model = pick(self.live, index)
            if model is None:
                return
            self.live.remove(model)
            if follow % FOLLOW_UPS == 2:
                model.cache.suspend()  # an uncollected active cache would make the quota change refuse
            scope, prefix = model.scope, model.tokens[: model.committed]
            # Undropped planned drops go in the cycle too (applied between calls); the follow-up then asks for a
            # closed turn one planned, so a plan applied inside the call would drop the pages it matched.
            cycle: list[object] = [model.cache, *(plan for plan, _ in self.plans)]
            ended = [turn for _, turn in self.plans if turn not in self.live and turn is not model]
            if ended and point % 4:
                turn = ended[point % len(ended)]
                scope, prefix = turn.scope, turn.tokens[: turn.committed]
            self.plans.clear()
            cycle.append(cycle)  # only the collector can free the handle now
            closed_by_collector: list[str] = []
            state = state_of(model.cache)
            watching = watching_collections(state, closed_by_collector)
            del cycle, model
            try:
                with watching, collector_armed(point, automatic=not collects_on_another_thread(follow, point)):
                    self._follow_up(follow % FOLLOW_UPS, scope, prefix, point)
                    collect_young()  # if the collector did not run in the call: the handle is finalized now (queued)
            finally:  # also when the follow-up raised (a resume that found lost pages): no frame keeps the cycle
                collect_young()
            assert not closed_by_collector, f"a finalizer closed the dropped cache on {closed_by_collector[0]}"
            queued = len(internals_of(self.manager).guard.dropped)
            counted = count_on_another_thread(self.manager)  # a collection meanwhile may queue more, never fewer
            assert len(internals_of(self.manager).guard.dropped) >= queued, "a read on another thread closed a cache"
            assert counted >= len(self.live)
            live = self.manager.num_live_caches  # this thread's read closes what is queued
            if live > len(self.live):  # an object of an older generation still referred to the cycle: only a
                # full collection finds it unreachable (seen once in 300 examples of the tiered config)
                with watching_collections(state, closed_by_collector):
                    gc.collect()
                live = self.manager.num_live_caches
            assert not closed_by_collector, f"a finalizer closed the dropped cache on {closed_by_collector[0]}"
            assert live == len(self.live), f"{live} live caches, {len(self.live)} expected"

    def _follow_up(self, kind: int, scope: ReuseScope | None, prefix: list[Token], point: int) -> None:
        prompt = (prefix + self._fresh(self.tpb + point % 7))[: self.config.max_capacity]
        if kind == 0 and len(self.live) < MAX_LIVE_CACHES:
            cache = self.manager.create_kv_cache(scope, prompt)
            model = CacheModel(cache, prompt, scope, cache.num_committed_tokens)
            assert cache.status == KVCacheStatus.SUSPENDED and lengths_of(cache) == model.lengths, cache
            self.live.append(model)
            self.stats.caches_created += 1
        elif kind == 1 and len(self.live) < MAX_LIVE_CACHES:
            admitted = self.manager.create_kv_cache_batch([KVCacheRequest(prompt, scope, capacity=len(prompt))])[0]
            if admitted is None:
                self.stats.batches_refused += 1
                return
            cache = admitted
            model = CacheModel(cache, prompt, scope, cache.num_committed_tokens)
            model.capacity = max(len(prompt), model.committed)
            model.active = True
            assert cache.status == KVCacheStatus.ACTIVE and lengths_of(cache) == model.lengths, cache
            self.live.append(model)
            self.stats.caches_created += 1
            self._step(model)
            if self.config.ssm:  # the live state holds every computed token: commit them
                cache.commit(model.tokens[model.committed : model.capacity])
                model.committed = model.history = model.capacity
            self._check_content(model)
        elif kind == 2:
            self._suspend_all()
            quota = max(1, self.quotas[0] * QUOTA_FACTORS[point % len(QUOTA_FACTORS)] // 4)
            if self.manager.resize(0, quota):
                self.stats.quota_changes += 1
                assert self.manager.get_quota(0) == quota
        else:
            grown = pick([m for m in self.live if m.callback is not None], point)
            if grown is None or grown.callback is None:
                return
            # The finalizer runs while the manager asks the callback, on this thread or on another one.
            on_another_thread = collects_on_another_thread(kind, point)
            grown.callback.reenter = collect_on_another_thread if on_another_thread else collect_young
            try:
                self._grow_or_resume(grown, min(self.config.max_capacity, grown.capacity + 1 + point % AMOUNT_MAX))
            finally:
                grown.callback.reenter = None

    def reenter(self, index: int, target: int, swallow: bool, amount: int) -> None:
        """A priority callback calls back into the manager (``target``, see ``_reentry``) while its cache grows
        or resumes: that inner call raises ``RuntimeError``. Swallowed, the outer call completes as usual;
        propagated, the outer call raises and changes nothing."""
        with self._operation("reenter"):
            model = pick([m for m in self.live if m.callback is not None], index)
            if model is None or model.callback is None:
                return
            callback = model.callback
            inner = self._reentry(target, model)
            refusals: list[str] = []

            def call_back_in() -> None:
                try:
                    inner()
                except RuntimeError as error:
                    refusals.append(str(error))
                    if not swallow:
                        raise
                else:
                    raise AssertionError("a manager call from inside a priority callback was not refused")

            self.manager.get_iteration_stats()
            before = self.snapshot()
            callback.reenter = call_back_in
            try:
                done = self._grow_or_resume(model, min(self.config.max_capacity, model.capacity + 1 + amount))
            except RuntimeError as error:
                assert not swallow and refusals, f"{error!r} without a refused call back"
                assert_unchanged(before, self.snapshot(), "a call whose priority callback called back in")
                self._assert_no_statistics("a call whose priority callback called back in")
                self.stats.callback_faults += 1
                return
            finally:
                callback.reenter = None
            assert all("is in flight" in message for message in refusals), refusals
            if not done:
                assert_unchanged(before, self.snapshot(), "a refused call whose priority callback called back in")

    def _reentry(self, target: int, model: CacheModel) -> Callable[[], object]:
        """What a priority callback calls back into: its own cache, another cache, or the manager."""
        cache, manager = model.cache, self.manager
        other = pick([m for m in self.live if m is not model], target)
        calls: list[Callable[[], object]] = [
            cache.close,
            cache.suspend,
            lambda: cache.commit([]),
            manager.create_kv_cache,
            lambda: manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3])]),
            lambda: manager.probe_reuse(None, [1, 2, 3]),
            lambda: manager.resize(0, self.quotas[0]),
            manager.shutdown,
            manager.clear_reusable_blocks,
            manager.check_invariants if other is None else other.cache.close,
        ]
        return calls[target % len(calls)]

    def copy_handle(self, index: int, kind: int) -> None:
        """A handle is not a value: ``copy``, ``deepcopy`` and ``pickle`` of a cache (live or closed), the manager
        or a planned drop not applied yet raise TypeError and change nothing."""
        with self._operation("copy_handle"):
            model = pick(self.live + self.closed, index)
            if model is None:
                return
            handles: list[object] = [model.cache, self.manager]
            handles.extend(plan for plan, _ in self.plans[-1:])
            handle = handles[index % len(handles)]
            operation: Callable[[object], object] = (copy.copy, copy.deepcopy, pickle.dumps)[kind % COPY_KINDS]
            before = self.snapshot()
            try:
                operation(handle)
            except TypeError:
                pass
            else:
                raise AssertionError(f"{operation.__name__} of a {type(handle).__name__} did not raise TypeError")
            assert_unchanged(before, self.snapshot(), f"{operation.__name__} of a handle")

    def held_call(self, index: int, call: int, amount: int) -> None:
        """While an active cache is held (``KVCache.hold``, as for a transfer that cannot be stopped), a call that
        could free, move or share its pages raises RuntimeError and changes nothing, and a refusal of another call
        meanwhile (a fit query, another cache's resume) counts its pages (``check_held_pages``); released, the cache
        is ordinary again (the next operations use it). Every other time the hold is dropped unreleased instead: the
        entry of the next call lifts it (only queued until then)."""
        with self._operation("held_call"):
            model = pick([m for m in self.live if m.active], index)
            if model is None:
                return
            cache = model.cache
            grown = min(self.config.max_capacity, model.capacity + amount)
            calls: list[Callable[[], object]] = [
                cache.close,
                cache.suspend,
                lambda: cache.resize(grown, model.history),
                lambda: cache.resize(model.history, model.history),
                lambda: cache.commit([]),
                cache.stop_committing,
                lambda: setattr(cache, "capacity", grown),
                cache.resume,
            ]
            hold = cache.hold("fuzz: an outside writer")
            try:
                before = self.snapshot()
                try:
                    calls[call % HELD_CALLS]()
                except RuntimeError as error:
                    assert "is held (fuzz: an outside writer)" in str(error), error
                else:
                    raise AssertionError(f"call {call % HELD_CALLS} on a held cache was accepted")
                assert_unchanged(before, self.snapshot(), "a page-changing call on a held cache")
                assert list(cache.held_for) == ["fuzz: an outside writer"] and cache.is_active
                # A fit query or another cache's resume refused meanwhile counts the held cache's pages.
                too_long = self.config.max_capacity + amount
                if not self.manager.can_fit_in_chunks(too_long, 1 + amount):
                    check_fit_refusal(self.manager, "KVCacheManager.can_fit_in_chunks", [cache])
                waiting = pick([m for m in self.live if not m.active], index + amount)
                earlier = self.manager.last_refusal
                if waiting is not None and waiting.cache.resume():
                    waiting.cache.suspend()  # as it was: the model keeps it suspended
                elif waiting is not None:
                    check_refusal(self.manager, earlier, "KVCache.resume", waiting.cache, held=[cache])
            finally:
                if amount % 2 == 0:
                    hold.release()
                else:  # dropped unreleased, also when a call above raised (its traceback keeps this frame alive)
                    del hold  # queued, lifted by the next call's entry
            if amount % 2:
                assert list(cache.held_for) == ["fuzz: an outside writer"]
                self.manager.check_invariants()  # a guarded call
            assert not cache.held_for
