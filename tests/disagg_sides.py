"""The two instances of a prefill -> decode handoff test: a manager and its FakeEngine on each side."""

from __future__ import annotations

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import KVSlice, TransferPlan, cached_tokens_per_layer_group, execute, plan_transfer
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import MIB, compute_prompt, make_config, seeded_prompt

TPB = 32



class Side:
    """One instance (prefill or decode): a manager and its FakeEngine."""

    def __init__(self, layers: list[LayerConfig], gpu_quota: int = 16 * MIB, host_quota: int = 0, **kwargs: object) -> None:
        tiers = [GpuCacheTierConfig(gpu_quota)]
        if host_quota:
            tiers.append(HostCacheTierConfig(host_quota))  # type: ignore[arg-type]
        self.manager = KVCacheManager(make_config(layers, tiers=tiers, **kwargs))  # type: ignore[arg-type]
        self.engine = FakeEngine(self.manager)

    def prefill(self, tokens: list[int], stops: tuple[int, ...] = ()) -> _KVCache:
        """Compute and commit the prompt here (``compute_prompt``); the cache stays active."""
        return compute_prompt(self.manager, self.engine, tokens, stops)

    def warm(self, tokens: list[int], stops: tuple[int, ...] = ()) -> None:
        """Leave ``tokens`` as reusable content (an earlier request on this instance)."""
        self.prefill(tokens, stops).close()

    def receive(self, prompt: list[int]) -> tuple[_KVCache, list[int]]:
        """The handoff's decode-side order, step by step: create, resume, resize to the prompt, cached counts."""
        cache = self.manager.create_kv_cache(None, prompt)
        assert cache.resume()
        assert cache.resize(len(prompt), len(prompt))  # history preset: stale SWA blocks never get pages
        return cache, cached_tokens_per_layer_group(cache, len(prompt))

    def decode(self, cache: _KVCache, prompt: list[int], steps: int = 3) -> None:
        """Check the received prompt, publish it, then decode ``steps`` tokens with content checks."""
        self.engine.check(cache, prompt)
        cache.commit(prompt[cache.num_committed_tokens :])
        sequence = prompt + seeded_prompt(999, steps)
        for _ in range(steps):
            history = cache.capacity
            assert cache.resize(history + 1, history)
            self.engine.step(cache, sequence)
            cache.commit(sequence[history : history + 1])
        self.manager.check_invariants()


def transfer(src: Side, src_cache: _KVCache, dst: Side, dst_cache: _KVCache, counts: list[int], prompt_len: int) -> TransferPlan:
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(prompt_len), counts)
    execute(plan)
    return plan


def blocks_moved(plan: TransferPlan, layer_group: int) -> list[int]:
    return sorted({d.block for d in plan.descriptors_of(layer_group)})
