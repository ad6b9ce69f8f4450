"""Calls on the manager as a whole: quota changes, ``adjust``, batch admission, ``clear_reusable_blocks``,
registered page-index buffers, and the documented invalid moves (``ValueError``, nothing changed)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kv_cache_manager_v2 import KVCacheRequest, KVCacheStatus, Refusal, _KVCache
from tests.fuzz.checks import assert_unchanged, check_refusal, expect_value_error
from tests.fuzz.limits import ABSURD_CAPACITY, BATCH_MAX, FAULTS, INVALID_KINDS, MAX_LIVE_CACHES, QUOTA_FACTORS, SCOPES
from tests.fuzz.model import CacheModel, CallbackFault, CallbackInterrupt, FuzzCallback, Token, lengths_of, pick
from tests.fuzz.world import FuzzWorld


class ManagerOperations(FuzzWorld):
    """Whole-manager calls and the invalid moves."""

    def change_quota(self, level: int, choice: int) -> None:
        """Suspend every cache, then ``manager.resize(level, quota)``: True sets the quota, False changes nothing."""
        with self._operation("change_quota"):
            level %= len(self.quotas)
            self._suspend_all()
            factor = QUOTA_FACTORS[choice % len(QUOTA_FACTORS)]
            if factor == 0 and level > 0:  # one byte asks a GPU tier to refuse; a colder one shrinks to a quarter
                factor = 1
            quota = max(1, self.quotas[level] * factor // 4)
            before, earlier = self.snapshot(), self.manager.last_refusal
            if not self.manager.resize(level, quota):
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), f"manager.resize({level}, {quota}) returning False")
                check_refusal(self.manager, earlier, "KVCacheManager.resize")
                return
            self.stats.quota_changes += 1
            assert self.manager.get_quota(level) == quota
            used_bytes = 0
            for group, stats in enumerate(self.manager.get_storage_statistics(level)):
                used_bytes += stats.total * sum(self.manager.get_slot_bytes(group))
            assert used_bytes <= quota, f"level {level}: {used_bytes} bytes of slots for a quota of {quota}"
            for other in range(len(self.quotas)):
                if other != level:
                    assert self.manager.get_quota(other) == before[f"quota {other}"]

    def adjust(self) -> None:
        """Suspend every cache, then re-split the tiers for the observed mix: True or False, invariants hold."""
        with self._operation("adjust"):
            self._suspend_all()
            earlier = self.manager.last_refusal
            if not self.manager.adjust():  # True or False; check() then verifies invariants, content and page tables
                check_refusal(self.manager, earlier, "KVCacheManager.adjust")

    def preempt_batch(self, size: int, source: int, mode: int, extra: int) -> None:
        """A batch of 2-3 requests behind a new common prefix (shared where every layer group is full attention)
        whose first admitted request the scheduler preempts before the batch's forward (``mode``: cut, suspended,
        closed or its handle dropped); the others step as their lengths say, reading only rows a step wrote."""
        if MAX_LIVE_CACHES - len(self.live) >= 2:
            self.create_batch(1 + size % 2, source, 16, extra, preempt=mode % 4)

    def create_batch(self, size: int, source: int, flags: int, extra: int, preempt: int = -1) -> None:
        """``create_kv_cache_batch`` of 1-4 requests: repeated prompts or a common new prefix (shared in the batch
        where every layer group is full attention), explicit and automatic ids (sometimes
        colliding: ValueError), a priority callback that may fail (it raises, and nothing changes), absurd
        capacities (that request comes back None), capacities in ``num_new_tokens`` (flags & 32: counted from
        the history each got, ending one token past its prompt). Admitted caches are active with the reuse the
        probe promised; when nothing is admitted, nothing changed and no statistics were counted."""
        with self._operation("create_batch"):
            count = min(1 + size % (BATCH_MAX + 1), MAX_LIVE_CACHES - len(self.live))
            sources = self.shared_prefixes + self.recent
            requests: list[KVCacheRequest] = []
            prompts: list[list[Token]] = []
            callbacks: list[FuzzCallback | None] = []
            collision = bool(flags & 2) and (count > 1 or bool(self.live))
            # flags & 16: every request opens with the same new prefix, which no cache holds yet (batch sharing).
            fresh_prefix = self._fresh(2 * self.manager.tokens_per_block + extra % 5) if flags & 16 else None
            for k in range(count):
                chosen = sources[(source + (0 if flags & 8 else 3 * k)) % len(sources)]  # flags & 8: one prompt
                prompt = list(chosen[: len(chosen) - (extra * (k + 1)) % (len(chosen) + 1)]) + self._fresh((extra + k) % 9)
                if fresh_prefix is not None:
                    prompt = fresh_prefix + self._fresh(1 + (extra + k) % 9)
                prompt = prompt[: self.config.max_capacity]
                cache_id: int | None = None
                if flags & 1 and k % 2 == 0:
                    cache_id = self._unused_id()
                if collision and k == count - 1:  # the first request's id, or a live cache's
                    if count > 1:
                        if requests[0].id is None:
                            requests[0].id = self._unused_id()
                        cache_id = requests[0].id
                    else:
                        cache_id = self.live[0].cache.id
                callback = FuzzCallback(source + k) if flags & 4 and k == count - 1 else None
                capacity: int | None = len(prompt) + (extra + 5 * k) % 17
                new_tokens: int | None = None
                if extra % 7 == 3 and k == 0:
                    capacity = ABSURD_CAPACITY
                elif flags & 32:
                    capacity, new_tokens = None, (extra + 5 * k) % 17
                scope = SCOPES[(source + k) % len(SCOPES)]
                lookup, readmitted = (extra + 3 * k) % 5 != 4, (extra + 3 * k) % 5 == 3  # a save, a readmission
                requests.append(KVCacheRequest(
                    prompt, scope, cache_id, capacity, callback, num_new_tokens=new_tokens, preempted=readmitted, lookup=lookup,
                ))
                prompts.append(prompt)
                callbacks.append(callback)
            reuse = [self.manager.probe_reuse(request.reuse_scope, prompt) for request, prompt in zip(requests, prompts)]
            faulty = callbacks[-1]
            armed = faulty is not None and extra % 3 == 0
            if faulty is not None and armed:
                faulty.fault = 1 + extra % FAULTS
            self._reset_lookup_counts()  # counters start from zero for this call
            before, earlier = self.snapshot(), self.manager.last_refusal
            lost_before = self.manager.movement_counters.lost_pages
            try:
                results = self.manager.create_kv_cache_batch(requests)
            except (ValueError, CallbackFault, CallbackInterrupt) as error:
                expected = collision or (armed and faulty is not None and faulty.calls > 0)
                assert expected, f"create_kv_cache_batch raised {error!r}"
                assert_unchanged(before, self.snapshot(), "a batch that raised")
                self._assert_no_statistics("a batch that raised")
                self.stats.callback_faults += 0 if collision else 1
                return
            finally:
                if faulty is not None:
                    faulty.fault = 0
            assert not collision, "a batch with colliding ids was admitted"
            self._check_batch_refusals(results, earlier)
            assert not (armed and faulty is not None and faulty.calls > 0), "a misbehaving callback's answer was used"
            if all(result is None for result in results):
                self.stats.batches_refused += 1
                if self.manager.movement_counters.lost_pages == lost_before:  # (a refusal for lost pages moved some)
                    assert_unchanged(before, self.snapshot(), "a batch that admitted nothing")
                    self._assert_no_statistics("a batch that admitted nothing")
                return
            self._check_lookups_counted([
                (request.lookup, request.preempted, len(prompt))
                for request, prompt, result in zip(requests, prompts, results) if result is not None
            ], "create_kv_cache_batch")
            # Now and then the scheduler preempts the batch's first admitted request (the donor of any share) before
            # the batch's forward: the others then compute as their lengths say, reading only rows a step wrote.
            # ``num_new_tokens`` counts from the history each got at admission: a recall (below) moves the history
            # back, never the capacity, so the step then computes the recalled rows too.
            admitted = [0 if cache is None else cache.history_length for cache in results]
            preempted, cut = -1, -1
            if preempt >= 0 or (flags & 16 and (extra // 5) % 3 == 0 and len(results) > 1):
                preempted, cut = self._preempt_first(results, preempt if preempt >= 0 else (extra // 15) % 4, extra)
            for position, (request, prompt, reused, callback, cache) in enumerate(
                zip(requests, prompts, reuse, callbacks, results)
            ):
                if cache is None:  # memory shortage (always so for an absurd capacity), or preempted (closed)
                    continue
                assert request.capacity != ABSURD_CAPACITY, "an absurd capacity was admitted"
                assert request.id is None or cache.id == request.id, (cache.id, request.id)
                suspended = position == preempted and cut < 0
                assert cache.status == (KVCacheStatus.SUSPENDED if suspended else KVCacheStatus.ACTIVE)
                model = CacheModel(cache, prompt, request.reuse_scope, reused)
                model.callback = callback
                if request.num_new_tokens is not None:
                    model.capacity = min(admitted[position] + request.num_new_tokens, len(prompt) + 1)
                else:
                    assert request.capacity is not None
                    model.capacity = max(request.capacity, reused)
                if position == preempted and cut >= 0:
                    model.capacity = cut
                # A request sharing an earlier one's prefix in the batch starts its history after it (no commit);
                # one whose donor was preempted computes from where the rows nobody writes begin.
                assert reused <= cache.history_length <= model.capacity, (cache, reused)
                model.history = cache.history_length
                model.borrowed_at = (model.history, model.committed)
                model.active = True
                assert lengths_of(cache) == model.lengths, (cache, model.lengths)
                self.live.append(model)
                self.stats.caches_created += 1
                if suspended:  # before its step
                    model.active = False
                    model.step_skipped = True
                    continue
                self._step(model)
                if self.config.ssm:  # the live state now holds every computed token: commit them
                    cache.commit(model.tokens[model.committed : model.capacity])
                    model.committed = model.history = model.capacity
                self._check_content(model)
                if model.committed < model.history:  # a share: a commit must repeat its tokens
                    self.stats.batch_shares += 1
                    wrong = self._fresh(1 + extra % 3)
                    before = self.snapshot()
                    expect_value_error(lambda: cache.commit(wrong), "a commit of other tokens over a shared prefix")
                    assert_unchanged(before, self.snapshot(), "a commit of other tokens over a shared prefix")
                    self.stats.invalid_moves += 1

    def _preempt_first(self, results: list[_KVCache | None], mode: int, extra: int) -> tuple[int, int]:
        """Preempt the first admitted request before its step: cut it back (mode 0; to its history now and then),
        suspend it (1), close it (2) or drop its handle (3, closed by the manager's next call or read of a
        length). Returns its position and, when cut, its new capacity (-1 otherwise)."""
        position = next(k for k, result in enumerate(results) if result is not None)
        cache = results[position]
        assert cache is not None
        others = [result for result in results[position + 1 :] if result is not None]
        before = [other.history_length for other in others]
        capacity = -1
        if mode == 0:
            history = cache.history_length
            capacity = history + (cache.capacity - history) * (extra % 3) // 3
            if not cache.resize(capacity):  # a cut takes nothing, but scratch reuse may still refuse: no preemption
                return -1, -1
        elif mode == 1:
            cache.suspend()
        else:
            if mode == 2:
                cache.close()
            results[position] = None  # mode 3 drops the last reference to the handle
            del cache
        self.stats.preemptions += 1
        # Reading the others' lengths closes a dropped handle first; a history that went back is a recall.
        self.stats.recalls += sum(other.history_length < was for other, was in zip(others, before))
        return position, capacity

    def clear_reusable(self) -> None:
        """Drops only content no cache uses: free slots never shrink, the last tier keeps nothing evictable, and
        (full attention) blocks committed by live caches stay reusable. Probes may go up as well as down: with
        partial reuse, dropping a page-less block can expose a partially matching sibling to the prefix walk."""
        with self._operation("clear_reusable"):
            levels = range(self.manager.num_cache_levels)
            before_free = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
            if self.live:  # refused while any cache is open, changing nothing
                try:
                    self.manager.clear_reusable_blocks()
                except RuntimeError as error:
                    assert f"{len(self.live)} KV cache(s) still open" in str(error), error
                else:
                    raise AssertionError("clear_reusable_blocks with open caches must raise RuntimeError")
                after = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
                assert after == before_free, (before_free, after)
                return
            self.manager.clear_reusable_blocks()
            after_free = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
            for old, new in zip(before_free, after_free):
                assert all(a >= b for a, b in zip(new, old)), (before_free, after_free)
            last = self.manager.get_storage_statistics(self.manager.num_cache_levels - 1)
            assert all(stats.evictable == 0 for stats in last), last
            for model in self.live:
                prompt = model.tokens[: model.capacity]
                lower = self._reuse_lower_bound(model.scope, prompt)
                assert self.manager.probe_reuse(model.scope, prompt) >= lower, (model.cache, lower)

    def register_buffer(self, index: int, layer_group: int) -> None:
        """An engine-owned int32 page table the manager keeps equal to ``get_base_page_indices`` while active."""
        with self._operation("register_buffer"):
            model = pick(self.live, index)
            if model is None:
                return
            lg = layer_group % self.manager.num_layer_groups
            buffer = np.full(self.max_blocks + 2, -7, dtype=np.int32)
            model.cache.set_base_page_index_buf(0, lg, buffer)
            model.buffers[lg] = buffer
            self._check_buffers(model)

    def invalid_move(self, kind: int, index: int) -> None:
        """A documented invalid move: ValueError, and nothing changes."""
        with self._operation("invalid_move"):
            kind %= INVALID_KINDS
            active = self._active()
            call: Callable[[], object] | None = None
            what = ""
            if kind == 0:
                model = pick([m for m in self.live if not m.active], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.capacity + 1)), "resize of a suspended cache"
            elif kind == 1:
                model = pick([m for m in active if m.history > 0], index)
                if model is not None:
                    cache = model.cache
                    call = lambda: cache.resize(cache.capacity, cache.history_length - 1)  # noqa: E731
                    what = "history moving backwards"
            elif kind == 2:
                model = pick(active, index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.capacity, cache.capacity + 1)), "history beyond capacity"
            elif kind == 3:
                model = pick([m for m in active if not m.stopped], index)
                if model is not None:
                    cache = model.cache
                    tokens = self._fresh(model.capacity - model.committed + 1)
                    call, what = (lambda: cache.commit(tokens)), "commit beyond capacity"
            elif kind == 4:
                model = pick([m for m in active if m.stopped], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.commit([1])), "commit after stop_committing"
            elif kind == 5:
                model = pick(self.closed, index)
                if model is not None:
                    call, what = self._closed_call(model.cache, index), "operation on a closed cache"
            elif kind == 6:
                model = pick(self.live, index)
                if model is not None:
                    cache_id = model.cache.id
                    call, what = (lambda: self.manager.create_kv_cache(id=cache_id)), "duplicate cache id"
            elif kind == 7:
                if active:
                    call, what = (lambda: self.manager.resize(0, self.quotas[0])), "quota change with an active cache"
            elif kind == 8:
                if self.live:  # a RuntimeError naming how many are open, changing nothing
                    before = self.snapshot()
                    try:
                        self.manager.shutdown()
                    except RuntimeError as error:
                        assert f"{len(self.live)} KV cache(s) still open" in str(error), error
                    else:
                        raise AssertionError("shutdown with open caches must raise RuntimeError")
                    assert_unchanged(before, self.snapshot(), "shutdown with open caches")
                    self.stats.invalid_moves += 1
                return
            else:
                model = pick([m for m in active if m.history > 0], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.history_length - 1)), "capacity below history"
            if call is None:
                return
            before = self.snapshot()
            expect_value_error(call, what)
            assert_unchanged(before, self.snapshot(), what)
            self.stats.invalid_moves += 1

    @staticmethod
    def _closed_call(cache: _KVCache, index: int) -> Callable[[], object]:
        calls: list[Callable[[], object]] = [
            cache.resume,
            cache.suspend,
            lambda: cache.resize(16),
            lambda: cache.commit([1]),
            cache.stop_committing,
            lambda: cache.set_base_page_index_buf(0, 0, np.zeros(64, dtype=np.int32)),
        ]
        return calls[(index // 2) % len(calls)]

    def _check_batch_refusals(self, results: Sequence[_KVCache | None], earlier: Refusal | None) -> None:
        """One entry per request, None exactly where admitted; a refused request's refusal is the batch's own (the
        manager's latest is the last refused one's)."""
        reasons = self.manager.last_batch_refusals
        assert len(reasons) == len(results)
        assert [reason is None for reason in reasons] == [result is not None for result in results], reasons
        refused = [reason for reason in reasons if reason is not None]
        if refused:
            latest = check_refusal(self.manager, earlier, "create_kv_cache_batch", figures_now=False)
            assert latest is refused[-1], (latest, refused)
