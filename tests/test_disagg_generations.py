"""A handoff completed late must land only on what it was planned for (SPEC §11: asynchronous completions are
checked against what they were started for). A local plan keeps every page it moves with its generation, so
``execute`` refuses a plan whose sender let go of a page meanwhile even when a new page took the same slot; a
sender's half made for a custom transport (``plan_source``) carries the key of the tokens its rows were computed
for, and the receiver's half (``complete_plan``) refuses a cache of other tokens or another reuse scope.
The fuzzer drives late plans too (``tests/fuzz/handoff_ops.py``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kv_cache_manager_v2 import HalfOpenRange, KVCacheManager, ReuseScope
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import KVSlice, complete_plan, execute, plan_source, plan_transfer
from kv_cache_manager_v2._base.hashing import Token, root_key, sequence_to_blockchain_keys
from kv_cache_manager_v2._handoff.plan import prompt_key
from kv_cache_manager_v2._introspection import state_of
from tests.disagg_sides import Side
from tests.helpers import attention, seeded_prompt, ssm


def pool_bytes(manager: KVCacheManager) -> list[np.ndarray]:
    """A copy of every buffer of every layer on the GPU tier."""
    return [
        np.array(manager.get_page_view(layer.layer_id, buffer.role), copy=True)
        for layer in manager.config.layers
        for buffer in layer.buffers
    ]


def test_execute_refuses_a_plan_whose_source_page_went_to_another_request_in_the_same_slot() -> None:
    """The sender shrinks past its last block and grows again at the same history: meanwhile another request
    computed its own tokens in the freed slot, which the sender's new page then takes. Slot numbers, lengths and
    tokens all match the plan. Before: ``execute`` copied the other request's rows as the prompt's (the receiver's
    content check then failed at positions 288-299)."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt, other_prompt = seeded_prompt(40, 300), seeded_prompt(41, 32)
    sender = src.manager.create_kv_cache(None, prompt)
    assert sender.resume() and sender.resize(300, 0)
    src.engine.step(sender, prompt)  # computed, history not moved yet
    receiver, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, sender, dst.manager, receiver, KVSlice(300), counts)
    planned_slot = plan.descriptors_of(0)[-1].src_slot
    assert sender.resize(288, 0)  # block 9 let go
    other = src.manager.create_kv_cache(None, other_prompt)
    assert other.resume() and other.resize(32, 0)
    assert list(other.get_base_page_indices(0)) == [planned_slot]
    src.engine.step(other, other_prompt)
    other.close()
    assert sender.resize(300, 0)  # a new page for block 9, in the same slot
    assert sender.get_base_page_indices(0)[9] == planned_slot
    before = pool_bytes(dst.manager)
    with pytest.raises(ValueError, match=r"src_cache \(cache \d+\) let go of the page planned for block 9 of layer group 0"):
        execute(plan)
    assert all(np.array_equal(a, b) for a, b in zip(before, pool_bytes(dst.manager)))  # nothing moved
    src.engine.step(sender, prompt)  # the engine computes the block again and plans again
    execute(plan_transfer(src.manager, sender, dst.manager, receiver, KVSlice(300), counts))
    dst.engine.check(receiver, prompt)
    dst.decode(receiver, prompt)
    sender.close()
    receiver.close()


def test_a_plan_through_suspend_and_resume_still_runs() -> None:
    """The check is of the page, not of where it is: pages a suspend and resume kept (same objects, same content)
    still match the plan, and it runs."""
    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src, dst = Side(layers, ssm_reuse_interval=32), Side(layers, ssm_reuse_interval=32)
    prompt = seeded_prompt(42, 160)
    sender = src.prefill(prompt)
    receiver, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, sender, dst.manager, receiver, KVSlice(160), counts)
    sender.suspend()
    assert sender.resume()
    execute(plan)
    dst.engine.check(receiver, prompt)
    sender.close()
    receiver.close()


