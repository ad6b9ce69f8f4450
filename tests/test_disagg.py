"""Prefill -> decode KV handoff: two managers, the FakeEngine on both sides.

The prefill side computes and commits a prompt with ``FakeEngine.step``; the decode side follows the handoff's order
(create_kv_cache -> resume -> resize(prompt_len, prompt_len) -> cached_tokens_per_layer_group), the sender plans
and executes, then the decode side's ``FakeEngine.check`` proves every transferred token landed in the right page
and a few decode steps run with content checks.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import GpuCacheTierConfig, HalfOpenRange, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2._storage.memory import cuda_device_available
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import (
    KVSlice,
    TransferPlan,
    align_block_lists,
    cached_tokens_per_layer_group,
    execute,
    plan_transfer,
    prepare_receiver,
)
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2.testing.fake_engine import ContentError
from tests.helpers import KIB, MIB, attention, compute_prompt, gemma_like_layers, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


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
        sequence = prompt + tokens_of(999, steps)
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


# ------------------------------------------------------------------------------------------------- full attention


def test_full_attention_receiver_without_cache() -> None:
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers, gpu_quota=8 * MIB)
    dst = Side(layers, gpu_quota=2 * MIB, host_quota=8 * MIB)  # different quotas and tiers
    prompt = tokens_of(1, 300)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [0]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 300)
    assert plan.blocks_per_layer_group == [10]  # ceil(300 / 32): the partial last block too
    assert plan.num_descriptors == 10  # K and V of both layers coalesce into one pool
    slot_bytes = dst.manager.get_slot_bytes(0)[0]
    assert slot_bytes == 4 * 4 * KIB and plan.total_bytes == 10 * slot_bytes
    group = plan.groups[0]
    assert (group.src_start_block, group.dst_start_block, group.end_block, group.num_bytes) == (0, 0, 10, plan.total_bytes)
    for d in plan.descriptors:  # absolute addresses: base + slot * slot bytes of each side's GPU tier
        assert d.src_address == src.manager.get_pool_base_address(d.pool_group, d.pool) + d.src_slot * d.num_bytes
        assert d.dst_address == dst.manager.get_pool_base_address(d.pool_group, d.pool) + d.dst_slot * d.num_bytes
        assert d.dst_slot == dst_cache.get_base_page_indices(0)[d.block]
    src_cache.close()  # the KV now lives on the decode side only
    dst.decode(dst_cache, prompt)
    dst_cache.close()


def test_full_attention_receiver_with_partial_prefix_keeps_its_reused_pages() -> None:
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers)
    dst = Side(layers, gpu_quota=4 * MIB)
    prompt = tokens_of(2, 300)
    earlier = prompt[:200] + tokens_of(3, 50)
    dst.warm(earlier)  # the decode side has seen 200 tokens of this prompt: 6 full blocks + 8 tokens
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert dst_cache.num_committed_tokens == 200  # partial reuse: block 6 is a private copy-on-write page
    assert counts == [192]
    reused_slots = set(dst_cache.get_base_page_indices(0)[:6])
    plan = transfer(src, src_cache, dst, dst_cache, counts, 300)
    assert blocks_moved(plan, 0) == [6, 7, 8, 9]  # block 6 is re-sent whole into the private copy
    assert plan.groups[0].src_start_block == 6
    assert reused_slots.isdisjoint(d.dst_slot for d in plan.descriptors)
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()
    # The decode side's reused pages were never written: the earlier prompt still reads back intact.
    again = dst.manager.create_kv_cache(None, earlier + [7])
    assert again.num_committed_tokens == 250 and again.resume()  # 7 full blocks and the partial one close published
    dst.engine.check(again, earlier)
    again.close()


# ----------------------------------------------------------------------------------------------- sliding window


def test_swa_and_full_move_only_in_window_blocks() -> None:
    layers = gemma_like_layers()  # lg 0: 5 SWA layers (window 128), lg 1: one full layer; two pool groups
    src = Side(layers, gpu_quota=64 * MIB)
    dst = Side(layers, gpu_quota=24 * MIB, host_quota=24 * MIB)
    prompt = tokens_of(4, 1000)
    src_cache = src.prefill(prompt, stops=(256, 512, 768))  # chunked: few SWA slots at a time
    dst_cache, counts = dst.receive(prompt)
    # History 1000: the window needs blocks from (1001 - 128) // 32 = 27 on; the receiver requests only those.
    assert counts == [27 * TPB, 0]
    assert list(dst_cache.get_base_page_indices(0)[:27]) == [-1] * 27  # never allocated
    plan = transfer(src, src_cache, dst, dst_cache, counts, 1000)
    assert blocks_moved(plan, 0) == list(range(27, 32))
    assert len(plan.descriptors_of(0)) == 5 and len(plan.descriptors_of(1)) == 32
    assert plan.blocks_per_layer_group == [5, 32]
    assert plan.bytes_per_layer_group == [5 * 160 * KIB, 32 * 64 * KIB]
    assert plan.total_bytes == sum(plan.bytes_per_layer_group)
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


@pytest.mark.parametrize("scratch", [False, True])
def test_swa_with_sinks_moves_the_sink_blocks_too(scratch: bool) -> None:
    layers: list[LayerConfig] = [attention(0, window=64, sinks=10), attention(1, window=64, sinks=10), attention(2)]
    src = Side(layers, enable_swa_scratch_reuse=scratch)  # scratch: the prefill's out-of-window blocks share slots
    dst = Side(layers, enable_swa_scratch_reuse=scratch)
    prompt = tokens_of(5, 400)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [0, 0]  # block 0 (sinks) is missing, so nothing can be clamped
    plan = transfer(src, src_cache, dst, dst_cache, counts, 400)
    # Stale at 400: [1, (401 - 64) // 32) = [1, 10): the sink block and blocks 10..12 move.
    assert blocks_moved(plan, 0) == [0, 10, 11, 12]
    assert plan.blocks_per_layer_group == [4, 13]
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


def test_swa_receiver_with_a_short_prefix_gets_the_in_window_blocks_only() -> None:
    layers: list[LayerConfig] = [attention(0, window=64, sinks=10), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(6, 400)
    dst.warm(prompt[:100] + tokens_of(7, 50))
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert dst_cache.num_committed_tokens == 100
    # Reuse 96 (3 blocks): the sink block is held and block 3 lies in the unneeded gap [1, 10) -> 10 * 32.
    assert counts == [320, 96]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 400)
    assert blocks_moved(plan, 0) == [10, 11, 12]
    assert blocks_moved(plan, 1) == list(range(3, 13))
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


def test_swa_receiver_with_a_prefix_longer_than_the_window() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(8, 400)
    dst.warm(prompt[:352] + tokens_of(9, 40))
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [352, 352]  # 11 blocks held, beyond the window start (block 10)
    kept = dst_cache.get_base_page_indices(0)[10]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 400)
    assert blocks_moved(plan, 0) == [11, 12] and blocks_moved(plan, 1) == [11, 12]
    assert kept not in {d.dst_slot for d in plan.descriptors}  # block 10 comes from the receiver's own reuse
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


def test_receiver_holding_the_whole_prompt_requests_nothing() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(10, 384)
    dst.warm(prompt)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [384, 384]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 384)
    assert plan.num_descriptors == 0 and plan.total_bytes == 0 and plan.blocks_per_layer_group == [0, 0]
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


# --------------------------------------------------------------------------------------------------------- SSM


def hybrid_layers() -> list[LayerConfig]:
    # lg 0: SSM (layers 0 and 2), lg 1: full attention, lg 2: window 64.
    return [ssm(0), attention(1, 2 * KIB), ssm(2), attention(3, 2 * KIB, window=64)]


def test_hybrid_ssm_state_is_sent_when_the_receiver_has_no_snapshot_at_the_prompt_end() -> None:
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = tokens_of(11, 256)
    dst.warm(prompt[:128] + tokens_of(12, 20), stops=(128,))  # a snapshot at 128, not at 256
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert dst_cache.num_committed_tokens == 128
    assert counts == [0, 128, (257 - 64) // TPB * TPB]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 256)
    states = plan.descriptors_of(0)
    assert plan.blocks_per_layer_group[0] == 1
    assert len(states) == 2 and {d.block for d in states} == {-1}  # one live state, two pools (state, conv)
    assert {d.dst_slot for d in states} == {dst_cache.get_ssm_block_base_index(0)}
    assert sum(d.num_bytes for d in states) == 2 * (16 + 2) * KIB
    assert blocks_moved(plan, 1) == list(range(4, 8)) and blocks_moved(plan, 2) == [6, 7]
    src_cache.close()
    checked = dst.engine.states_checked
    dst.decode(dst_cache, prompt)
    assert dst.engine.states_checked > checked
    dst_cache.close()


def test_hybrid_ssm_state_is_not_sent_when_the_receiver_has_it() -> None:
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = tokens_of(13, 256)
    dst.warm(prompt)  # snapshot at 256: resume copies it into the receiver's live state
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [256, 256, 256]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 256)
    assert plan.descriptors_of(0) == [] and plan.num_descriptors == 0
    src_cache.close()
    dst.decode(dst_cache, prompt)  # the live state checks out without being sent
    dst_cache.close()


def test_hybrid_ssm_receiver_without_cache() -> None:
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = tokens_of(14, 200)
    src_cache = src.prefill(prompt)
    received = prepare_receiver(dst.manager, prompt)  # the same four steps as Side.receive, in one call
    assert received is not None
    dst_cache, counts = received
    assert counts == [0, 0, (201 - 64) // TPB * TPB]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 200)
    assert plan.blocks_per_layer_group == [1, 7, 3]
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


# ------------------------------------------------------------------------------------------- sender-side offsets


def test_sender_with_its_own_reused_prefix_addresses_blocks_from_zero() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    prompt = tokens_of(15, 400)
    src.warm(prompt[:160] + tokens_of(16, 30))
    for receiver_prefix, start in ((0, 0), (64, 2), (256, 8)):
        src_cache = src.prefill(prompt)
        assert src_cache.num_committed_tokens == 400
        dst = Side(layers)
        if receiver_prefix:
            dst.warm(prompt[:receiver_prefix] + tokens_of(17, 30))
        dst_cache, counts = dst.receive(prompt)
        assert counts[1] == receiver_prefix
        plan = transfer(src, src_cache, dst, dst_cache, counts, 400)
        full = plan.groups[1]
        # The sender reused 5 blocks itself; its block list still starts at block 0, so the start is the
        # receiver's, not shifted by the sender's own prefix.
        assert (full.src_start_block, full.dst_start_block, full.end_block) == (start, start, 13)
        assert blocks_moved(plan, 1) == list(range(start, 13))
        sender_table = src_cache.get_base_page_indices(1)
        assert all(d.src_slot == sender_table[d.block] for d in plan.descriptors_of(1))
        src_cache.close()
        dst.decode(dst_cache, prompt)
        dst_cache.close()


def test_a_prompt_sent_as_two_slices() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = tokens_of(18, 400)
    dst.warm(prompt[:64] + tokens_of(19, 10), stops=(64,))
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [(401 - 64) // TPB * TPB, 64, 0]
    first = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(400, HalfOpenRange(0, 192)), counts)
    second = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(400, HalfOpenRange(192, 400)), counts)
    whole = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(400), counts)
    assert first.blocks_per_layer_group == [0, 4, 0]  # blocks 2..5; the window and the state come last
    assert second.blocks_per_layer_group == [3, 7, 1]
    assert set(first.descriptors) | set(second.descriptors) == set(whole.descriptors)
    assert first.total_bytes + second.total_bytes == whole.total_bytes
    assert align_block_lists(6, 4) == (2, 0, 4)  # first slice, full attention: sender 0..5, receiver 2..5
    execute(first)
    execute(second)
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


def test_align_block_lists_pairs_the_tails() -> None:
    assert align_block_lists(10, 4) == (6, 0, 4)
    assert align_block_lists(2, 5) == (0, 3, 2)
    assert align_block_lists(10, 0) == (10, 0, 0)
    assert align_block_lists(0, 0) == (0, 0, 0)


# ------------------------------------------------------------------------------------------------ errors, pickling


def resized_cache(side: Side, prompt_len: int) -> _KVCache:
    cache = side.manager.create_kv_cache()
    assert cache.resume() and cache.resize(prompt_len, prompt_len)
    return cache


@pytest.mark.parametrize(
    ("receiver_layers", "tokens_per_block", "message"),
    [
        ([attention(0, window=64), attention(1)], 16, "tokens_per_block differs: 32 on the sender, 16 on the receiver"),
        ([attention(0, window=64), attention(1, 2 * KIB)], 32, "layer 1 buffer 'key': size 4096 on the sender, 2048"),
        ([attention(0, window=128), attention(1)], 32, "layer 0: sliding_window_size 64 on the sender, 128"),
        ([attention(0, window=64, sinks=4), attention(1)], 32, "layer 0: num_sink_tokens None on the sender, 4"),
        ([attention(0, window=64)], 32, "number of layers differs: 2 on the sender, 1 on the receiver"),
        ([attention(0, window=64), ssm(1)], 32, "layer 1: AttentionLayerConfig on the sender, SsmLayerConfig"),
        ([attention(0, window=64), attention(2)], 32, "layer_id 1 on the sender, 2 on the receiver"),
    ],
)
def test_mismatched_layouts_are_rejected(receiver_layers: list[LayerConfig], tokens_per_block: int, message: str) -> None:
    src = Side([attention(0, window=64), attention(1)])
    dst = Side(receiver_layers, tokens_per_block=tokens_per_block)
    src_cache = resized_cache(src, 64)
    dst_cache = resized_cache(dst, 64)
    counts = [0] * dst.manager.num_layer_groups
    with pytest.raises(ValueError, match=message):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(64), counts)


def test_misuse_is_reported_clearly() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(20, 300)
    dst.warm(prompt[:128] + tokens_of(21, 10))
    src_cache = src.prefill(prompt)
    dst_cache = dst.manager.create_kv_cache(None, prompt)
    assert dst_cache.resume() and dst_cache.resize(300)  # history not preset
    counts = cached_tokens_per_layer_group(dst_cache, 300)
    with pytest.raises(ValueError, match=r"history_length 128, not prompt_len 300: call resize\(300, 300\)"):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    assert dst_cache.resize(300, 300)

    def plan(counts: list[int], kv_slice: KVSlice = KVSlice(300)) -> TransferPlan:
        return plan_transfer(src.manager, src_cache, dst.manager, dst_cache, kv_slice, counts)

    with pytest.raises(ValueError, match="one per layer group"):
        plan([0])
    with pytest.raises(ValueError, match=r"cached_per_group\[1\] = 100 is neither a multiple"):
        plan([0, 100])
    with pytest.raises(ValueError, match=r"cached_per_group\[1\] = 320 is outside"):
        plan([0, 320])
    with pytest.raises(ValueError, match=r"would overwrite block 0 of layer group 1, a reused \(committed\) page"):
        plan([0, 0])
    with pytest.raises(ValueError, match="token_range.beg 10 is not a multiple"):
        plan(counts, KVSlice(300, HalfOpenRange(10, 300)))
    with pytest.raises(ValueError, match="same cache"):
        plan_transfer(dst.manager, dst_cache, dst.manager, dst_cache, KVSlice(300), counts)
    with pytest.raises(ValueError, match="does not belong"):
        plan_transfer(dst.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    with pytest.raises(ValueError, match=r"token_range \[0, 301\) must lie within the prompt"):
        KVSlice(300, HalfOpenRange(0, 301))
    with pytest.raises(ValueError, match="more than prompt_len 100"):
        cached_tokens_per_layer_group(dst_cache, 100)

    good = plan(counts)
    dst_cache.suspend()
    with pytest.raises(ValueError, match="dst_cache .* must be active"):
        execute(good)
    assert dst_cache.resume()
    execute(good)
    dst.engine.check(dst_cache, prompt)
    src_cache.close()
    dst_cache.close()


def test_a_plan_runs_once_and_never_after_either_cache_moved_on() -> None:
    """A plan describes the caches as they were: once the receiver decoded into the prompt's last block (or committed
    the prompt's pages, now shared), or the sender's live state moved past the prompt, its copies would overwrite
    newer bytes with stale ones. ``execute`` refuses those plans, and any plan a second time."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(30, 300)  # block 9 holds the prompt's last 12 tokens, then the decoded ones
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = transfer(src, src_cache, dst, dst_cache, counts, 300)
    dst.decode(dst_cache, prompt)  # commits the prompt, then writes 3 decoded tokens into block 9
    with pytest.raises(ValueError, match="executed already"):
        execute(plan)
    dst.engine.check(dst_cache, prompt + tokens_of(999, 3))  # the decoded rows are still the receiver's own

    again, counts = dst.receive(prompt)  # a second receiver (it reuses the committed full blocks)
    fresh = plan_transfer(src.manager, src_cache, dst.manager, again, KVSlice(300), counts)
    assert again.resize(301, 301)
    with pytest.raises(ValueError, match="history_length 301, not prompt_len 300"):
        execute(fresh)
    other = Side(layers)
    late, counts = other.receive(prompt)
    moved = plan_transfer(src.manager, src_cache, other.manager, late, KVSlice(300), counts)
    assert src_cache.resize(301, 301)  # the sender went on past the prompt
    with pytest.raises(ValueError, match="src_cache .* history_length 301 since planning, 300 then"):
        execute(moved)
    for cache in (src_cache, dst_cache, again, late):
        cache.close()


