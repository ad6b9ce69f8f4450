"""Which answer goes into which cache: a NIXL handoff pairs each request with its own cache and its own answer.

The decode side's ``request`` and ``read`` are two calls, and the prefill side may answer several requests before
the first READ ends; the sender's plan is another process's word. So the receiver remembers what each request asked
for and of which cache (``_handoff/open_requests.py``), keeps an answer that comes before its read, and refuses a
read with another cache or an answer that does not move exactly the blocks asked for; the sender refuses to send
one request's sources twice or from another prompt's cache. How a handoff ends early is
``tests/test_nixl_giving_up.py``. Every process and agent is started and stopped here; every received prompt is
checked token by token (``FakeEngine.check``).
"""

from __future__ import annotations

import random
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

from kv_cache_manager_v2 import HalfOpenRange, KVCacheManager
from kv_cache_manager_v2._handoff.control_messages import Sources, send
from kv_cache_manager_v2.disagg import KVSlice, SourcePlan, TransferError, plan_source
from kv_cache_manager_v2.testing import FakeEngine
from tests.nixl_helpers import (
    DecodeSide, PrefillSide, child_side, fake_prefill_side, prefill, require_nixl, tokens_of, wait_for_the_end,
)
from tests.test_nixl_sender_hold import decode_side
from tests.test_nixl_unfinished_read import StuckReadAgent

PROMPTS = [tokens_of(71, 300), tokens_of(72, 200)]


def lying_prefill_side(connection: Connection, lie: str) -> None:
    """A prefill side that prefills the first request for real, then answers it with a plan that ``lie`` spoils:
    ``drop_last``: without its last two source slots; ``slice``: for the prompt's first 128 tokens only;
    ``counts``: for a receiver holding everything (nothing moves); ``twice``: its last source slot listed again."""
    prefill_side = PrefillSide(connection)
    manager = prefill_side.manager
    request, cache = prefill_side.serve()
    tokens = request.tokens
    counts = [len(tokens)] * 3 if lie == "counts" else request.cached_per_group
    token_range = HalfOpenRange(0, 128) if lie == "slice" else None
    plan = plan_source(manager, cache, KVSlice(len(tokens), token_range), counts)
    if lie == "drop_last":
        plan = SourcePlan(plan.kv_slice, plan.tokens_per_block, plan.groups, plan.sources[:-2], plan.prompt_key)
    if lie == "twice":
        plan = SourcePlan(plan.kv_slice, plan.tokens_per_block, plan.groups, plan.sources + plan.sources[-1:], plan.prompt_key)
    send(connection, Sources(request.request_id, plan, None))
    wait_for_the_end(connection)
    cache.close()
    prefill_side.close()


