"""The prefill -> decode handoff across two processes over NIXL (SPEC §7), with the FakeEngine on both sides.

The prefill side is a spawned child (``tests/nixl_helpers.py``); the decode side is this process. Every block
that moves is checked token by token on the decode side (``FakeEngine.check``), the moved blocks and bytes are
compared with a local plan of the same request, and the failure tests kill the child mid-handoff.
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from kv_cache_manager_v2._introspection import receiver_endpoint
from kv_cache_manager_v2 import KVCacheManager, LifeCycle, Priority
from kv_cache_manager_v2._storage.memory import cuda_device_available
from kv_cache_manager_v2.disagg import KVReceiver, TransferError, prepare_receiver
from tests.helpers import KIB, make_config
from tests.nixl_helpers import (
    FAKE_FORMAT,
    ChildSide,
    DecodeSide,
    child_side,
    fake_prefill_side,
    hybrid_layers,
    require_nixl,
    tokens_of,
)
from tests.test_nixl_misbehaving_peer import ConnectionCountingAgent


@pytest.fixture
def child() -> Iterator[ChildSide]:
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        yield side


def blocks(plan_blocks: list[tuple[int, int]], layer_group: int) -> list[int]:
    return sorted({block for lg, block in plan_blocks if lg == layer_group})


def test_only_the_missing_blocks_move_and_arrive_intact(child: ChildSide) -> None:
    decode = DecodeSide(child.connection)
    prompt = tokens_of(1, 400)
    decode.warm(prompt[:128] + tokens_of(2, 20), stops=(128,))  # 4 blocks and an SSM snapshot at 128
    received = prepare_receiver(decode.manager, prompt)
    assert received is not None
    cache, counts = received
    assert cache.num_committed_tokens == 128
    # SSM: no snapshot at 400 -> 0; full: 128; window 64 + sink block at 400: stale [1, (401 - 64) // 32 = 10).
    assert counts == [0, 128, 320]
    result = decode.receiver.receive(cache, prompt, counts)
    plan = result.plan
    moved = [(d.layer_group, d.block) for d in plan.descriptors]
    assert blocks(moved, 0) == [-1] and blocks(moved, 1) == list(range(4, 13)) and blocks(moved, 2) == [10, 11, 12]
    assert plan.blocks_per_layer_group == [1, 9, 3]
    # Exact bytes: the SSM state (16 + 2 KiB per layer, 2 layers), K+V of one 2 KiB layer per attention block.
    assert plan.bytes_per_layer_group == [2 * 18 * KIB, 9 * 2 * 2 * KIB, 3 * 2 * 2 * KIB]
    assert plan.total_bytes == sum(d.num_bytes for d in plan.descriptors)
    assert result.extra == ["prefilled", 400] and result.seconds > 0  # JSON: the tuple arrives as a list
    decode.engine.check(cache, prompt)  # every token of every layer, SSM state included, arrived intact
    cache.commit(prompt[cache.num_committed_tokens :])
    sequence = prompt + tokens_of(3, 3)
    for position in range(400, 403):
        assert cache.resize(position + 1, position)
        decode.engine.step(cache, sequence)
        cache.commit(sequence[position : position + 1])
    cache.close()
    decode.close()
    assert child.wait_exit() == 0  # the child checked its own invariants after releasing every request


def test_a_receiver_holding_the_whole_prompt_reads_nothing_and_the_sender_is_released(child: ChildSide) -> None:
    """Nothing to move: no READ, and no NIXL at all, so the decode side never connects UCX to the prefill side for
    it (UCX 1.23 aborts the process when that peer dies mid-connect); the sender releases the cache when it sends
    the empty plan (its ``wait_released`` would wait 60 s for a notification otherwise, past this side's 30 s).
    Before: a notification without a READ released the sender, and loading the peer for it made UCX connect
    (``loaded`` was 1)."""
    decode = DecodeSide(child.connection, agent_type=ConnectionCountingAgent)
    prompt = tokens_of(4, 256)
    decode.warm(prompt)
    for _ in range(2):  # the sender is released each time, or the second request's answer comes too late
        received = prepare_receiver(decode.manager, prompt)
        assert received is not None
        cache, counts = received
        assert counts == [256, 256, 256]
        result = decode.receiver.receive(cache, prompt, counts)
        assert result.plan.num_descriptors == 0 and result.seconds == 0.0
        decode.engine.check(cache, prompt)
        cache.close()
    assert decode.agent(ConnectionCountingAgent).loaded == 0
    receiver_endpoint(decode.receiver).close()
    decode.manager.shutdown()
    child.connection.close()  # no bye: the prefill side sees the connection end and stops as cleanly
    assert child.wait_exit() == 0


def test_a_request_that_overtakes_the_previous_notification_waits_its_turn(child: ChildSide) -> None:
    """The second request reaches the prefill side while it still waits for the first one's NIXL notification:
    it is queued (a control message of another type than the notifications) and served after the first."""
    decode = DecodeSide(child.connection)
    prompts = [tokens_of(11, 200), tokens_of(12, 300)]
    opened = []
    for prompt in prompts:
        received = prepare_receiver(decode.manager, prompt)
        assert received is not None
        opened.append(received)
    first = decode.receiver.request(opened[0][0], prompts[0], opened[0][1])
    second = decode.receiver.request(opened[1][0], prompts[1], opened[1][1])  # before the first READ
    for (cache, _), prompt, request_id in zip(opened, prompts, (first, second)):
        result = decode.receiver.read(cache, request_id)
        assert result.extra == ["prefilled", len(prompt)]
        decode.engine.check(cache, prompt)
        cache.close()
    decode.close()
    assert child.wait_exit() == 0


def test_bad_requests_send_nothing_and_change_nothing(child: ChildSide) -> None:
    decode = DecodeSide(child.connection)
    prompt = tokens_of(5, 100)
    received = prepare_receiver(decode.manager, prompt)
    assert received is not None
    cache, counts = received
    with pytest.raises(ValueError, match=r"cached_per_group has 2 entries, expected one per layer group \(3\)"):
        decode.receiver.request(cache, prompt, counts[:2])
    with pytest.raises(ValueError, match=r"cached_per_group\[1\] = 5 is neither a multiple of tokens_per_block 32"):
        decode.receiver.request(cache, prompt, [0, 5, 0])
    with pytest.raises(ValueError, match="must be active at history_length 99"):
        decode.receiver.request(cache, prompt[:99], counts)
    with pytest.raises(TypeError, match="text tokens"):
        decode.receiver.request(cache, [b"\x00" * 32, *prompt[1:]], counts)
    assert cache.is_active
    decode.receiver.receive(cache, prompt, counts)  # the child saw none of the bad requests
    decode.engine.check(cache, prompt)
    cache.close()
    decode.close()
    assert child.wait_exit() == 0


@pytest.mark.parametrize("fault", ["exit_after_sources", "exit_before_sources"])
def test_the_prefill_process_dies_mid_handoff(fault: str) -> None:
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", fault) as side:
        decode = DecodeSide(side.connection)
        prompt = tokens_of(6, 300)
        decode.warm(prompt[:64] + tokens_of(7, 10), stops=(64,))  # 2 blocks and an SSM snapshot at 64
        baseline = [stat.unavailable for stat in decode.manager.get_storage_statistics(0)]
        received = prepare_receiver(decode.manager, prompt)
        assert received is not None
        cache, counts = received
        assert cache.num_committed_tokens == 64
        request_id = decode.receiver.request(cache, prompt, counts)
        assert side.wait_exit() == 17  # the prefill side is dead before the decode side reads
        with pytest.raises(TransferError, match="closed the control connection"):  # seen before any NIXL connection
            decode.receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"  # the half-written pages went back, uncommitted
        assert [stat.unavailable for stat in decode.manager.get_storage_statistics(0)] == baseline
        decode.manager.check_invariants()
        again = decode.manager.create_kv_cache(None, prompt)
        assert again.num_committed_tokens == 64  # only the earlier prefix is reusable: nothing received was published
        again.close()
        receiver_endpoint(decode.receiver).close()
        decode.manager.shutdown()


def test_a_request_the_prefill_side_cannot_serve_is_a_transfer_error() -> None:
    require_nixl()
    with child_side(fake_prefill_side, 1, "cpu", "none") as side:  # 1 MiB: too small for the long prompt
        decode = DecodeSide(side.connection)
        long_prompt = tokens_of(9, 8000)
        received = prepare_receiver(decode.manager, long_prompt)
        assert received is not None
        cache, counts = received
        with pytest.raises(TransferError, match="the prefill side failed request 0: no room for 8000 tokens"):
            decode.receiver.receive(cache, long_prompt, counts)
        assert cache.status.name == "CLOSED"
        prompt = tokens_of(10, 100)
        received = prepare_receiver(decode.manager, prompt)
        assert received is not None
        cache, counts = received
        decode.receiver.receive(cache, prompt, counts)  # the prefill side serves the next request
        decode.engine.check(cache, prompt)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_mismatched_layouts_fail_at_the_handshake() -> None:
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        manager = KVCacheManager(make_config(hybrid_layers(), tokens_per_block=16, ssm_reuse_interval=16))
        with pytest.raises(ValueError, match="layouts differ: tokens_per_block is 32 on the sender, 16 on the receiver"):
            KVReceiver(manager, side.connection, timeout_s=30, kv_format=FAKE_FORMAT)
        manager.shutdown()
        assert side.wait_exit() == 1  # the prefill side compared the layouts too and raised the same ValueError


@pytest.mark.skipif(not cuda_device_available(), reason="CuPy sees no CUDA device")
def test_vram_pools_on_both_sides() -> None:
    require_nixl()
    with child_side(fake_prefill_side, 16, "cuda", "none") as side:
        decode = DecodeSide(side.connection, backend="cuda")
        assert receiver_endpoint(decode.receiver).mem_type == "VRAM" and receiver_endpoint(decode.receiver).peer_mem_type == "VRAM"
        prompt = tokens_of(8, 300)
        received = prepare_receiver(decode.manager, prompt)
        assert received is not None
        cache, counts = received
        result = decode.receiver.receive(cache, prompt, counts)
        assert result.plan.blocks_per_layer_group == [1, 10, 4]
        decode.engine.check(cache, prompt)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_a_handoff_from_inside_another_call_is_refused_and_sends_nothing(child: ChildSide) -> None:
    """``request``, ``read`` and ``receive`` change the receiving manager's pages (its copies, the caches they close):
    from a priority callback of another cache they raise RuntimeError naming the call in flight, send and receive
    nothing; the same handoff then runs outside and arrives intact. Before: the request went out from inside the
    call."""
    decode = DecodeSide(child.connection)
    prompt = tokens_of(6, 100)
    received = prepare_receiver(decode.manager, prompt)
    assert received is not None
    cache, counts = received
    refusals: list[str] = []
    calls: list[Callable[[], object]] = [
        lambda: decode.receiver.request(cache, prompt, counts),
        lambda: decode.receiver.read(cache, 0),
        lambda: decode.receiver.receive(cache, prompt, counts),
    ]

    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        for call in calls:
            try:
                call()
            except RuntimeError as error:
                refusals.append(str(error))
        calls.clear()
        return Priority(35)

    other = decode.manager.create_kv_cache(custom_priority_callback=priority)
    assert other.resume() and other.resize(32)
    assert len(refusals) == 3 and all("is in flight" in refusal for refusal in refusals), refusals
    assert cache.is_active
    other.close()
    decode.receiver.receive(cache, prompt, counts)  # the child saw no request from inside the call
    decode.engine.check(cache, prompt)
    cache.close()
    decode.close()
    assert child.wait_exit() == 0
