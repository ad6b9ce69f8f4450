"""The fuzzer's world: one manager, a ``FakeEngine`` and a model of every cache it created, with the helpers and
the after-every-operation checks all operations share (see ``tests/fuzz/driver.py``)."""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    KVCacheManager,
    KVCacheStatus,
    PlannedDropHandle,
    ReuseScope,
    SsmLayerConfig,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2._base.types import PageContentLostError
from kv_cache_manager_v2._introspection import kept_input_tokens, state_of
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import Probe, check_default_split, check_refusal, snapshot
from tests.fuzz.configs import FuzzConfig
from tests.fuzz.event_replay import EventReplay
from tests.fuzz.faulty_tiers import FlakyCodec
from tests.fuzz.flaky_store import FlakyStoreConfig
from tests.fuzz.log_watch import LogWatch
from tests.fuzz.limits import MAX_LIVE_CACHES, MULTIMODAL_OFFSET, SCOPES
from tests.fuzz.model import CacheModel, FuzzInterrupt, FuzzStats, Token, lengths_of, same_scope, scope_context
from kv_cache_manager_v2.testing import contextual_tokens


class FuzzWorld:
    """One manager, its FakeEngine and the model of every cache; the operations (``Fuzzer``'s bases) share
    these helpers and checks."""

    def __init__(self, config: FuzzConfig) -> None:
        self.config = config
        self.directory: str | None = tempfile.mkdtemp(prefix="kvcm-fuzz-") if config.needs_directory else None
        try:
            self.codec: FlakyCodec | None = None if config.cold_page_bytes is None else FlakyCodec(config.cold_page_bytes)
            # KV events on: ``check`` replays them as a subscriber would (``event_replay``), faults included.
            built = dataclasses.replace(config.build(self.directory or ""), enable_kv_events=True)
            self.manager: KVCacheManager = KVCacheManager(built, cold_page_codec=self.codec)
        except BaseException:
            self._remove_directory()
            raise
        check_default_split(self.manager)
        self.engine: FakeEngine = FakeEngine(self.manager, config.index_mode)
        self.log_watch: LogWatch = LogWatch(self.manager)  # a warning's handler calls the manager (log_watch.py)
        self.events: EventReplay = EventReplay(self.manager)
        self.tpb: int = self.manager.tokens_per_block
        self.max_blocks: int = math.ceil(config.max_capacity / self.tpb)
        self.quotas: list[int] = [self.manager.get_quota(level) for level in range(self.manager.num_cache_levels)]
        self._windows = [self.manager.get_layer_window(group[0]) for group in self.manager.layer_grouping]
        self._rewind = self.manager.config.max_rewind_len
        self._ssm_groups = {
            int(self.manager.get_layer_group_id(layer.layer_id))
            for layer in self.manager.config.layers
            if isinstance(layer, SsmLayerConfig)
        }
        self.live: list[CacheModel] = []
        self.closed: list[CacheModel] = []
        # Planned drops of finished turns, not dropped yet, with the turn's cache.
        self.plans: list[tuple[PlannedDropHandle, CacheModel]] = []
        self.stats: FuzzStats = FuzzStats()
        self.broken: bool = False  # set after a failure: teardown then only releases what it can
        self.interrupted: bool = False  # an interrupt came out of a call since the last ``check``
        self.last_operation: str = ""
        self._next_token = 1000
        self._next_id = 1_000_000
        tpb = self.tpb
        image = gen_multimodal_cache_key_tokens(MULTIMODAL_OFFSET, b"image-0".ljust(32, b"."), tpb)
        if self.manager.config.text_only:  # it refuses multimodal tokens: its third prefix is text alone
            image = []
        self.shared_prefixes: list[list[Token]] = [
            self._fresh(3 * tpb),
            self._fresh(2 * tpb + 5),
            self._fresh(tpb // 2) + image + self._fresh(tpb),
            self._fresh(5 * tpb + 3),
        ]
        self.recent: list[list[Token]] = []  # token lists of recent caches (multi-turn prefixes)
        remote = self.manager.config.remote_tier
        backend = remote.backend if remote is not None else None
        self.store: FlakyStoreConfig | None = backend if isinstance(backend, FlakyStoreConfig) else None
        self.remote: bool = remote is not None  # a remote tier (the flaky store, or Mooncake: tests/test_misuse_twin.py)
        self.twins: dict[int, KVCacheManager] = {}  # other instances sharing the store, by kind (twin_serves)
        self.twin_events: dict[int, EventReplay] = {}  # each twin's events, replayed like the world's
        try:
            self._warm_up()
        except BaseException:
            self.broken = True
            self.teardown()
            raise

    def _warm_up(self) -> None:
        """Compute and commit the shared prefixes once (like system prompts), so reuse starts at step one."""
        prompts: list[Probe] = [(None, prefix) for prefix in self.shared_prefixes]
        prompts.append((SCOPES[2], self.shared_prefixes[0]))
        for scope, prefix in prompts:
            cache = self.manager.create_kv_cache(scope, prefix)
            reused = cache.num_committed_tokens
            assert cache.resume() and cache.resize(len(prefix)), "a shared prefix must fit an empty manager"
            self.engine.step(cache, contextual_tokens(prefix, scope_context(scope)))
            cache.commit(prefix[reused:])
            cache.close()
            reusable = self.config.prefixes_reusable and len(prefix) >= self.tpb
            assert self.manager.probe_reuse(scope, prefix) > 0 or not reusable
        self.manager.check_invariants()

    # ---------------------------------------------------------------------------------------------- helpers
    def _fresh(self, count: int) -> list[Token]:
        tokens: list[Token] = list(range(self._next_token, self._next_token + count))
        self._next_token += count
        return tokens

    def _stops_inside_scratch(self, model: CacheModel, history: int) -> bool:
        """While a cache has scratch blocks, its history may move only to ``capacity - max_rewind_len`` or
        further: the blocks in between live only in scratch slots and cannot become history."""
        cache = model.cache
        return cache.has_scratch_slots and history != model.history and history < model.capacity - self._rewind

    def _unused_id(self) -> int:
        """A cache id no live cache has (the manager's automatic ids follow explicit ones, so skip them)."""
        live_ids = {model.cache.id for model in self.live}
        while self._next_id in live_ids:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def _remove_directory(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    @contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        self.stats.operations += 1
        self.stats.by_operation[name] = self.stats.by_operation.get(name, 0) + 1
        try:
            yield
        except PageContentLostError:  # a disk or codec fault lost pages a suspended cache needs: recompute it
            self._close_lost_caches()
        except FuzzInterrupt:  # a codec or store interrupted a call, which completed first
            self._follow_interrupted_call()
        except BaseException:
            self.broken = True
            raise

    def _follow_interrupted_call(self) -> None:
        """The engine's view after an interrupt that came out of a completed call: each cache's status, lengths
        and commit state as it reports them (the operation's own bookkeeping after the call never ran); a cache
        the call closed joins the closed ones. A handle the interrupted operation made but never kept goes with
        the traceback: ``check`` collects it, and its cache is closed by the next call. A step that ran past the
        reported history (the interrupt came out of a commit of part of it) is computed again from that history.
        With SSM layers, where history moves only by committing, the engine also finishes what the call was for: a
        cache stopped committing (only ever on its way to close) is closed, a computed step is committed."""
        self.stats.interrupts += 1
        self.interrupted = True
        for model in list(self.live):
            cache = model.cache
            if cache.status == KVCacheStatus.CLOSED:
                self.live.remove(model)
                self.closed.append(model)
                model.buffers.clear()
                continue
            model.active = cache.is_active
            model.capacity, model.history, model.committed = lengths_of(cache)
            model.stopped = cache.is_committing_stopped
            if self.config.ssm and model.stopped:  # it stops committing only to close (``_save_last_snapshot``)
                try:
                    cache.close()
                except FuzzInterrupt:  # completed first, as every interrupted call
                    self.stats.interrupts += 1
                self.live.remove(model)
                self.closed.append(model)
                model.active = False
                model.buffers.clear()
                continue
            if model.active:  # the step a completed resize was for never ran: the engine runs it now
                if model.computed > model.history:
                    # It ran, and the interrupt came out of a commit of part of it (a chunk committed in two, a
                    # speculative step's accepted tokens): the engine computes again from the history the manager
                    # reports, its SSM live states set back to that history's (it keeps a state per step).
                    self.engine.accept_states(cache, model.engine_tokens)
                self._step(model)
                if self.config.ssm and model.history < model.capacity:  # its history moves by committing only
                    try:
                        cache.commit(model.tokens[model.committed : model.capacity])
                    except FuzzInterrupt:  # completed first, as every interrupted call
                        self.stats.interrupts += 1
                    model.capacity, model.history, model.committed = lengths_of(cache)

    def _follow_recall(self, model: CacheModel) -> None:
        """A batch-admitted cache whose lengths have not moved since admission may have had its history taken back
        (never below its commits): rows an earlier request of its batch was to compute were recalled when that one
        was cut, suspended or closed first. The engine computes them in the cache's next step, as told."""
        if model.borrowed_at is None:
            return
        if model.history > model.borrowed_at[0] or model.committed > model.borrowed_at[1]:
            model.borrowed_at = None  # its own step ran: whatever it borrowed was written in the same forward
            return
        history = model.cache.history_length
        if history < model.history:
            assert model.committed <= history, (model.cache, model.lengths)
            self.stats.recalls += 1
            model.history = history
            model.borrowed_at = (history, model.committed)

    def _close_lost_caches(self) -> None:
        """The engine's answer to ``PageContentLostError``: close each suspended cache whose pages were lost. An
        active cache may hold lost pages it does not read (uncommitted ones in its stale range, evicted meanwhile):
        its own next resume raises; ``check`` makes sure it reads none."""
        for model in list(self.live):
            if not model.active and any(page.lost for page in state_of(model.cache).held_pages()):
                model.cache.close()
                self.live.remove(model)
                model.buffers.clear()
        self.stats.lost_caches += 1

    def _probes(self) -> list[Probe]:
        probes: list[Probe] = [(None, prefix) for prefix in self.shared_prefixes]
        probes.extend((SCOPES[2], prefix) for prefix in self.shared_prefixes[:2])
        probes.extend((model.scope, model.tokens[: model.capacity]) for model in self.live[-2:])
        return probes

    def snapshot(self) -> dict[str, object]:
        return snapshot(self.manager, [model.cache for model in self.live], self._probes())

    def _active(self) -> list[CacheModel]:
        return [model for model in self.live if model.active]

    def _extend_tokens(self, model: CacheModel, length: int) -> None:
        if len(model.tokens) < length:
            model.tokens.extend(self._fresh(length - len(model.tokens)))

    def _step(self, model: CacheModel, codes: list[int] | None = None) -> None:
        """The engine's step over ``model``'s rows up to its capacity (of ``codes`` where they are not the request's
        own: rejected drafts), recorded in ``model.computed``: every step goes through here, so an interrupt out of
        a commit of part of it finds the live states where the step left them (``_follow_interrupted_call``)."""
        self._extend_tokens(model, model.capacity)
        self.engine.step(model.cache, model.engine_tokens if codes is None else codes)
        model.computed = model.capacity

    def _check_content(self, model: CacheModel) -> None:
        """The FakeEngine's check of every history row of an active cache; one suspended before its first step (a
        preempted batch request) runs that step first, as the engine does once the cache is back."""
        before = self.engine.tokens_checked
        if model.step_skipped and model.active:
            model.step_skipped = False
            self._step(model)
        self.engine.check(model.cache, model.engine_tokens)
        self.stats.tokens_checked += self.engine.tokens_checked - before

    def _reuse_lower_bound(self, scope: ReuseScope | None, prompt: list[Token]) -> int:
        """Full attention only: blocks committed by a live cache are held, so a prompt sharing them reuses them."""
        if not self.config.full_attention_only or self.manager.movement_counters.lost_pages:
            return 0  # and not once a page was lost: it leaves the tree while its cache still holds it
        tpb = self.tpb
        best = 0
        for model in self.live:
            if not same_scope(model.scope, scope):
                continue
            blocks = 0
            while (
                blocks < model.committed // tpb
                and blocks < len(prompt) // tpb
                and model.tokens[blocks * tpb : (blocks + 1) * tpb] == prompt[blocks * tpb : (blocks + 1) * tpb]
            ):
                blocks += 1
            best = max(best, blocks * tpb)
        return best

    def enabled(self, operation: str) -> bool:
        if operation in ("store_fault", "restart_store"):
            return self.store is not None
        if operation == "disk_fault":
            return self.directory is not None and bool(self.live) and os.path.isdir("/proc/self/fd")
        if operation == "codec_fault":
            return self.codec is not None
        if operation == "refetch":
            return self.store is not None and bool(self.closed) and len(self.live) < MAX_LIVE_CACHES
        if operation == "twin_serves":
            return self.store is not None and bool(self.closed)
        if operation == "create_batch" and self.remote:
            return False  # fetched blocks stay cached when a batch refuses: its nothing-changed checks do not apply
        if self.config.ssm and operation in ("resize", "commit", "stop_committing"):
            return False  # history moves only by serve: compute, then commit what was computed
        if operation == "fan_out":
            return len(self.live) <= 1 and self.manager.enable_partial_match
        if operation in ("create", "create_batch"):
            return len(self.live) < MAX_LIVE_CACHES
        if operation in ("resume", "stop_committing", "suspend", "close", "serve", "register_buffer"):
            return bool(self.live)
        if operation == "place":
            return any(not model.active for model in self.live)
        if operation in ("resize", "held_call"):
            return any(model.active for model in self.live)
        if operation == "commit":
            return any(model.active and not model.stopped for model in self.live)
        if operation in ("misbehave", "reenter"):
            return any(model.callback is not None for model in self.live)
        if operation == "drop_in_cycle":
            return bool(self.live)
        if operation == "copy_handle":
            return bool(self.live or self.closed)
        if operation == "invalid_move":
            return bool(self.live)
        return True

    # ------------------------------------------------------------------------------------------- shared steps
    def _suspend_all(self) -> None:
        for model in self._active():
            model.cache.suspend()
            model.active = False

    def _assert_no_statistics(self, what: str) -> None:
        for stats in self.manager.get_iteration_stats():
            counted = (stats.allocated_pages, stats.reused_full_blocks, stats.reused_partial_blocks, stats.missed_blocks)
            assert counted == (0, 0, 0, 0), f"{what} counted statistics: {stats}"

    def _reset_lookup_counts(self) -> None:
        """Zero the counters ``_check_lookups_counted`` reads."""
        self.manager.get_iteration_stats()
        self.manager.get_and_reset_ssm_snapshot_iteration_stats()

    def _check_lookups_counted(self, created: list[tuple[bool, bool, int]], what: str) -> None:
        """Since ``_reset_lookup_counts``, the caches ``created`` as (lookup, preempted, prompt length) counted
        their lookups where their flags say: none for ``lookup=False`` (a save), a readmission's apart; each SSM
        layer group counts one snapshot lookup per cache with a prompt."""
        new = [length for lookup, preempted, length in created if lookup and not preempted]
        again = [length for _, preempted, length in created if preempted]
        for stats in self.manager.get_iteration_stats():
            if not new:
                assert stats.reused_full_blocks + stats.reused_partial_blocks + stats.missed_blocks == 0, (what, stats)
            if not again:
                assert stats.preempted_reused_blocks + stats.preempted_missed_blocks == 0, (what, stats)
        ssm = self.manager.get_and_reset_ssm_snapshot_iteration_stats()
        if not self.manager.config.enable_stats:
            return
        expected = (sum(1 for length in new if length), sum(1 for length in again if length))
        assert all((d.iter_snapshot_lookups, d.iter_preempted_snapshot_lookups) == expected for d in ssm.values()), (what, ssm)
        if self.config.ssm:
            assert bool(ssm) == any(expected), (what, ssm, expected)

    def _grow_or_resume(self, model: CacheModel, new_capacity: int) -> bool:
        """Grow an active cache by one chunk (or resume a suspended one) and follow in the model; False: short."""
        cache = model.cache
        earlier = self.manager.last_refusal
        if not (cache.resize(new_capacity, model.capacity) if model.active else cache.resume()):
            self.stats.shortages += 1
            if model.active:
                check_refusal(self.manager, earlier, "KVCache.resize", cache, asked=(new_capacity, model.capacity))
            else:
                check_refusal(self.manager, earlier, "KVCache.resume", cache)
            return False
        self._follow_growth(model, new_capacity)
        return True

    def _follow_growth(self, model: CacheModel, new_capacity: int) -> None:
        """After a granted resume (check the content) or growth (the engine computes the chunk) of ``model``."""
        cache = model.cache
        if not model.active:
            model.active = True
            self._check_content(model)
            return
        model.history = model.capacity
        model.capacity = new_capacity
        self._step(model)
        if self.config.ssm:
            cache.commit(model.tokens[model.committed : model.capacity])
            model.committed = model.history = model.capacity

    # ------------------------------------------------------------------------------------------------ checks
    def _check_buffers(self, model: CacheModel) -> None:
        """Registered buffers equal the page indices then -1 while active, and are all -1 while suspended."""
        for lg, buffer in model.buffers.items():
            expected = list(model.cache.get_base_page_indices(lg)) if model.active else []
            expected += [BAD_PAGE_INDEX] * (len(buffer) - len(expected))
            assert buffer.tolist() == expected, (model.cache.id, lg, buffer.tolist(), expected)

    def _stale_range(self, layer_group: int, history: int) -> tuple[int, int]:
        """The blocks a layer group no longer needs at ``history`` (past the sink blocks, before the first
        block the window still reads), from the public window of the group's first layer."""
        window, sinks = self._windows[layer_group]
        start = min(-(-history // self.tpb), -(-sinks // self.tpb))
        if window == 0:
            return start, start
        return start, max(start, (history + 1 - window) // self.tpb)

    def _check_page_table(self, model: CacheModel) -> None:
        """An active cache has a page exactly outside the stale range (and scratch blocks) of each layer group."""
        for lg in range(self.manager.num_layer_groups):
            indices = model.cache.get_base_page_indices(lg)
            assert len(indices) == model.cache.num_blocks, (lg, len(indices), model.cache)
            if lg in self._ssm_groups:  # one live state slot, no per-block pages
                assert all(slot == BAD_PAGE_INDEX for slot in indices), (lg, list(indices))
                assert model.cache.get_ssm_block_base_index(lg) >= 0, (lg, model.cache)
                continue
            stale_beg, stale_end = self._stale_range(lg, model.history)
            scratch = model.cache.get_scratch_desc(lg)
            scratch_beg, scratch_end = (0, 0) if scratch is None else (scratch.range.beg, scratch.range.end)
            for ordinal, slot in enumerate(indices):
                stale = stale_beg <= ordinal < stale_end or scratch_beg <= ordinal < scratch_end
                assert (slot < 0) == stale, f"cache {model.cache.id} layer group {lg} block {ordinal}: slot {slot}"

    def check(self) -> None:
        """After every operation: invariants, slot accounting, the model, page tables (stale ranges, registered
        buffers) and content of every active cache."""
        if self.interrupted:  # the interrupt's traceback may keep a dropped handle in a cycle
            self.interrupted = False
            gc.collect()
        self.manager.check_invariants()
        self.events.check(self.manager)
        for kind, twin in self.twins.items():
            twin.check_invariants()
            self.twin_events[kind].check(twin)
        self._check_late_transfers()
        assert self.manager.num_live_caches == len(self.live), (self.manager.num_live_caches, len(self.live))
        for level in range(self.manager.num_cache_levels):
            for stats in self.manager.get_storage_statistics(level):
                assert stats.available == stats.free + stats.evictable, (level, stats)
                assert stats.available + stats.unavailable == stats.total and stats.free <= stats.total, (level, stats)
        for model in self.live:
            cache = model.cache
            self._follow_recall(model)
            status = KVCacheStatus.ACTIVE if model.active else KVCacheStatus.SUSPENDED
            assert cache.status == status, (cache, status)
            assert lengths_of(cache) == model.lengths, (cache, model.lengths)
            assert cache.is_committing_stopped == model.stopped
            assert cache.num_blocks == math.ceil(model.capacity / self.tpb)
            # What a handoff compares: the commits, then the input copy, kept only until the commits cover it.
            assert state_of(cache).known_tokens() == model.tokens[: max(model.committed, model.prompt_length)], cache
            assert (kept_input_tokens(cache) == 0) == (model.committed >= model.prompt_length), (cache, model.prompt_length)
            if model.active:
                assert not any(page.lost for page in state_of(cache).live_entries()), f"cache {cache.id} reads a lost page"
                self._check_page_table(model)
                self._check_buffers(model)
                self._check_content(model)

    def teardown(self, shut_down: bool = True) -> None:
        """Close everything; unless an operation failed, check nothing is left held and everything can be freed.
        ``shut_down=False`` leaves the manager to the collector, as an engine dropping it would (``tools/soak.py``
        then checks that no descriptor or thread outlives it)."""
        if self.codec is not None:
            self.codec.interrupts = self.codec.failures = 0
        if self.store is not None:
            self.store.faults.clear()
            if not shut_down:  # a manager left to the collector never closes its store: no call may stay stalled
                for client in self.store.clients:
                    client.complete_late()
        try:
            if not self.broken:
                self._close_everything_and_check(shut_down)
                return
            for model in self.live:  # already failing: release what can be released
                try:
                    model.cache.close()
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self.log_watch.close()
            self.live = []
            for twin in self.twins.values():
                twin.shutdown()
            self.twins, self.twin_events = {}, {}
            for client in [] if self.store is None else self.store.clients:  # a broken world's stalls, too
                client.complete_late()
            self._remove_directory()

    def _close_everything_and_check(self, shut_down: bool) -> None:
        for model in self.live:
            model.cache.close()
            self.manager.check_invariants()
        levels = range(self.manager.num_cache_levels)
        for level in levels:
            for stats in self.manager.get_storage_statistics(level):
                assert stats.unavailable == 0, f"level {level} after closing every cache: {stats}"
        self.manager.clear_reusable_blocks()
        self.manager.check_invariants()
        for level in levels:
            for stats in self.manager.get_storage_statistics(level):
                assert stats.free == stats.total, f"level {level} after clear_reusable_blocks: {stats}"
        if shut_down:
            self.manager.shutdown()
            for twin in self.twins.values():
                twin.shutdown()
            self.twins, self.twin_events = {}, {}
            self._check_late_transfers()

    def _check_late_transfers(self) -> None:
        """A store call stalled past its deadline was a miss; completing late, it touched no freed buffer and stored
        what its caller handed it (``stalled_transfers``)."""
        problems = [] if self.store is None else self.store.problems()
        assert not problems, problems
