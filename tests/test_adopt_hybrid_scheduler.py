"""An engine author's scheduler written from README.md and docstrings alone, over two hybrid models (sliding
window + global attention; attention + SSM, no ``typical_step`` declared): admission by ``can_fit_in_chunks``
(a False explained by ``last_refusal``), chunked prefill ending at snapshot points, prefix reuse of a shared
system prompt, suspend/resume, content checked by ``FakeEngine``."""

from __future__ import annotations

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCache,
                                 KVCacheManager, KVCacheManagerConfig, SsmLayerConfig)
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine

TPB, CHUNK, NEW_TOKENS = 16, 32, 4
KV = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]


def _serve(manager: KVCacheManager, prompts: dict[int, list[int]], system_length: int) -> tuple[int, list[int]]:
    """Serve ``prompts`` three at a time; request 1 is suspended after its prefill and resumed on the next round.
    Returns the prompt tokens reused and the requests refused at admission."""
    engine = FakeEngine(manager)
    tokens = {i: list(prompt) for i, prompt in prompts.items()}
    computed: dict[int, int] = {}
    caches: dict[int, KVCache] = {}
    waiting, running, rejected, reused, suspended = list(prompts), list[int](), list[int](), 0, 0
    while waiting or running:
        while waiting and len(running) < 3:
            i = waiting.pop(0)
            if not manager.can_fit_in_chunks(len(prompts[i]) + NEW_TOKENS, CHUNK):
                refusal = manager.last_refusal  # why: the pool group short, its pages against its slots
                assert refusal is not None and not refusal.fits_empty_manager
                assert refusal.pages_needed > refusal.pages_available, refusal
                rejected.append(i)
                continue
            cache = manager.create_kv_cache(input_tokens=prompts[i][:-1], snapshot_at=[system_length])
            assert cache.resume(), cache.last_refusal
            caches[i], computed[i] = cache, cache.num_committed_tokens
            reused += computed[i]
            running.append(i)
        for i in list(running):
            cache = caches[i]
            if not cache.is_active:  # the one suspended last round
                assert cache.resume(), cache.last_refusal
            end = min(computed[i] + CHUNK, len(prompts[i])) if computed[i] < len(prompts[i]) else len(tokens[i])
            end = min([end] + [p for p in cache.snapshot_points if p > computed[i]])
            assert cache.resize(end, computed[i]), cache.last_refusal
            engine.step(cache, tokens[i])
            cache.commit(tokens[i][cache.num_committed_tokens:end])
            computed[i] = end
            if end == len(tokens[i]):
                tokens[i].append(tokens[i][-1] % 997 + 2)
                if len(tokens[i]) - len(prompts[i]) == NEW_TOKENS:
                    caches.pop(i).close()
                    running.remove(i)
                elif i == 1 and len(tokens[i]) == len(prompts[i]) + 1:  # prefilled: suspended for one round
                    cache.suspend()
                    suspended += 1
    assert engine.tokens_checked > 0 and manager.num_live_caches == 0 and suspended == 1
    return reused, rejected


def _run(layers: list[LayerConfig], gpu_bytes: int) -> tuple[int, list[int]]:
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=layers,
        cache_tiers=[GpuCacheTierConfig(gpu_bytes), HostCacheTierConfig(1 << 20)]))
    system = list(range(1, 49))
    prompts = {i: system + [1000 + i] * (20 + 7 * i) for i in range(6)}
    prompts[6] = system + [7000] * 100_000  # longer than the GPU tier can ever hold: refused, with its reason
    try:
        return _serve(manager, prompts, len(system))
    finally:
        manager.shutdown()


def test_a_window_and_global_attention_model_served_from_the_docs() -> None:
    layers: list[LayerConfig] = [AttentionLayerConfig(0, KV, sliding_window_size=64, num_sink_tokens=16),
                                 AttentionLayerConfig(1, KV)]
    reused, rejected = _run(layers, 200_000)
    assert rejected == [6] and reused >= 32  # later requests reuse the system prompt's blocks


def test_an_attention_and_ssm_model_served_without_declaring_a_step() -> None:
    layers: list[LayerConfig] = [AttentionLayerConfig(0, KV),
                                 SsmLayerConfig(1, [BufferConfig("ssm_state", 1024), BufferConfig("conv_state", 256)])]
    reused, rejected = _run(layers, 200_000)
    assert rejected == [6] and reused >= 32  # from the snapshot at the system prompt's end