def test_a_plan_never_overwrites_pages_the_receiver_committed_after_planning() -> None:
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = tokens_of(31, 300)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    dst_cache.commit(prompt)  # (an engine bug) its pages enter the tree, shared, before their bytes came
    with pytest.raises(ValueError, match="block 0 of layer group 0 is a committed"):
        execute(plan)
    src_cache.close()
    dst_cache.close()


def test_plans_pickle_and_numpy_integers_are_accepted() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = tokens_of(22, 160)
    src_cache = src.prefill(prompt)
    dst_cache, _ = dst.receive(prompt)
    counts = np.asarray(cached_tokens_per_layer_group(dst_cache, np.int64(160)), dtype=np.int64)
    kv_slice = KVSlice(np.int64(160))
    assert kv_slice == KVSlice(160) and kv_slice.token_range == HalfOpenRange(0, 160)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, kv_slice, list(counts))
    assert plan.is_local
    copy = pickle.loads(pickle.dumps(plan))
    assert isinstance(copy, TransferPlan) and not copy.is_local
    assert copy.descriptors == plan.descriptors and copy.groups == plan.groups and copy.kv_slice == plan.kv_slice
    assert pickle.loads(pickle.dumps(kv_slice)) == kv_slice
    with pytest.raises(ValueError, match="unpickled"):
        execute(copy)
    execute(plan, stream=np.int64(0))
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_available(), reason="CuPy sees no CUDA device")
def test_execute_on_the_cuda_backend_moves_the_planned_slots() -> None:
    import cupy

    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src = KVCacheManager(make_config(layers, backend="cuda", ssm_reuse_interval=TPB))
    dst = KVCacheManager(make_config(layers, backend="cuda", ssm_reuse_interval=TPB))
    prompt = tokens_of(23, 300)
    src_cache = src.create_kv_cache(None, prompt)
    assert src_cache.resume() and src_cache.resize(300)
    src_cache.commit(prompt)
    # stand-in for the prefill's kernels: a distinct byte pattern everywhere
    for pool in internals_of(src).store.gpu_pools():
        data = cupy.asarray(pool.array())
        data[...] = ((cupy.arange(data.size, dtype=cupy.uint64) * 2654435761) >> 11).astype(cupy.uint8)
    dst_cache = dst.create_kv_cache(None, prompt)
    assert dst_cache.resume() and dst_cache.resize(300, 300)
    plan = plan_transfer(src, src_cache, dst, dst_cache, KVSlice(300), cached_tokens_per_layer_group(dst_cache, 300))
    assert plan.blocks_per_layer_group == [3, 10, 1]
    execute(plan)
    cupy.cuda.Device().synchronize()
    for d in plan.descriptors:
        source = cupy.asarray(internals_of(src).store.pools(0, d.pool_group)[d.pool].array())
        target = cupy.asarray(internals_of(dst).store.pools(0, d.pool_group)[d.pool].array())
        begin_src = d.src_slot * d.num_bytes
        begin_dst = d.dst_slot * d.num_bytes
        assert bool(cupy.array_equal(source[begin_src : begin_src + d.num_bytes], target[begin_dst : begin_dst + d.num_bytes]))
    src_cache.close()
    dst_cache.close()


