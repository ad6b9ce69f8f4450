"""The request life cycle as an engine drives it: create, resume, resize (five kinds, three ways), serve (one
engine step), commit, stop_committing, suspend, placement hints (offload, prefetch, evicting prefetch) and close,
each checked against the model."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kv_cache_manager_v2 import BAD_PAGE_INDEX, KVCacheStatus, MovementCounters, OutOfPagesError, Refusal, ReuseScope
from kv_cache_manager_v2._introspection import internals_of
from tests.fuzz.checks import assert_unchanged, check_refusal, expect_value_error, snapshot
from tests.fuzz.limits import COUNT_MAX, MAX_LIVE_CACHES, RESIZE_KINDS, RESIZE_MODES, SCOPES, TURN_MARKER
from tests.fuzz.model import CacheModel, FuzzCallback, hash_colliding, lengths_of, pick, token_arg
from tests.fuzz.world import FuzzWorld


class LifecycleOperations(FuzzWorld):
    """One request's calls, in the order an engine makes them."""

    def create(self, source: int, cut: int, suffix: int, scope: int, flags: int) -> None:
        """A new request: a prefix of a shared prompt or of an earlier request, then fresh tokens."""
        with self._operation("create"):
            sources = self.shared_prefixes + self.recent
            chosen = sources[source % len(sources)]
            kept = list(chosen[: len(chosen) - cut % (len(chosen) + 1)])
            if flags & 64:  # a chat turn (``fan_out``): the system prompt, a stretch of the turn marker, fresh tokens
                kept = self.shared_prefixes[0] + list(TURN_MARKER[: 1 + cut % len(TURN_MARKER)])
            if flags & 32:  # the last full block kept collides in hash() with the source's block there
                kept = hash_colliding(kept, self.tpb)
            prompt = (kept + self._fresh(suffix))[: self.config.max_capacity]
            reuse_scope = SCOPES[scope % len(SCOPES)]
            if flags & 16:  # a single-use scope (a per-request salt): its tree root must go when its blocks go
                reuse_scope = ReuseScope(salt=f"request-{self._next_token}".encode())
            lower = self._reuse_lower_bound(reuse_scope, prompt)
            probe = self.manager.probe_reuse(reuse_scope, token_arg(prompt, bool(flags & 1)))
            assert lower <= probe <= len(prompt), f"probe_reuse {probe} outside [{lower}, {len(prompt)}]"
            split = self.manager.probe_reuse_by_tier(reuse_scope, prompt)
            assert split.tokens == probe and sum(split.tokens_by_level) == probe, (split, probe)
            moved = self.manager.movement_counters
            cache_id: int | None = None
            if flags & 2:
                cache_id = self._unused_id()
            callback = FuzzCallback((source * 37 + suffix) % 101) if flags & 4 else None
            expected = len(prompt) if flags & 8 else None
            # Mostly, the engine declares where the prompt it continues ends (a system prompt, an earlier turn).
            declared = [len(chosen)] if suffix % 3 else []
            live_before = self.manager.num_live_caches
            # Now and then a connector's save (``lookup=False``: no lookup counted) or a readmission, never both.
            lookup, preempted = (cut + suffix) % 6 != 5, (cut + suffix) % 6 == 4
            self._reset_lookup_counts()
            cache = self.manager.create_kv_cache(
                reuse_scope,
                token_arg(prompt, bool(flags & 1)),
                id=cache_id,
                custom_priority_callback=callback,
                expected_prompt_length=expected,
                snapshot_at=declared,
                preempted=preempted,
                lookup=lookup,
            )
            self._check_lookups_counted([(lookup, preempted, len(prompt))], "create")
            pending = cache.id in self.manager.get_dirty_stats_kv_cache_ids()
            assert pending == (lookup and len(prompt) > 0), (cache, lookup, "a save has no lookup to settle")
            reused = probe
            if self.remote:  # the probe counts local blocks; the remote tier may extend them
                reused = cache.num_committed_tokens
                assert probe <= reused <= len(prompt), (probe, cache)
            model = CacheModel(cache, prompt, reuse_scope, reused)
            model.callback = callback
            if not self.remote:
                model.split_at_create = (split, moved)
            assert cache.status == KVCacheStatus.SUSPENDED, cache
            assert lengths_of(cache) == model.lengths, (cache, probe)
            assert cache_id is None or cache.id == cache_id, (cache.id, cache_id)
            assert all(other.cache.id != cache.id for other in self.live), f"cache id {cache.id} reused"
            assert self.manager.num_live_caches == live_before + 1
            self.live.append(model)
            self.recent = (self.recent + [model.tokens])[-8:]
            self.stats.caches_created += 1
            if reused > 0:
                self.stats.reuse_hits += 1
                self.stats.reused_tokens += reused

    def fan_out(self, count: int, cut: int) -> None:
        """Chat turns after the system prompt: 9 to 12 short requests (``create`` with flags & 64), each served and
        closed before the next, so the prompt's last block gets more children sharing their first tokens than a
        ``ChildGroup`` keeps unsplit; their turn marker stretches and lengths differ (some end inside the marker:
        partial blocks to merge), so partial matches, sibling merges and pruning walk split groups. Only with
        partial reuse (children are grouped for partial matching) and at most one cache open (it runs long)."""
        for turn in range(9 + count % 4):
            if len(self.live) >= MAX_LIVE_CACHES:
                return
            live = len(self.live)
            self.create(0, cut + 3 * turn, (count + turn) % 7, 0, 64)
            if len(self.live) == live:
                return  # the create was interrupted
            model = self.live[-1]
            self.serve(len(self.live) - 1, len(model.tokens))
            if model in self.live:  # not closed for lost pages
                self.close(self.live.index(model))

    def resume(self, index: int, stream: int) -> None:
        with self._operation("resume"):
            model = pick(self.live, index)
            if model is None:
                return
            cuda_stream = None if stream == 0 else stream
            if model.active:
                assert model.cache.resume(cuda_stream) is True
                return
            before, earlier = self.snapshot(), self.manager.last_refusal
            moved = self.manager.movement_counters
            if not model.cache.resume(cuda_stream):
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), f"resume of cache {model.cache.id} returning False")
                refusal = check_refusal(self.manager, earlier, "KVCache.resume", model.cache)
                if not self._stop_and_retry(model, refusal, model.history, lambda: model.cache.resume(cuda_stream)):
                    return
            model.active = True
            assert model.cache.status == KVCacheStatus.ACTIVE and model.cache.resumable_alone
            self._check_split(model, moved)
            self._check_content(model)

    def _check_split(self, model: CacheModel, before: MovementCounters) -> None:
        """A first resume with no page moved since ``create`` (equal movement counters: the matched pages are
        where the probe found them) onboards and copies what ``probe_reuse_by_tier`` said then."""
        split_at_create, model.split_at_create = model.split_at_create, None
        if split_at_create is None or split_at_create[1] != before:
            return
        split, after = split_at_create[0], self.manager.movement_counters
        assert after.onboarded_pages - before.onboarded_pages == sum(split.onboard_pages), (split, before, after)
        assert after.copied_pages - before.copied_pages == sum(split.copied_pages), (split, before, after)

    def resize(self, index: int, kind: int, amount: int, mode: int) -> None:
        """Grow, shrink, advance history, start the next chunk, or decode one token (``kind``); through
        ``resize`` with ints or NumPy ints, or through the ``capacity`` / ``history_length`` setters (``mode``)."""
        with self._operation("resize"):
            model = pick(self._active(), index)
            if model is None:
                return
            capacity, history = model.capacity, model.history
            limit = self.config.max_capacity
            kind %= RESIZE_KINDS
            new_history: int | None = None
            if kind == 0:
                new_capacity = min(limit, capacity + 1 + amount)
            elif kind == 1:
                new_capacity = max(history, capacity - 1 - amount)
            elif kind == 2:
                new_capacity, new_history = capacity, min(capacity, history + 1 + amount)
            elif kind == 3:
                new_capacity, new_history = min(limit, capacity + 1 + amount), capacity
            else:
                new_capacity, new_history = min(limit, capacity + 1), capacity
            self._resize(model, new_capacity, new_history, mode % RESIZE_MODES)

    def _resize(
        self, model: CacheModel, new_capacity: int, new_history: int | None, mode: int, computed: list[int] | None = None
    ) -> bool:
        """One checked resize, then a FakeEngine step (of ``computed``, the codes the engine computes, where they
        are not the request's own: rejected drafts); False (memory short) must have changed nothing."""
        cache = model.cache
        before, earlier = self.snapshot(), self.manager.last_refusal
        history = model.history if new_history is None else new_history
        if self._stops_inside_scratch(model, history):
            expect_value_error(lambda: cache.resize(new_capacity, new_history), "history stopping inside scratch")
            assert_unchanged(before, self.snapshot(), "history stopping inside scratch")
            self.stats.invalid_moves += 1
            return False
        if cache.has_scratch_slots and new_capacity > model.capacity:
            if not model.capacity - self._rewind <= history <= model.capacity:
                mode = 0  # each chunk must start where the previous one ended: a ValueError, nothing changed
                expect_value_error(lambda: cache.resize(new_capacity, new_history), "growing past scratch blocks")
                assert_unchanged(before, self.snapshot(), "growing past scratch blocks")
                self.stats.invalid_moves += 1
                return False
        if mode == 2 and cache.enable_swa_scratch_reuse and (new_history is None or new_history == model.history):
            mode = 0  # the capacity setter is refused while scratch reuse is on
            expect_value_error(lambda: setattr(cache, "capacity", new_capacity), "capacity setter with scratch reuse")
            assert_unchanged(before, self.snapshot(), "capacity setter with scratch reuse")
        if mode == 2 and (new_history is None or new_history == model.history):
            try:
                cache.capacity = new_capacity
                ok = True
            except OutOfPagesError:
                ok = False
        elif mode == 2 and new_capacity == model.capacity:
            assert new_history is not None
            try:
                cache.history_length = new_history
                ok = True
            except OutOfPagesError:
                ok = False
        elif mode == 1:
            ok = cache.resize(np.int64(new_capacity), None if new_history is None else np.int32(new_history))
        else:
            ok = cache.resize(new_capacity, new_history)
        if not ok:
            self.stats.shortages += 1
            assert_unchanged(before, self.snapshot(), f"resize of cache {cache.id} to {new_capacity} returning False")
            refusal = check_refusal(self.manager, earlier, "KVCache.resize", cache, asked=(new_capacity, history))
            if not self._stop_and_retry(model, refusal, history, lambda: cache.resize(new_capacity, new_history)):
                return False
        model.capacity = new_capacity
        if new_history is not None:
            model.history = new_history
        assert lengths_of(cache) == model.lengths, (cache, model.lengths)
        before_checked = self.engine.tokens_checked
        self._step(model, computed)
        self.stats.tokens_checked += self.engine.tokens_checked - before_checked
        return True

    def _stop_and_retry(self, model: CacheModel, refusal: Refusal, history: int, retry: Callable[[], bool]) -> bool:
        """Every other refusal of a cache whose computed tokens up to ``history`` (the step's) are not all committed:
        ``stop_committing()``, the way out ``Refusal.own_stale_pages`` names, then the refused call again. It must
        fit exactly when the refusal named such pages: a refusal naming none must not be one that
        ``stop_committing()`` turns into a fit (nor one naming them one it does not). Returns whether it fitted."""
        if model.stopped or model.committed >= history or self.stats.shortages % 2:
            return False
        model.cache.stop_committing()
        model.stopped = True
        self.stats.stale_retries += 1
        fitted = retry()
        assert fitted == (refusal.own_stale_pages > 0), f"after stop_committing the refused call fitted: {fitted}, {refusal}"
        self.stats.stale_rescues += fitted
        return fitted

    def serve(self, index: int, chunk: int) -> None:
        """One engine step for a request: resume if needed, then a prefill chunk of at most ``chunk + 1`` prompt
        tokens (or one decode token), FakeEngine step, and commit of everything computed."""
        with self._operation("serve"):
            model = pick(self.live, index)
            if model is None:
                return
            if not model.active:
                before, earlier = self.snapshot(), self.manager.last_refusal
                moved = self.manager.movement_counters
                if not model.cache.resume():
                    self.stats.shortages += 1
                    assert_unchanged(before, self.snapshot(), f"resume of cache {model.cache.id} returning False")
                    refusal = check_refusal(self.manager, earlier, "KVCache.resume", model.cache)
                    if not self._stop_and_retry(model, refusal, model.history, model.cache.resume):
                        return
                model.active = True
                self._check_split(model, moved)
                self._check_content(model)
            history = model.history
            if history < model.prompt_length:
                target = min(model.prompt_length, history + 1 + chunk)
                if chunk % 4:  # as an engine does, mostly: the chunk ends at the next snapshot point
                    target = next((point for point in model.cache.snapshot_points if history < point < target), target)
            elif self.config.ssm and chunk % 3 == 2 and not model.stopped and model.capacity == history:
                self._speculate(model, chunk)
                return
            else:
                target = history + 1
            target = min(max(target, model.capacity), self.config.max_capacity)
            if target > model.capacity and not self._resize(model, target, None, chunk % RESIZE_MODES):
                return
            if not model.stopped:
                tokens = model.tokens[model.committed : model.capacity]
                split = len(tokens) // 2 if chunk % 2 else 0  # a chunk committed in two calls
                if split and self._stops_inside_scratch(model, max(model.history, model.committed + split)):
                    before = self.snapshot()
                    expect_value_error(lambda: model.cache.commit(tokens[:split]), "commit stopping inside scratch")
                    assert_unchanged(before, self.snapshot(), "commit stopping inside scratch")
                    split = 0  # so the chunk is committed in one call
                if split:
                    model.cache.commit(tokens[:split])
                # Now and then the engine asks for a snapshot where the step ends (inside a block too).
                model.cache.commit(tokens[split:], save_ssm_snapshot=self.config.ssm and chunk % 5 == 0)
                model.committed = model.capacity
                model.history = model.capacity
                self._check_content(model)

    def _speculate(self, model: CacheModel, chunk: int) -> None:
        """A speculative decoding step of an SSM model: the last token and up to 4 drafts computed, those
        accepted committed (a draft rejected has another token: its K/V and the live states computed from
        it are wrong), the live states set back to the accepted tokens by the engine, the capacity rewound to them
        (or, now and then, the request closed at once). A snapshot taken of the drafts' states fails the check of a
        later request reusing it."""
        target = min(model.history + 2 + chunk % 4, self.config.max_capacity)
        if target <= model.history:
            return
        end = model.history + 1 + (chunk // 12) % (target - model.history)
        self._extend_tokens(model, target)
        codes = model.engine_tokens
        if not self._resize(model, target, None, chunk % RESIZE_MODES, codes[:end] + [c ^ 1 for c in codes[end:target]]):
            return
        model.cache.commit(model.tokens[model.committed : end])
        model.committed = model.history = end
        if end < target and chunk % 2:  # the request ends among the accepted tokens: closed with the drafts' states
            self.close(self.live.index(model) + len(self.live) * (chunk // 12))
            return
        self.engine.accept_states(model.cache, codes)
        model.computed = end
        if end < target:
            assert model.cache.resize(end), f"rewinding cache {model.cache.id} to {end} tokens was refused"
            model.capacity = end
        self._check_content(model)

    def commit(self, index: int, count: int, flags: int) -> None:
        with self._operation("commit"):
            model = pick([m for m in self.live if m.active and not m.stopped], index)
            if model is None:
                return
            room = model.capacity - model.committed
            number = room if count >= COUNT_MAX else count % (room + 1)  # COUNT_MAX: everything computed
            tokens = model.tokens[model.committed : model.committed + number]
            if self._stops_inside_scratch(model, max(model.history, model.committed + number)):
                before = self.snapshot()
                expect_value_error(lambda: model.cache.commit(tokens), "commit stopping inside scratch")
                assert_unchanged(before, self.snapshot(), "commit stopping inside scratch")
                self.stats.invalid_moves += 1
                return
            model.cache.commit(token_arg(tokens, bool(flags & 1)))
            model.committed += number
            model.history = max(model.history, model.committed)
            assert lengths_of(model.cache) == model.lengths, (model.cache, model.lengths)
            self._check_content(model)

    def stop_committing(self, index: int) -> None:
        with self._operation("stop_committing"):
            model = pick(self.live, index)
            if model is None:
                return
            model.cache.stop_committing()
            model.stopped = True
            assert model.cache.is_committing_stopped
            plan = model.cache.plan_committed_block_drop()
            if plan is not None:  # kept undropped: ``drop_in_cycle`` lets the collector apply it
                self.plans.append((plan, model))
            if model.active:
                self._check_content(model)

    def _save_last_snapshot(self, model: CacheModel) -> None:
        """A turn's end keeping its last SSM state for the next turn: refused, changing nothing, unless every
        computed token is committed (the live state is the state after all of them)."""
        if model.committed != model.capacity:
            before = self.snapshot()
            expect_value_error(
                lambda: model.cache.stop_committing(save_last_ssm_snapshot=True), "saving a snapshot short of capacity"
            )
            assert_unchanged(before, self.snapshot(), "saving a snapshot short of capacity")
            return
        model.cache.stop_committing(save_last_ssm_snapshot=True)
        model.stopped = True

    def suspend(self, index: int) -> None:
        with self._operation("suspend"):
            model = pick(self.live, index)
            if model is None:
                return
            if not model.active:
                before = self.snapshot()
                model.cache.suspend()  # already suspended: a no-op
                assert_unchanged(before, self.snapshot(), f"suspend of suspended cache {model.cache.id}")
                return
            model.cache.suspend()
            model.active = False
            assert model.cache.status == KVCacheStatus.SUSPENDED
            self._check_buffers(model)  # still registered, and every entry -1

    def place(self, index: int, mode: int) -> None:
        """A placement hint on a suspended cache (mode 0: offload, 1: prefetch into free slots, 2: prefetch that
        evicts; for an odd ``index`` the prefetch is ``prefetch(level)``, a level drawn from ``index`` (0 when it
        evicts), whose False must leave its reason, its figures those of that moment): every
        active cache keeps its pages where they are and its content (a later resume of the hinted cache checks its
        own)."""
        with self._operation("place"):
            model = pick([candidate for candidate in self.live if not candidate.active], index)
            if model is None:
                return
            active = [candidate.cache for candidate in self._active()]
            before = {key: value for key, value in snapshot(self.manager, active, []).items() if key.startswith("cache ")}
            cache = model.cache
            if mode and index % 2:  # TensorRT-LLM's form, the same moves: a False is a refusal, explained
                earlier = self.manager.last_refusal
                levels = len(internals_of(self.manager).store.tiers)
                target = 0 if mode == 2 else (index // 2) % levels  # an evicting prefetch goes to the GPU only
                if not cache.prefetch(target, evict=mode == 2):
                    refusal = check_refusal(self.manager, earlier, "KVCache.prefetch", cache)
                    assert refusal.level == target and refusal.pages_needed > 0, refusal
            else:
                moved = cache.offload() if mode == 0 else cache.prefetch(evict=mode == 2)
                assert moved >= 0
            after = {key: value for key, value in snapshot(self.manager, active, []).items() if key.startswith("cache ")}
            assert before == after, f"placement hint {mode} on cache {cache.id} changed an active cache"
            for candidate in self._active():
                self._check_content(candidate)

    def close(self, index: int) -> None:
        with self._operation("close"):
            model = pick(self.live, index)
            if model is None:
                return
            if self.config.ssm and index % 3 == 1 and not model.stopped:
                self._save_last_snapshot(model)
            model.cache.close()
            assert model.cache.status == KVCacheStatus.CLOSED
            if index % 2:
                model.cache.close()  # idempotent
            self.live.remove(model)
            model.active = False
            for buffer in model.buffers.values():
                assert (buffer == BAD_PAGE_INDEX).all(), f"cache {model.cache.id}: buffer not cleared on close"
            model.buffers.clear()
            self.closed = (self.closed + [model])[-4:]
            assert self.manager.num_live_caches == len(self.live)
