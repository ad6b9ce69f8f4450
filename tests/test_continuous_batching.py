"""A randomized continuous-batching run: hundreds of requests, chunked prefill, preemption by suspension,
resume, shared and multi-turn prefixes — FakeEngine content checks and invariant checks on every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kv_cache_manager_v2 import (
    BatchDesc,
    KVCacheDesc,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2.config import LayerConfig
from tests.helpers import KIB, attention, make_config, ssm

TPB = 16


class Request:
    def __init__(self, tokens: list[int], prompt_length: int) -> None:
        self.tokens = tokens
        self.prompt_length = prompt_length
        self.cache: _KVCache | None = None


def make_requests(rng: random.Random, count: int) -> list[Request]:
    systems = [[rng.randrange(1, 30_000) for _ in range(rng.randrange(20, 80))] for _ in range(4)]
    finished: list[list[int]] = []
    requests = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.3 and finished:
            prefix = rng.choice(finished)  # a later turn of an earlier conversation
        elif roll < 0.7:
            prefix = rng.choice(systems)
        else:
            prefix = []
        prompt = prefix + [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 60))]
        output = [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 24))]
        tokens = prompt + output
        finished.append(tokens)
        requests.append(Request(tokens, len(prompt)))
    return requests


MODELS: dict[str, list[LayerConfig]] = {
    "swa+full": [attention(0, 2 * KIB), attention(1, 2 * KIB, window=48, sinks=4), attention(2, 4 * KIB, window=32)],
    "hybrid-ssm": [ssm(0, 4 * KIB, 1 * KIB), attention(1, 2 * KIB, window=48, sinks=4), attention(2, 4 * KIB), ssm(3, 4 * KIB, 1 * KIB)],
}


@pytest.mark.parametrize(
    ("seed", "model", "scratch"),
    [(1, "swa+full", False), (2, "swa+full", True), (3, "hybrid-ssm", False), (4, "hybrid-ssm", True)],
)
def test_random_serving_loop_keeps_content_and_invariants(seed: int, model: str, scratch: bool, tmp_path: Path) -> None:
    rng = random.Random(seed)
    layers = MODELS[model]
    block_bytes = 2 * (2 + 2 + 4) * KIB
    config = make_config(
        layers,
        tiers=[
            GpuCacheTierConfig(40 * block_bytes),
            HostCacheTierConfig(40 * block_bytes),
            DiskCacheTierConfig(60 * block_bytes, str(tmp_path)),
        ],
        tokens_per_block=TPB,
        typical_step=BatchDesc([KVCacheDesc(120, 100)] * 6),
        enable_swa_scratch_reuse=scratch,
        ssm_reuse_interval=TPB,
    )
    manager = KVCacheManager(config)
    engine = FakeEngine(manager)
    waiting = make_requests(rng, 240)
    running: list[Request] = []
    paused: list[Request] = []
    done = 0
    reused_tokens = 0
    steps = 0
    while (waiting or running or paused) and steps < 5000:
        steps += 1
        for request in list(paused):
            assert request.cache is not None
            if request.cache.resume():
                paused.remove(request)
                running.append(request)
        while waiting and len(running) < 6 and rng.random() < 0.8:
            request = waiting.pop(0)
            request.cache = manager.create_kv_cache(None, request.tokens[: request.prompt_length - 1])
            reused_tokens += request.cache.num_committed_tokens
            if request.cache.resume():
                running.append(request)
            else:
                paused.append(request)
        for request in list(running):
            cache = request.cache
            assert cache is not None
            if request not in running:
                continue
            history = cache.history_length
            chunk = rng.randrange(1, 40) if history < request.prompt_length else 1
            target = min(len(request.tokens), history + chunk)
            while not cache.resize(target, history):
                victims = [other for other in running if other is not request]
                if not victims:
                    break
                victim = victims[-1]
                assert victim.cache is not None
                victim.cache.suspend()
                running.remove(victim)
                paused.append(victim)
            if cache.capacity != target or cache.history_length != history:
                cache.suspend()
                running.remove(request)
                paused.append(request)
                continue
            engine.step(cache, request.tokens)
            cache.commit(request.tokens[cache.num_committed_tokens : target])
            if target == len(request.tokens):
                if rng.random() < 0.5:
                    cache.stop_committing()
                cache.close()
                running.remove(request)
                done += 1
        manager.check_invariants()
    assert done == 240 and not running and not paused
    assert reused_tokens > 0 and engine.tokens_checked > 0
    counters = manager.movement_counters
    assert counters.offloaded_pages > 0 and counters.onboarded_pages > 0
    assert counters.copied_pages > 0  # copy-on-write of partial blocks, or SSM snapshots
    manager.clear_reusable_blocks()
    manager.check_invariants()
    manager.shutdown()
