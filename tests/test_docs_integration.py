"""Three integrations written from the README and the public docstrings only, as an engine author would: a
Llama-like model (full attention), a Gemma-like one (sliding windows with sinks beside global layers) and a
hybrid (attention + SSM layers). Each runs its own continuous-batching loop (admit, chunked prefill, decode,
prefix reuse across requests sharing a system prompt, suspend with offload to the host tier, resume, close) and
checks every page's content with ``kv_cache_manager_v2.testing.FakeEngine``. If the documented calls change
meaning, these break the way an integrator's engine would."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    SsmLayerConfig,
)
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine

TPB = 16
ROW = 256  # bytes per token of one K or V buffer
SYSTEM = list(range(1, 100))  # 99 tokens every request starts with: not block-aligned


def kv_buffers() -> list[BufferConfig]:
    return [BufferConfig("key", TPB * ROW), BufferConfig("value", TPB * ROW)]


def manager_for(layers: list[LayerConfig], gpu_bytes: int, typical_step: BatchDesc | None = None) -> KVCacheManager:
    return KVCacheManager(
        KVCacheManagerConfig(
            tokens_per_block=TPB,
            layers=layers,
            backend="cpu",
            cache_tiers=[GpuCacheTierConfig(gpu_bytes), HostCacheTierConfig(4 << 20)],
            typical_step=typical_step,
        )
    )


@dataclass
class Request:
    """A prompt, what was generated after it, and its cache while admitted."""

    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    reused: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new_tokens


def next_capacity(request: Request, cache: KVCache, chunk: int) -> int:
    """A prefill chunk (ending early at the cache's SSM snapshot points, as the docs ask), or one decode token."""
    history = cache.num_committed_tokens
    if history >= len(request.prompt):
        return history + 1
    target = min(history + chunk, len(request.prompt))
    return min([target] + [point for point in cache.snapshot_points if history < point < target])


def serve(manager: KVCacheManager, requests: list[Request], chunk: int = 32, max_running: int = 2) -> int:
    """FCFS continuous batching with chunked prefill; at step 5 the newest running request is preempted (suspend,
    offload to the host tier) and resumed by a later step. Returns the steps taken."""
    fake = FakeEngine(manager)
    waiting, running, suspended = list(requests), list[Request](), list[Request]()
    steps = 0
    while waiting or running or suspended:
        steps += 1
        assert steps < 500, "the loop does not finish"
        for request in list(suspended):
            assert request.cache is not None
            if not request.cache.resume():
                break
            suspended.remove(request)
            running.append(request)
        while waiting and len(running) < max_running:
            request = waiting[0]
            # Without the last prompt token: its logits are needed to sample the first output (create_kv_cache).
            expected = manager.probe_reuse(None, request.prompt[:-1])
            admitted = manager.create_kv_cache(input_tokens=request.prompt[:-1], snapshot_at=[len(SYSTEM)])
            assert admitted.num_committed_tokens == expected
            if not admitted.resume():
                assert admitted.last_refusal is not None
                admitted.close()
                break
            request.cache, request.reused = admitted, admitted.num_committed_tokens
            running.append(waiting.pop(0))
        for request in list(running):
            cache = request.cache
            assert cache is not None
            history = cache.num_committed_tokens
            target = next_capacity(request, cache, chunk)
            assert cache.resize(target, history), cache.last_refusal
            fake.step(cache, request.tokens)  # writes [history, target) of every layer, checks what came before
            if target == len(request.tokens):  # the step reached the last known token: "sample" the next one
                request.tokens.append(request.tokens[-1] % 997 + 3)
            cache.commit(request.tokens[history:target])
            if request.done:
                cache.close()
                running.remove(request)
        if steps == 5 and running:
            preempted = running.pop()
            assert preempted.cache is not None
            preempted.cache.suspend()
            # Its GPU pages go to the host tier now, except those an active cache shares (a common system prompt).
            assert preempted.cache.offload() > 0
            suspended.append(preempted)
    assert manager.num_live_caches == 0
    return steps


def requests_sharing_the_system_prompt(count: int) -> list[Request]:
    return [Request(SYSTEM + [1000 * (i + 1) + j for j in range(40 + 30 * i)], max_new_tokens=4) for i in range(count)]


def test_llama_like_full_attention() -> None:
    layers: list[LayerConfig] = [AttentionLayerConfig(i, kv_buffers()) for i in range(4)]
    manager = manager_for(layers, gpu_bytes=64 * 4 * 2 * TPB * ROW)
    requests = requests_sharing_the_system_prompt(5)
    serve(manager, requests)
    # The first two run together and compute the system prompt each; later ones reuse all of it (partial reuse
    # copies the rows of its last, partial block).
    assert [request.reused for request in requests[2:]] == [len(SYSTEM)] * 3
    computed = requests[0].tokens[:-1]  # the last sampled token was never computed, so never committed
    assert manager.probe_reuse(None, computed) == len(computed)  # close() published the trailing partial block
    manager.shutdown()


def test_gemma_like_sliding_window_with_sinks() -> None:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv_buffers()) if i % 3 == 2
        else AttentionLayerConfig(i, kv_buffers(), sliding_window_size=64, num_sink_tokens=16)
        for i in range(6)
    ]
    # The default typical_step (decode steps of 4,096 tokens) would leave the window group too few slots for one
    # 32-token prefill chunk in this small tier: declare the steps this loop runs.
    manager = manager_for(layers, 4 << 20, BatchDesc([KVCacheDesc(320, 288)] * 2))
    assert manager.num_layer_groups == 2
    assert [manager.get_layer_window(layer) for layer in (0, 2)] == [(64, 16), (0, 0)]
    requests = requests_sharing_the_system_prompt(4)
    serve(manager, requests)
    assert [request.reused for request in requests[2:]] == [len(SYSTEM)] * 2
    manager.shutdown()