def test_prepare_receiver_short_of_gpu_memory_says_why() -> None:
    """Its None closes the cache it made, so the reason is the manager's (as its docstring and the README say)."""
    manager = KVCacheManager(make_config([attention(0, 4 * KIB)], gpu_quota=4 * 8 * KIB))  # 4 blocks of 32 tokens
    assert prepare_receiver(manager, list(range(1000))) is None
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCache.resize" and not refusal.fits_empty_manager
    assert manager.num_live_caches == 0
    manager.shutdown()


# ------------------------------------------------------------------------------------------------- re-entrancy


@pytest.mark.parametrize("side", ["src", "dst"])
def test_execute_from_a_callback_of_either_manager_is_refused_and_changes_nothing(side: str) -> None:
    """``execute`` runs both managers' pending copies: from a priority callback (here, of a cache of ``side``
    growing) it raises RuntimeError naming both calls; later, outside any call, it runs. Before: it ran inside the
    other call."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = tokens_of(1, 100)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(100), counts)
    refusals: list[str] = []

    def priority(ordinal: int, life_cycle: object) -> int:
        try:
            execute(plan)
        except RuntimeError as error:
            refusals.append(str(error))
        return 35

    owner = src if side == "src" else dst
    grown = owner.manager.create_kv_cache(custom_priority_callback=priority)
    assert grown.resume() and grown.resize(TPB)
    assert refusals and all("disagg.execute was called while KVCache.resize is in flight" in r for r in refusals)
    with pytest.raises(ContentError):
        dst.engine.check(dst_cache, prompt)  # nothing was copied
    execute(plan)
    src_cache.close()
    grown.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()
