"""Prefill -> decode KV handoff: two managers, the FakeEngine on both sides.

The prefill side computes and commits a prompt with ``FakeEngine.step``; the decode side follows the handoff's order
(create_kv_cache -> resume -> resize(prompt_len, prompt_len) -> cached_tokens_per_layer_group), the sender plans
and executes, then the decode side's ``FakeEngine.check`` proves every transferred token landed in the right page
and a few decode steps run with content checks.
"""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import HalfOpenRange
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import KVSlice, align_block_lists, execute, plan_transfer, prepare_receiver
from tests.disagg_sides import TPB, Side, blocks_moved, transfer
from tests.helpers import KIB, MIB, attention, gemma_like_layers, seeded_prompt, ssm


# ------------------------------------------------------------------------------------------------- full attention


def test_full_attention_receiver_without_cache() -> None:
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers, gpu_quota=8 * MIB)
    dst = Side(layers, gpu_quota=2 * MIB, host_quota=8 * MIB)  # different quotas and tiers
    prompt = seeded_prompt(1, 300)
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
    prompt = seeded_prompt(2, 300)
    earlier = prompt[:200] + seeded_prompt(3, 50)
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
    prompt = seeded_prompt(4, 1000)
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
    prompt = seeded_prompt(5, 400)
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
    prompt = seeded_prompt(6, 400)
    dst.warm(prompt[:100] + seeded_prompt(7, 50))
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
    prompt = seeded_prompt(8, 400)
    dst.warm(prompt[:352] + seeded_prompt(9, 40))
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
    prompt = seeded_prompt(10, 384)
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
    prompt = seeded_prompt(11, 256)
    dst.warm(prompt[:128] + seeded_prompt(12, 20), stops=(128,))  # a snapshot at 128, not at 256
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
    prompt = seeded_prompt(13, 256)
    dst.warm(prompt)  # snapshot at 256: resume copies it into the receiver's live state
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert counts == [256, 256, 256]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 256)
    assert plan.descriptors_of(0) == [] and plan.num_descriptors == 0
    src_cache.close()
    dst.decode(dst_cache, prompt)  # the live state checks out without being sent
    dst_cache.close()


def test_hybrid_receiver_holding_the_whole_prompt_inside_a_block_requests_nothing() -> None:
    """A receiver whose reuse is the whole prompt, ending inside a block on a saved snapshot, holds every token and
    the state after the prompt. Before: counts [0, 224, 224] (the live SSM state and the attention groups' last
    block requested again, against the docstring's 'a receiver holding everything reports prompt_len')."""
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = seeded_prompt(16, 250)
    warm = dst.prefill(prompt)
    warm.stop_committing(save_last_ssm_snapshot=True)  # the states after all 250 tokens, on a short tree block
    warm.close()
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    assert dst_cache.num_committed_tokens == 250
    assert counts == [250, 250, 250]
    plan = transfer(src, src_cache, dst, dst_cache, counts, 250)
    assert plan.num_descriptors == 0
    src_cache.close()
    dst.decode(dst_cache, prompt)  # the live state restored from the saved snapshot checks out without being sent
    dst_cache.close()


@pytest.mark.parametrize("save", [False, True])
def test_a_hybrid_decode_side_reuses_a_received_prompt_only_where_it_saved_the_states(save: bool) -> None:
    """The README's recipe: the live SSM state arrives whole and decoding past the prompt leaves no snapshot at its
    end, so a repeat of the prompt on the decode side reuses nothing unless the received prompt was committed with
    ``save_ssm_snapshot=True``."""
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = seeded_prompt(17, 150)
    for turn in range(2):
        src_cache = src.prefill(prompt)
        dst_cache, counts = dst.receive(prompt)
        assert dst_cache.num_committed_tokens == (150 if save and turn else 0)
        transfer(src, src_cache, dst, dst_cache, counts, 150)
        src_cache.close()
        dst.engine.check(dst_cache, prompt)
        dst_cache.commit(prompt[dst_cache.num_committed_tokens :], save_ssm_snapshot=save)
        sequence = prompt + seeded_prompt(998, 3)
        for end in range(151, 154):  # decode past the prompt
            assert dst_cache.resize(end, end - 1)
            dst.engine.step(dst_cache, sequence)
            dst_cache.commit(sequence[end - 1 : end])
        dst_cache.close()


def test_hybrid_ssm_receiver_without_cache() -> None:
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = seeded_prompt(14, 200)
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


def test_the_ssm_state_is_not_sent_from_a_sender_that_computed_past_the_prompt() -> None:
    """The live SSM state is the state after every token the sender computed. Before: a sender that had decoded one
    token past the 200-token prompt sent that state as the prompt's ('live state is of 201 tokens ..., expected the
    state of 200 tokens' on the decode side). Now planning refuses; sent before the decode step, it arrives right."""
    layers = hybrid_layers()
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = seeded_prompt(15, 200)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = transfer(src, src_cache, dst, dst_cache, counts, 200)  # sent first: fine
    sequence = prompt + seeded_prompt(16, 1)
    assert src_cache.resize(201, 200)
    src.engine.step(src_cache, sequence)
    src_cache.commit(sequence[200:])
    late, late_counts = dst.receive(prompt)
    with pytest.raises(ValueError, match=r"spans 201 tokens, not prompt_len 200: its SSM live state \(layer group 0\)"):
        plan_transfer(src.manager, src_cache, dst.manager, late, KVSlice(200), late_counts)
    late.close()
    assert plan.blocks_per_layer_group[0] == 1
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


# ------------------------------------------------------------------------------------------- sender-side offsets


def test_sender_with_its_own_reused_prefix_addresses_blocks_from_zero() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    prompt = seeded_prompt(15, 400)
    src.warm(prompt[:160] + seeded_prompt(16, 30))
    for receiver_prefix, start in ((0, 0), (64, 2), (256, 8)):
        src_cache = src.prefill(prompt)
        assert src_cache.num_committed_tokens == 400
        dst = Side(layers)
        if receiver_prefix:
            dst.warm(prompt[:receiver_prefix] + seeded_prompt(17, 30))
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
    prompt = seeded_prompt(18, 400)
    dst.warm(prompt[:64] + seeded_prompt(19, 10), stops=(64,))
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