LIES = {
    "drop_last": (ValueError, r"the plan lacks block \d+ \(pool \d\) of layer group 2"),
    "slice": (TransferError, r"answered request 0 with KVSlice\(prompt_len=300, token_range=\[0, 128\)\), not the whole"),
    "counts": (TransferError, r"answered request 0 for cached counts \[300, 300, 300\], not the \[0, 0, 0\] sent"),
    "twice": (ValueError, r"the plan moves block \d+ \(pool \d\) of layer group 2 twice"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_an_answer_that_does_not_move_exactly_what_was_asked_is_refused(lie: str) -> None:
    """Before: ``receive`` returned for each of these and the cache held blocks the READ never wrote
    (``drop_last``, ``slice``, ``counts``: ContentError at positions 256.., 128.. and 0..); a block listed twice
    was accepted."""
    require_nixl()
    with child_side(lying_prefill_side, lie) as side:
        decode = DecodeSide(side.connection, timeout_s=10)
        prompt = tokens_of(1, 300)
        cache, counts = decode.open(prompt)
        error, message = LIES[lie]
        with pytest.raises(error, match=message):
            decode.receiver.receive(cache, prompt, counts)
        assert cache.status.name == "CLOSED"  # nothing of it is ever served
        assert decode.manager.create_kv_cache(None, prompt).num_committed_tokens == 0
        decode.close()


def test_a_read_fills_only_its_own_request_s_cache() -> None:
    """Before: ``read(other_cache, request_id)`` READ request 0's prompt into the other cache (one of the same
    length, or one opened in the slots of the request's closed cache), a cache could be requested twice and a
    request read twice, and ``request`` sent a prompt that did not start with the cache's reused prefix."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection)
        manager, engine, receiver = decode.manager, decode.engine, decode.receiver
        first, second, third = tokens_of(81, 300), tokens_of(82, 300), tokens_of(83, 300)
        warm = manager.create_kv_cache(None, second[:128])
        assert warm.resume() and warm.resize(128, 0)
        engine.step(warm, second[:128])
        warm.commit(second[:128])
        warm.close()
        (cache, counts), (other, other_counts) = decode.open(first), decode.open(second)
        assert other.num_committed_tokens == 128
        with pytest.raises(ValueError, match=rf"cache {other.id} token 0 is \d+, the request's is \d+: the receiver would"):
            receiver.request(other, first, other_counts)  # its reused prefix is another prompt's
        (third_cache, third_counts) = decode.open(third)
        with pytest.raises(ValueError, match=rf"cache {third_cache.id} token 0 is \d+, the request's is \d+: the receiver"):
            receiver.request(third_cache, first, third_counts)  # nothing committed: it was opened for another prompt
        third_cache.close()
        request_id = receiver.request(cache, first, counts)
        with pytest.raises(ValueError, match=f"has request {request_id} still to read"):
            receiver.request(cache, first, counts)
        with pytest.raises(ValueError, match=f"is not the cache request {request_id} was made for"):
            receiver.read(other, request_id)
        with pytest.raises(ValueError, match="names no request of this receiver still to read"):
            receiver.read(cache, request_id + 1)
        with pytest.raises(TypeError, match="request_id must be an integer, got bool"):
            receiver.read(cache, True)
        assert cache.is_active and other.is_active  # refused before anything was received
        receiver.read(cache, np.int64(request_id))  # a NumPy integer names it too, in both modes
        engine.check(cache, first)
        with pytest.raises(ValueError, match="names no request"):
            receiver.read(cache, request_id)  # read once
        cache.close()

        request_id = receiver.request(other, second, other_counts)
        other.close()  # given up: its slots go back, and a new cache of the same length takes them
        cache, counts = decode.open(third)
        with pytest.raises(ValueError, match="is not the cache request"):
            receiver.read(cache, request_id)
        with pytest.raises(ValueError, match="must be active"):  # the answer is taken, the sender told
            receiver.read(other, request_id)
        receiver.receive(cache, third, counts)
        engine.check(cache, third)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_a_receiving_cache_committed_to_another_prompt_before_its_read_is_refused() -> None:
    """Between ``request`` and ``read`` the decode engine commits other tokens into the receiving cache, less than a
    block (no committed page for ``complete_plan`` to keep). Before: the READ wrote the request's prompt under them,
    and a check of the cache against what it committed failed ('wrong content at positions [0, 1, ...]')."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection)
        engine, receiver = decode.engine, decode.receiver
        prompt, other = tokens_of(91, 300), tokens_of(92, 8)
        cache, counts = decode.open(prompt)
        request_id = receiver.request(cache, prompt, counts)
        cache.commit(other)
        with pytest.raises(ValueError, match=rf"cache {cache.id} token 0 is {other[0]}, the request's is {prompt[0]}: "):
            receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"  # as after any failed read: nothing it received is committed
        cache, counts = decode.open(prompt)
        receiver.receive(cache, prompt, counts)
        engine.check(cache, prompt)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_a_receiving_cache_suspended_between_request_and_read() -> None:
    """The decode engine may suspend the receiving cache between ``request`` and ``read`` (preempted while the
    prefill side computes). Still suspended at ``read``: refused (``complete_plan`` wants its pages locked), the
    cache closed as after any failed read and the sender told, which serves the next request; suspended and resumed
    again: the read pairs the sources with the slots the cache holds then, and the prompt arrives intact."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection)
        engine, receiver = decode.engine, decode.receiver
        prompt = tokens_of(93, 300)
        cache, counts = decode.open(prompt)
        request_id = receiver.request(cache, prompt, counts)
        cache.suspend()
        with pytest.raises(ValueError, match=rf"dst_cache \(cache {cache.id}\) must be active, it is SUSPENDED"):
            receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"
        cache, counts = decode.open(prompt)
        request_id = receiver.request(cache, prompt, counts)
        cache.suspend()
        assert cache.resume()
        receiver.read(cache, request_id)
        engine.check(cache, prompt)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


class SlowReadAgent(StuckReadAgent):
    """A real agent whose READs report PROC for their first 0.3 s, as a long transfer does."""

    def transfer(self, handle: object) -> str:
        self.real.transfer(handle)
        time.sleep(0.3)
        return "PROC"


def decode_two(connection: Connection, reversed_reads: bool) -> None:
    """Request both ``PROMPTS``, then read them (in reverse order with ``reversed_reads``), checking each; exits 1
    (an assertion or a ``TransferError``) when a read fails."""
    decode = DecodeSide(connection, agent_type=SlowReadAgent)
    requests = []
    for prompt in PROMPTS:
        cache, counts = decode.open(prompt)
        requests.append((cache, prompt, decode.receiver.request(cache, prompt, counts)))
    for cache, prompt, request_id in reversed(requests) if reversed_reads else requests:
        decode.receiver.read(cache, request_id)
        decode.engine.check(cache, prompt)
        cache.close()
    decode.close()


@pytest.mark.parametrize("reversed_reads", [False, True], ids=["in_order", "reversed"])
def test_answers_sent_ahead_wait_for_their_reads(reversed_reads: bool) -> None:
    """The prefill side answers both requests before the first READ ends. Before: the second answer, arriving
    while the first READ ran, failed it ('unexpected control message during a transfer': the child exited 1,
    the sender saw [True, False]); read in reverse order, the first answer failed the second request's read."""
    require_nixl()
    with child_side(decode_two, reversed_reads) as side:
        prefill_side = PrefillSide(side.connection)
        sender = prefill_side.sender
        served = [prefill_side.serve() for _ in PROMPTS]
        for request, cache in served:
            sender.send_sources(request, cache)
        assert [sender.wait_released(request) for request, _ in served] == [True, True]
        for _, cache in served:
            cache.close()
        assert side.wait_exit(30) == 0
        prefill_side.close()


def test_sources_sent_twice_are_refused() -> None:
    """Before: a second ``send_sources`` of one request went out and moved the hold to the cache it named, so the
    cache of the first, which the decode side READs, could be closed and its slots given away."""
    require_nixl()
    with child_side(decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        manager, sender = prefill_side.manager, prefill_side.sender
        request, cache = prefill_side.serve(send=True)
        other = manager.create_kv_cache(None, request.tokens)
        assert other.resume() and other.resize(len(request.tokens), other.history_length)
        for again in (cache, other):
            with pytest.raises(ValueError, match="the sources of request 0 were sent already: wait_released first"):
                sender.send_sources(request, again)
        assert cache.held_for and not other.held_for
        other.close()
        assert sender.wait_released(request, timeout_s=30)
        cache.close()
        assert sender.next_request() is None
        assert side.wait_exit() == 0  # the decode side read every page as written
        prefill_side.close()


def test_sources_from_a_cache_of_another_prompt_are_refused() -> None:
    """The prefill engine hands ``send_sources`` the cache of another prompt of the same length. Before: its KV went
    out as the request's (the decode child exited 1, 'wrong content at positions [0, 1, ...]')."""
    require_nixl()
    with child_side(decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        manager, engine, sender = prefill_side.manager, prefill_side.engine, prefill_side.sender
        request = sender.next_request()
        assert request is not None
        caches = []
        other = request.tokens[:200] + tokens_of(64, len(request.tokens) - 200)
        for tokens, committed in ((tokens_of(64, len(request.tokens)), 300), (other, 200), (request.tokens, 300)):
            cache = manager.create_kv_cache(None, tokens)  # the last reuses the second's committed blocks
            assert cache.resume() and cache.resize(len(tokens), cache.history_length)
            engine.step(cache, tokens)
            cache.commit(tokens[cache.num_committed_tokens : committed])
            caches.append(cache)
        with pytest.raises(ValueError, match=r"token 0 is \d+, request 0's is \d+: the receiver would serve another"):
            sender.send_sources(request, caches[0])
        with pytest.raises(ValueError, match=r"token 200 is \d+, request 0's is \d+: the receiver would serve another"):
            sender.send_sources(request, caches[1])  # its committed tokens start the prompt, its later rows do not
        assert not caches[0].held_for and not caches[1].held_for
        sender.send_sources(request, caches[2])
        assert sender.wait_released(request, timeout_s=30)
        for cache in caches:
            cache.close()
        assert sender.next_request() is None
        assert side.wait_exit() == 0  # the decode side read every page as written
        prefill_side.close()


SYSTEM_PROMPT = tokens_of(300, 128)
ROUNDS, PER_ROUND = 3, 8


def round_prompts(round_index: int) -> list[list[int]]:
    """Half share a system prompt (reused more each round), half end in a round's own tokens."""
    prompts = []
    for i in range(PER_ROUND):
        body = tokens_of(400 + i, 100 + 37 * i)
        prompts.append(SYSTEM_PROMPT + body if i % 2 == 0 else body + tokens_of(500 + round_index, 50))
    return prompts


def churn(manager: KVCacheManager, engine: FakeEngine, seed: int) -> None:
    """Another request computed, published and closed: admission and eviction between two handoff steps."""
    tokens = tokens_of(seed, 200)
    cache = manager.create_kv_cache(None, tokens)
    if cache.resume() and cache.resize(200, cache.history_length):
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def shuffling_decode_side(connection: Connection, seed: int) -> None:
    """Each round: request every prompt, then read them in a random order with another request between reads,
    check each token by token, publish it (later rounds reuse it) and close it."""
    rng = random.Random(seed)
    decode = DecodeSide(connection, gpu_mib=3)
    manager, engine, receiver = decode.manager, decode.engine, decode.receiver
    for round_index in range(ROUNDS):
        pending = []
        for prompt in round_prompts(round_index):
            cache, counts = decode.open(prompt)
            pending.append((cache, prompt, receiver.request(cache, prompt, counts)))
        rng.shuffle(pending)
        for cache, prompt, request_id in pending:
            churn(manager, engine, rng.randrange(10**6))
            receiver.read(cache, request_id)
            engine.check(cache, prompt)
            cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
        manager.check_invariants()
    decode.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_many_answers_ahead_read_in_random_order_amid_eviction_arrive_intact(seed: int) -> None:
    """Both sides admit and evict other requests between every handoff step; the prefill side answers a whole
    round before waiting for any READ. Before: the first read out of order failed ('expected the sources of
    request 4, got Sources(request_id=0, ...'), and the sender's wait_released was False."""
    require_nixl()
    with child_side(shuffling_decode_side, seed) as side:
        rng = random.Random(seed)
        prefill_side = PrefillSide(side.connection, gpu_mib=8)
        manager, engine, sender = prefill_side.manager, prefill_side.engine, prefill_side.sender
        for _ in range(ROUNDS):
            served = []
            for _ in range(PER_ROUND):
                request = sender.next_request()
                assert request is not None
                churn(manager, engine, rng.randrange(10**6))
                cache = prefill(manager, engine, request)
                cache.commit(request.tokens[cache.num_committed_tokens :])
                sender.send_sources(request, cache)
                served.append((request, cache))
            for request, cache in served:
                assert sender.wait_released(request, timeout_s=30)
                cache.close()
            manager.check_invariants()
        assert sender.next_request() is None
        prefill_side.close()
        assert side.wait_exit() == 0


def test_a_closed_receiver_refuses_requests_and_reads_changing_nothing() -> None:
    """Before: ``request`` on a closed receiver sent a request after its bye (or, the prefill side gone, closed the
    caller's cache on the failed send), and ``close`` sent a second bye."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection)
        receiver = decode.receiver
        prompt = tokens_of(66, 100)
        cache, counts = decode.open(prompt)
        receiver.close()
        assert side.wait_exit() == 0  # the prefill side heard the bye and left
        with pytest.raises(ValueError, match="this KVReceiver is closed"):
            receiver.request(cache, prompt, counts)
        with pytest.raises(ValueError, match="this KVReceiver is closed"):
            receiver.read(cache, 0)
        assert cache.is_active
        receiver.close()  # idempotent
        cache.close()
        decode.close()  # closes the receiver a third time
