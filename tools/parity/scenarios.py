"""The ``workload`` scenario of ``tools/mode_parity.py`` and the transcript every scenario returns: ``[label,
outcome]`` per observation (``describe.outcome``), from seeded randomness only so both modes make the same calls."""

from __future__ import annotations

import dataclasses
import random
import tempfile
from typing import Any, Callable

import numpy as np

from kv_cache_manager_v2 import (
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRequest,
    KVCacheStatus,
    ReuseScope,
)
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.configs import CONFIGS, FuzzConfig
from tests.fuzz.faulty_tiers import FlakyCodec
from tools.parity.describe import outcome

Transcript = list[list[object]]
BAD_INTS: tuple[object, ...] = (-1, True, 1.5, "3", None, np.float64(2.0), 2**63)


class Recorder:
    """Appends each call's outcome to the transcript under a label."""

    def __init__(self, transcript: Transcript) -> None:
        self.transcript = transcript

    def __call__(self, label: str, call: Callable[[], object]) -> object:
        described, result = outcome(call)
        self.transcript.append([label, described])
        return result


class WorkloadWorld:
    """One manager of a fuzz config under random public calls, some with NumPy integers or bad arguments."""

    def __init__(self, config: FuzzConfig, directory: str, rng: random.Random, record: Recorder) -> None:
        built = dataclasses.replace(config.build(directory), enable_kv_events=True)
        codec = None if config.cold_page_bytes is None else FlakyCodec(config.cold_page_bytes)
        self.event_manager = KVCacheEventManager(10_000)
        self.manager = KVCacheManager(built, cold_page_codec=codec, event_manager=self.event_manager)
        self.engine = FakeEngine(self.manager)
        self.rng = rng
        self.record = record
        self.max_capacity = config.max_capacity
        self.bases = [[(seed * 7919 + i * 104_729) % 30_000 for i in range(config.max_capacity)] for seed in range(3)]
        self.caches: list[tuple[KVCache, list[int]]] = []

    def number(self, value: int) -> Any:
        """``value``, sometimes as a NumPy integer (accepted wherever an int is), rarely a bad argument."""
        draw = self.rng.random()
        if draw < 0.04:
            return self.rng.choice(BAD_INTS)
        if draw < 0.3:
            return self.rng.choice((np.int64, np.int32, np.uint32))(value)
        return value

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)
        cut = self.rng.randint(0, len(base) // 2)
        suffix = [self.rng.randint(0, 30_000) for _ in range(self.rng.randint(0, 24))]
        return (base[:cut] + suffix)[: self.max_capacity // 2 + 1]

    def pick(self) -> tuple[KVCache, list[int]] | None:
        return self.rng.choice(self.caches) if self.caches else None

    def observe_cache(self, label: str, cache: KVCache) -> None:
        self.record(f"{label} state", lambda: (
            cache.id, cache.status, cache.capacity, cache.history_length, cache.num_committed_tokens,
            cache.is_committing_stopped, cache.is_active, cache.snapshot_points, cache.num_blocks, cache.beam_width,
            cache.tokens_per_block, cache.text_only, cache.reuse_scope, cache.held_for, cache.last_refusal,
        ))
        if cache.status == KVCacheStatus.CLOSED:
            return
        self.record(f"{label} committed_tokens", lambda: cache.committed_tokens)
        for group in range(self.manager.num_layer_groups):
            self.record(f"{label} base indices {group}", lambda: cache.get_base_page_indices(group))
            self.record(f"{label} aggregated {group}", lambda: cache.get_aggregated_page_indices(group))
            self.record(f"{label} scratch {group}", lambda: cache.get_scratch_desc(group))
            self.record(f"{label} front removed {group}", lambda: cache.get_num_front_blocks_removed(group))
            self.record(f"{label} ssm base {group}", lambda: cache.get_ssm_block_base_index(group))

    def step(self) -> None:
        operation = self.rng.choices(
            ("create", "resume", "serve", "resize", "suspend", "close", "stop", "prefetch", "offload", "batch",
             "probe", "query", "quota", "stats", "drop_plan"),
            (4, 3, 8, 2, 2, 2, 0.5, 1, 0.5, 1, 1, 2, 0.5, 1, 0.3),
        )[0]
        getattr(self, f"op_{operation}")()

    def op_create(self) -> None:
        tokens = self.prompt()
        scope = self.rng.choice((None, None, ReuseScope(1), ReuseScope(2, "tenant")))
        cache_id = self.number(len(self.caches) + 100) if self.rng.random() < 0.3 else None
        cache = self.record("create", lambda: self.manager.create_kv_cache(scope, tokens, id=cache_id))
        if isinstance(cache, KVCache):
            self.caches.append((cache, tokens))
            self.observe_cache("created", cache)

    def op_resume(self) -> None:
        if (picked := self.pick()) is not None:
            cache, _ = picked
            self.record("resume", cache.resume)
            self.observe_cache("resumed", cache)

    def op_serve(self) -> None:
        """resize by a chunk (decode tokens drawn when past the prompt), compute, commit."""
        if (picked := self.pick()) is None:
            return
        cache, tokens = picked
        if cache.status != KVCacheStatus.ACTIVE:
            return
        end = min(self.max_capacity, cache.history_length + self.rng.randint(1, 40))
        while len(tokens) < end:
            tokens.append(self.rng.randint(0, 30_000))
        if self.record("serve resize", lambda: cache.resize(self.number(end), self.number(cache.history_length))) is True:
            self.record("serve step", lambda: self.engine.step(cache, tokens))
            self.record("serve commit", lambda: cache.commit(tokens[cache.num_committed_tokens:end]))
        self.observe_cache("served", cache)

    def op_resize(self) -> None:
        if (picked := self.pick()) is not None:
            cache, _ = picked
            capacity = self.rng.randint(0, self.max_capacity)
            self.record("resize", lambda: cache.resize(self.number(capacity)))
            self.observe_cache("resized", cache)

    def op_suspend(self) -> None:
        if (picked := self.pick()) is not None:
            self.record("suspend", picked[0].suspend)

    def op_close(self) -> None:
        if (picked := self.pick()) is not None:
            self.record("close", picked[0].close)
            self.caches.remove(picked)

    def op_stop(self) -> None:
        if (picked := self.pick()) is not None:
            self.record("stop_committing", picked[0].stop_committing)

    def op_prefetch(self) -> None:
        if (picked := self.pick()) is not None:
            target = self.rng.choice((None, 0, self.manager.num_cache_levels - 1))
            evict = self.rng.random() < 0.5
            cache = picked[0]
            self.record("prefetch", lambda: cache.prefetch(evict=evict) if target is None else cache.prefetch(target, evict=evict))

    def op_offload(self) -> None:
        if (picked := self.pick()) is not None:
            self.record("offload", picked[0].offload)

    def op_drop_plan(self) -> None:
        if (picked := self.pick()) is not None:
            plan = self.record("plan_committed_block_drop", picked[0].plan_committed_block_drop)
            drop = getattr(plan, "drop", None)
            if drop is not None:
                self.record("drop", drop)

    def op_batch(self) -> None:
        requests: list[object] = []
        for index in range(self.rng.randint(0, 4)):
            tokens = self.prompt()
            if self.rng.random() < 0.5:
                requests.append(self.record("request", lambda: KVCacheRequest(tokens, capacity=self.number(len(tokens) + index))))
            else:
                requests.append(self.record("request", lambda: KVCacheRequest(tokens, num_new_tokens=self.number(16))))
        made = self.record("create_kv_cache_batch", lambda: self.manager.create_kv_cache_batch(requests))  # type: ignore[arg-type]
        self.record("last_batch_refusals", lambda: self.manager.last_batch_refusals)
        for request, cache in zip(requests, made if isinstance(made, list) else []):
            if isinstance(cache, KVCache) and isinstance(request, KVCacheRequest):
                self.caches.append((cache, list(request.input_tokens)))  # type: ignore[arg-type]
                self.observe_cache("batched", cache)

    def op_probe(self) -> None:
        tokens = self.prompt()
        self.record("probe_reuse", lambda: self.manager.probe_reuse(None, tokens))
        self.record("can_fit", lambda: self.manager.can_fit(self.number(len(tokens)), self.number(self.rng.choice((1, 16, 64)))))
        self.record("max_admissible", lambda: self.manager.max_admissible(self.number(16)))
        self.record("clamp", lambda: self.manager.clamp_max_seq_len_for_mem(self.number(2), self.number(len(tokens))))

    def op_query(self) -> None:
        manager = self.manager
        for label, call in (
            ("layer_grouping", lambda: manager.layer_grouping), ("num_layers", lambda: manager.num_layers),
            ("num_pool_groups", lambda: manager.num_pool_groups), ("all_buffer_ids", lambda: manager.all_buffer_ids),
            ("aggregated_pages", lambda: manager.get_aggregated_pages(manager.all_buffer_ids)),
            ("need_adjustment", lambda: manager.need_adjustment), ("enable_partial_match", lambda: manager.enable_partial_match),
            ("tokens_per_block", lambda: manager.tokens_per_block), ("backend", lambda: manager.backend),
            ("multimodal", lambda: manager.gen_multimodal_cache_key_tokens(b"d" * 32, self.number(3), self.number(1 << 20))),
        ):
            self.record(label, call)
        for layer in manager.config.layers:
            layer_id = layer.layer_id
            self.record("layer_window", lambda: manager.get_layer_window(self.number(layer_id)))
            self.record("layer_group_id", lambda: manager.get_layer_group_id(self.number(layer_id)))
            for buffer in layer.buffers:
                self.record("page_stride", lambda: manager.get_page_stride(layer_id, buffer.role))
                self.record("upper_bound", lambda: manager.get_page_index_upper_bound(layer_id, buffer.role))
                self.record("page_view", lambda: manager.get_page_view(layer_id, buffer.role).shape)
        for group in range(manager.num_layer_groups):
            self.record("pool_group_index", lambda: manager.get_pool_group_index(self.number(group)))
        for pool_group in range(manager.num_pool_groups):
            self.record("slot_bytes", lambda: manager.get_slot_bytes(self.number(pool_group)))

    def op_quota(self) -> None:
        """Quota changes need every cache suspended: suspend them first, mostly."""
        if self.rng.random() < 0.8:
            for cache, _ in self.caches:
                if cache.status == KVCacheStatus.ACTIVE:
                    self.record("suspend for quota", cache.suspend)
        level = self.rng.randrange(self.manager.num_cache_levels)
        quota = self.manager.get_quota(level) * self.rng.choice((1, 2, 3)) // 2
        self.record("manager.resize", lambda: self.manager.resize(self.number(level), self.number(quota), self.rng.random() < 0.5))
        self.record("adjust", self.manager.adjust)

    def op_stats(self) -> None:
        manager = self.manager
        for level in range(manager.num_cache_levels):
            self.record("storage_statistics", lambda: manager.get_storage_statistics(level))
            self.record("quota", lambda: manager.get_quota(level))
        for label, call in (
            ("usage", manager.get_usage), ("iteration_stats", manager.get_iteration_stats),
            ("reset_iteration_stats", manager.get_and_reset_iteration_stats),
            ("ssm_stats", manager.get_and_reset_ssm_snapshot_iteration_stats),
            ("committed_stats", manager.get_committed_stats), ("dirty", manager.get_dirty_stats_kv_cache_ids),
            ("events", manager.get_latest_events), ("movement", lambda: manager.movement_counters),
            ("live", lambda: manager.num_live_caches), ("scopes", lambda: manager.num_reuse_scopes),
            ("last_refusal", lambda: manager.last_refusal), ("remote", manager.get_remote_tier_statistics),
            ("invariants", manager.check_invariants), ("flush", self.event_manager.flush_iteration_events),
            ("trtllm events", self.event_manager.get_latest_events),
        ):
            self.record(label, call)

    def close(self) -> None:
        self.op_stats()
        for cache, _ in self.caches:
            self.record("final close", cache.close)
        self.record("final events", self.manager.get_latest_events)
        self.record("shutdown", self.manager.shutdown)


def workload(seed: int, operations: int) -> Transcript:
    transcript: Transcript = []
    record = Recorder(transcript)
    rng = random.Random(seed)
    for config in CONFIGS:
        with tempfile.TemporaryDirectory() as directory:
            world = WorkloadWorld(config, directory, rng, record)
            transcript.append(["config", config.name])
            for _ in range(max(1, operations // len(CONFIGS))):
                world.step()
            world.close()
    return transcript