def test_hybrid_attention_and_ssm_reuses_the_system_prompt_snapshot() -> None:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv_buffers()) if i % 3 == 1
        else SsmLayerConfig(i, [BufferConfig("ssm_state", 8192), BufferConfig("conv_state", 1024)])
        for i in range(6)
    ]
    manager = manager_for(layers, 4 << 20, BatchDesc([KVCacheDesc(320, 288)] * 2))
    requests = requests_sharing_the_system_prompt(4)
    serve(manager, requests)
    # snapshot_at=[99] is snapped down to the block boundary 96, where the prefill chunk ended: the SSM state there
    # is what later requests resume from.
    boundary = len(SYSTEM) // TPB * TPB
    assert [request.reused for request in requests[2:]] == [boundary] * 2
    stats = manager.get_and_reset_ssm_snapshot_iteration_stats()
    assert sum(delta.iter_snapshot_hits for delta in stats.values()) == 2
    manager.shutdown()


def test_hybrid_live_state_is_addressed_as_the_docs_say() -> None:
    """The README's recipe for an SSM state: one slot per cache (the page table is all BAD_PAGE_INDEX), turned into
    a row of the state buffer by the layer's page index converter, moved with the cache and found again after
    resume."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, kv_buffers()),
        SsmLayerConfig(1, [BufferConfig("ssm_state", 8192), BufferConfig("conv_state", 1024)]),
    ]
    manager = manager_for(layers, 1 << 20, BatchDesc([KVCacheDesc(64, 32)] * 2))
    group = manager.get_layer_group_id(1)
    to_row = manager.get_page_index_converter(1, "ssm_state")
    states = np.asarray(manager.get_page_view(1, "ssm_state"))
    cache = manager.create_kv_cache(input_tokens=list(range(40)))
    assert cache.get_ssm_block_base_index(group) == BAD_PAGE_INDEX  # suspended: no live slot to write
    assert cache.resume() and cache.resize(32)
    assert list(cache.get_base_page_indices(group)) == [BAD_PAGE_INDEX] * 2
    [row] = to_row([cache.get_ssm_block_base_index(group)])
    states[row] = np.arange(8192) % 251
    cache.commit(list(range(32)))
    cache.suspend()
    assert cache.offload() > 0  # the live state leaves the GPU tier with the attention pages
    assert cache.resume()
    [row] = to_row([cache.get_ssm_block_base_index(group)])
    assert (states[row] == np.arange(8192) % 251).all()
    cache.close()
    manager.shutdown()


def test_fake_engine_short_of_tokens_names_the_argument() -> None:
    """What an integrator meets when a prompt was cached in full and the engine computes one more token."""
    manager = manager_for([AttentionLayerConfig(0, kv_buffers())], 1 << 20)
    prompt = list(range(40))
    first = manager.create_kv_cache(input_tokens=prompt)
    assert first.resume() and first.resize(40)
    FakeEngine(manager).step(first, prompt)
    first.commit(prompt)
    first.close()
    again = manager.create_kv_cache(input_tokens=prompt)
    assert again.num_committed_tokens == 40 and again.resume() and again.resize(41, 40)
    with pytest.raises(ValueError, match=r"tokens holds 40 tokens; .* needs 41 .*without the last"):
        FakeEngine(manager).step(again, prompt)
    again.close()
    manager.shutdown()