def test_complete_plan_refuses_a_receiver_of_other_tokens_or_another_scope() -> None:
    """``plan_source`` / ``complete_plan`` are the halves a custom transport runs apart: the receiver's half had
    no way to tell which prompt the sources hold. Before: a receiver opened for another prompt (or the same prompt
    in another reuse scope) got a plan, and would have committed the sender's rows under its own tokens."""
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = seeded_prompt(50, 300)
    sender = src.prefill(prompt)
    source = plan_source(src.manager, sender, KVSlice(300), [0, 0])
    assert pickle.loads(pickle.dumps(source)) == source  # the key travels with the plan
    mismatch = r"the plan's rows \[0, 300\) were computed for other tokens or another reuse scope than dst_cache"
    other_prompt = prompt[:200] + seeded_prompt(51, 100)
    for scope, tokens in ((None, other_prompt), (ReuseScope(lora_id=1), prompt)):
        receiver = dst.manager.create_kv_cache(scope, tokens)
        assert receiver.resume() and receiver.resize(300, 300)
        with pytest.raises(ValueError, match=mismatch):
            complete_plan(dst.manager, receiver, source)
        receiver.close()
    # Only the slice's rows are compared: the first 192 tokens of both prompts are one prompt's.
    first_rows = plan_source(src.manager, sender, KVSlice(300, HalfOpenRange(0, 192)), [0, 0])
    receiver = dst.manager.create_kv_cache(None, other_prompt)
    assert receiver.resume() and receiver.resize(300, 300)
    complete_plan(dst.manager, receiver, first_rows)
    with pytest.raises(ValueError, match=mismatch):
        complete_plan(dst.manager, receiver, source)
    receiver.close()
    # A receiver that does not know its tokens that far cannot be checked: refused.
    receiver = dst.manager.create_kv_cache(None, prompt[:100])
    assert receiver.resume() and receiver.resize(300, 300)
    with pytest.raises(ValueError, match=r"dst_cache \(cache \d+\) is known to hold the tokens of its first 100"):
        complete_plan(dst.manager, receiver, source)
    receiver.close()
    receiver, counts = dst.receive(prompt)
    complete_plan(dst.manager, receiver, plan_source(src.manager, sender, KVSlice(300), counts))
    sender.close()
    receiver.close()


def test_plan_source_refuses_a_sender_whose_rows_are_not_known_to_hold_a_prompt() -> None:
    """The sender's half needs the tokens its rows were computed for, to key them: a cache created without them
    (and not committed) is refused, as ``plan_transfer`` and ``KVSender.send_sources`` refuse it."""
    layers: list[LayerConfig] = [attention(0)]
    src = Side(layers)
    sender = src.manager.create_kv_cache(None, [])
    assert sender.resume() and sender.resize(64, 0)
    with pytest.raises(ValueError, match=r"src_cache \(cache \d+\) is known to hold the tokens of its first 0"):
        plan_source(src.manager, sender, KVSlice(64), [0])
    sender.close()


def test_a_pending_plan_keeps_no_dropped_cache_open_and_execute_then_refuses() -> None:
    """A plan an engine still holds refers to its caches as the manager does (their states, not the handles): a
    handle dropped without ``close()`` is closed at the next call, plan or no plan, and ``execute`` then refuses
    with an error naming the cache, writing nothing. Before: the plan held both handles, the dropped sender stayed
    open with its pages in use while the plan lived, and ``execute`` copied from it."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = seeded_prompt(60, 300)
    for dropped in ("src_cache", "dst_cache"):
        sender = src.prefill(prompt)
        receiver, counts = dst.receive(prompt)
        plan = plan_transfer(src.manager, sender, dst.manager, receiver, KVSlice(300), counts)
        side = src if dropped == "src_cache" else dst
        if dropped == "src_cache":
            del sender
            kept = receiver
        else:
            del receiver
            kept = sender
        assert side.manager.num_live_caches == 0  # closed at this read, the plan alive
        before = pool_bytes(dst.manager)
        with pytest.raises(ValueError, match=rf"{dropped} \(cache \d+\) was closed \(or its handle dropped\) since planning"):
            execute(plan)
        assert all(np.array_equal(a, b) for a, b in zip(before, pool_bytes(dst.manager)))  # nothing moved
        kept.close()
        del kept, plan


@pytest.mark.parametrize("scope", [None, ReuseScope(lora_id=3), ReuseScope(salt="s"), ReuseScope(lora_id=1, salt=b"b")])
def test_prompt_key_from_the_tree_is_the_whole_prompt_hashed(scope: ReuseScope | None) -> None:
    """``prompt_key`` takes the key of the committed full blocks from the radix tree and hashes only the tokens
    past them: the value must be the chained key of the whole prefix hashed from the scope's root
    (``sequence_to_blockchain_keys``, what a router computes), for every scope, a slice end inside or past the
    committed blocks (the input past them), a partial tail, and multimodal (bytes) tokens."""
    src = Side([attention(0)])
    tpb = src.manager.tokens_per_block
    texts = seeded_prompt(70, 5 * tpb + 7)
    mixed: list[Token] = [*texts[: 2 * tpb + 3], b"\x00image:1", b"image:2", *texts[2 * tpb + 5 :]]
    for tokens in (texts, mixed):
        for committed in (0, tpb - 1, 2 * tpb, 3 * tpb + 4, len(tokens)):
            cache = src.manager.create_kv_cache(scope, tokens)
            assert cache.resume() and cache.resize(len(tokens))  # (it reuses what the caches before committed)
            cache.commit(tokens[cache.num_committed_tokens : max(committed, cache.num_committed_tokens)])
            for end in sorted({0, 1, tpb, tpb + 1, 2 * tpb, 3 * tpb + 5, 4 * tpb, len(tokens)}):
                keys = [key for _, key in sequence_to_blockchain_keys(tpb, scope, tokens[:end])]
                expected = keys[-1] if keys else root_key(scope)
                assert prompt_key(state_of(cache), "cache", end, tpb) == expected, (committed, end)
            cache.close()
