"""Which answer goes into which cache: a NIXL handoff pairs each request with its own cache and its own answer.

The decode side's ``request`` and ``read`` are two calls, and the prefill side may answer several requests before
the first READ ends; the sender's plan is another process's word. So the receiver remembers what each request asked
for and of which cache (``_handoff/open_requests.py``), keeps an answer that comes before its read, and refuses a
read with another cache, an answer that does not move exactly the blocks asked for, or a READ later than its
request's timeout; the sender keeps an abort of a request it waits for later and refuses to send one request's
sources twice. Every process and agent is started and stopped here; every received prompt is checked token by
token (``FakeEngine.check``).
"""

from __future__ import annotations

import dataclasses
import random
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2 import HalfOpenRange, KVCacheManager
from kv_cache_manager_v2._handoff.control_messages import Abort, Sources, send
from kv_cache_manager_v2.disagg import (
    KVReceiver,
    KVSender,
    KVSlice,
    NixlEndpoint,
    TransferError,
    plan_source,
    prepare_receiver,
)
from kv_cache_manager_v2.testing import FakeEngine
from tests.nixl_helpers import child_side, fake_prefill_side, hybrid_config, require_nixl, send_first_request, tokens_of
from tests.test_nixl_misbehaving_peer import wait_for_the_end
from tests.test_nixl_sender_hold import decode_side
from tests.test_nixl_unfinished_read import StuckReadAgent

PROMPTS = [tokens_of(71, 300), tokens_of(72, 200)]


def lying_prefill_side(connection: Connection, lie: str) -> None:
    """A prefill side that prefills the first request for real, then answers it with a plan that ``lie`` spoils:
    ``drop_last``: without its last two source slots; ``slice``: for the prompt's first 128 tokens only;
    ``counts``: for a receiver holding everything (nothing moves); ``twice``: its last source slot listed again."""
    manager = KVCacheManager(hybrid_config(16))
    sender = KVSender(manager, connection)
    request = sender.next_request()
    assert request is not None
    tokens = request.tokens
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens), cache.history_length)
    FakeEngine(manager).step(cache, tokens)
    cache.commit(tokens)
    counts = [len(tokens)] * 3 if lie == "counts" else request.cached_per_group
    token_range = HalfOpenRange(0, 128) if lie == "slice" else None
    plan = plan_source(manager, cache, KVSlice(len(tokens), token_range), counts)
    if lie == "drop_last":
        plan = dataclasses.replace(plan, sources=plan.sources[:-2])
    if lie == "twice":
        plan = dataclasses.replace(plan, sources=plan.sources + plan.sources[-1:])
    send(connection, Sources(request.request_id, plan, None))
    wait_for_the_end(connection)
    cache.close()
    sender.close()
    manager.shutdown()


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
        manager = KVCacheManager(hybrid_config(8))
        receiver = KVReceiver(manager, side.connection, timeout_s=10)
        prompt = tokens_of(1, 300)
        received = prepare_receiver(manager, prompt)
        assert received is not None
        cache, counts = received
        error, message = LIES[lie]
        with pytest.raises(error, match=message):
            receiver.receive(cache, prompt, counts)
        assert cache.status.name == "CLOSED"  # nothing of it is ever served
        assert manager.create_kv_cache(None, prompt).num_committed_tokens == 0
        manager.check_invariants()
        receiver.close()
        manager.shutdown()


def test_a_read_fills_only_its_own_request_s_cache() -> None:
    """Before: ``read(other_cache, request_id)`` READ request 0's prompt into the other cache (one of the same
    length, or one opened in the slots of the request's closed cache), a cache could be requested twice and a
    request read twice, and ``request`` sent a prompt that did not start with the cache's reused prefix."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        manager = KVCacheManager(hybrid_config(8))
        engine = FakeEngine(manager)
        receiver = KVReceiver(manager, side.connection, timeout_s=30)
        first, second, third = tokens_of(81, 300), tokens_of(82, 300), tokens_of(83, 300)
        warm = manager.create_kv_cache(None, second[:128])
        assert warm.resume() and warm.resize(128, 0)
        engine.step(warm, second[:128])
        warm.commit(second[:128])
        warm.close()
        opened = [prepare_receiver(manager, prompt) for prompt in (first, second)]
        assert opened[0] is not None and opened[1] is not None
        (cache, counts), (other, other_counts) = opened[0], opened[1]
        assert other.num_committed_tokens == 128
        with pytest.raises(ValueError, match="reused a prefix of 128 tokens that tokens does not start with"):
            receiver.request(other, first, other_counts)
        request_id = receiver.request(cache, first, counts)
        with pytest.raises(ValueError, match=f"has request {request_id} still to read"):
            receiver.request(cache, first, counts)
        with pytest.raises(ValueError, match=f"is not the cache request {request_id} was made for"):
            receiver.read(other, request_id)
        with pytest.raises(ValueError, match="names no request of this receiver still to read"):
            receiver.read(cache, request_id + 1)
        assert cache.is_active and other.is_active  # refused before anything was received
        receiver.read(cache, request_id)
        engine.check(cache, first)
        with pytest.raises(ValueError, match="names no request"):
            receiver.read(cache, request_id)  # read once
        cache.close()

        request_id = receiver.request(other, second, other_counts)
        other.close()  # given up: its slots go back, and a new cache of the same length takes them
        received = prepare_receiver(manager, third)
        assert received is not None
        cache, counts = received
        with pytest.raises(ValueError, match="is not the cache request"):
            receiver.read(cache, request_id)
        with pytest.raises(ValueError, match="must be active"):  # the answer is taken, the sender told
            receiver.read(other, request_id)
        receiver.receive(cache, third, counts)
        engine.check(cache, third)
        cache.close()
        receiver.close()
        manager.check_invariants()
        manager.shutdown()
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
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30, agent_factory=SlowReadAgent)
    opened = [prepare_receiver(manager, prompt) for prompt in PROMPTS]
    requests = []
    for received, prompt in zip(opened, PROMPTS):
        assert received is not None
        requests.append((received[0], prompt, receiver.request(received[0], prompt, received[1])))
    for cache, prompt, request_id in reversed(requests) if reversed_reads else requests:
        receiver.read(cache, request_id)
        FakeEngine(manager).check(cache, prompt)
        cache.close()
    receiver.close()
    manager.shutdown()


@pytest.mark.parametrize("reversed_reads", [False, True], ids=["in_order", "reversed"])
def test_answers_sent_ahead_wait_for_their_reads(reversed_reads: bool) -> None:
    """The prefill side answers both requests before the first READ ends. Before: the second answer, arriving
    while the first READ ran, failed it ('unexpected control message during a transfer': the child exited 1,
    the sender saw [True, False]); read in reverse order, the first answer failed the second request's read."""
    require_nixl()
    with child_side(decode_two, reversed_reads) as side:
        manager = KVCacheManager(hybrid_config(16))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        served = []
        for _ in PROMPTS:
            request = sender.next_request()
            assert request is not None
            cache = manager.create_kv_cache(None, request.tokens)
            assert cache.resume() and cache.resize(len(request.tokens), 0)
            engine.step(cache, request.tokens)
            cache.commit(request.tokens)
            served.append((request, cache))
        for request, cache in served:
            sender.send_sources(request, cache)
        assert [sender.wait_released(request, timeout_s=20) for request, _ in served] == [True, True]
        for _, cache in served:
            cache.close()
        assert side.wait_exit(30) == 0
        sender.close()
        manager.check_invariants()
        manager.shutdown()


def decode_aborting_the_second(connection: Connection) -> None:
    """Request both ``PROMPTS``, give the second up at once (an abort, as a decode side of another make may send),
    then read the first."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30)
    opened = [prepare_receiver(manager, prompt) for prompt in PROMPTS]
    assert opened[0] is not None and opened[1] is not None
    request_id = receiver.request(opened[0][0], PROMPTS[0], opened[0][1])
    given_up = receiver.request(opened[1][0], PROMPTS[1], opened[1][1])
    send(connection, Abort(given_up, "the user left"))
    receiver.read(opened[0][0], request_id)
    FakeEngine(manager).check(opened[0][0], PROMPTS[0])
    opened[0][0].close()
    opened[1][0].close()
    receiver.close()
    wait_for_the_end(connection)
    manager.shutdown()


def test_an_abort_of_a_request_waited_for_later_releases_it_at_once() -> None:
    """The abort of request 1 reaches the sender while it waits for request 0's READ. Before: it was queued as if
    a request and dropped, and ``wait_released`` of request 1 held its pages for its whole timeout (10 s)."""
    require_nixl()
    with child_side(decode_aborting_the_second) as side:
        manager = KVCacheManager(hybrid_config(16))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        served = []
        for _ in PROMPTS:
            request = sender.next_request()
            assert request is not None
            cache = manager.create_kv_cache(None, request.tokens)
            assert cache.resume() and cache.resize(len(request.tokens), 0)
            engine.step(cache, request.tokens)
            cache.commit(request.tokens)
            sender.send_sources(request, cache)
            served.append((request, cache))
        assert sender.wait_released(served[0][0], timeout_s=10)
        start = time.monotonic()
        assert not sender.wait_released(served[1][0], timeout_s=10)
        assert time.monotonic() - start < 2
        for _, cache in served:
            cache.close()
        assert sender.next_request() is None  # bye
        sender.close()
        manager.check_invariants()
        manager.shutdown()
        side.connection.close()
        assert side.wait_exit() == 0


def test_sources_sent_twice_are_refused() -> None:
    """Before: a second ``send_sources`` of one request went out and moved the hold to the cache it named, so the
    cache of the first, which the decode side READs, could be closed and its slots given away."""
    require_nixl()
    with child_side(decode_side) as side:
        manager, sender, request, cache = send_first_request(side)
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
        sender.close()
        manager.check_invariants()
        manager.shutdown()


def late_first_answer_side(connection: Connection, delay_s: float) -> None:
    """``fake_prefill_side``'s service, its first answer ``delay_s`` late (a long prefill)."""
    manager = KVCacheManager(hybrid_config(16))
    engine = FakeEngine(manager)
    sender = KVSender(manager, connection)
    released: list[bool] = []
    while (request := sender.next_request()) is not None:
        cache = manager.create_kv_cache(None, request.tokens)
        assert cache.resume() and cache.resize(len(request.tokens), 0)
        engine.step(cache, request.tokens)
        cache.commit(request.tokens)
        time.sleep(delay_s if not released else 0)
        sender.send_sources(request, cache)
        released.append(sender.wait_released(request))
        cache.close()
    assert released == [False, True], released  # the first was given up (an abort), the second read
    sender.close()
    manager.shutdown()


def test_an_answer_after_its_read_gave_up_is_dropped_not_taken_for_the_next() -> None:
    """The decode side's read of request 0 times out; the prefill side's late answer then reaches the read of
    request 1. Before: that read failed too ('expected the sources of request 1, got Sources(request_id=0...')."""
    require_nixl()
    with child_side(late_first_answer_side, 1.5) as side:
        manager = KVCacheManager(hybrid_config(8))
        receiver = KVReceiver(manager, side.connection, timeout_s=30)  # the child may take seconds to start
        receiver.timeout_s = 1.0
        for seed, late in ((91, True), (92, False)):
            prompt = tokens_of(seed, 300)
            received = prepare_receiver(manager, prompt)
            assert received is not None
            cache, counts = received
            if late:
                with pytest.raises(TransferError, match="no the sources of request 0 from the peer in time"):
                    receiver.receive(cache, prompt, counts)
                assert cache.status.name == "CLOSED"
                receiver.timeout_s = 30.0  # the next request waits for the late answer, then its own
                continue
            receiver.receive(cache, prompt, counts)
            FakeEngine(manager).check(cache, prompt)
            cache.close()
        receiver.close()
        manager.check_invariants()
        manager.shutdown()
        assert side.wait_exit() == 0


def impatient_prefill_side(connection: Connection, wait_s: float) -> None:
    """Answers the first request without publishing it, gives up waiting after ``wait_s``, closes the cache and
    fills every free GPU slot with other prompts' KV, as a busy prefill side does with the slots it got back."""
    manager = KVCacheManager(hybrid_config(2))
    engine = FakeEngine(manager)
    sender = KVSender(manager, connection)
    request = sender.next_request()
    assert request is not None
    cache = manager.create_kv_cache(None, request.tokens)
    assert cache.resume() and cache.resize(len(request.tokens), 0)
    engine.step(cache, request.tokens)
    sender.send_sources(request, cache)
    assert not sender.wait_released(request, timeout_s=wait_s)
    cache.close()
    fillers = []
    for seed in range(100, 200):
        filler = manager.create_kv_cache()
        if not filler.resume() or not filler.resize(len(request.tokens), 0):
            filler.close()
            break
        engine.step(filler, tokens_of(seed, len(request.tokens)))
        fillers.append(filler)
    assert fillers
    assert sender.next_request() is None  # the decode side's abort, then its bye
    for filler in fillers:
        filler.close()
    sender.close()
    manager.shutdown()


def test_a_read_later_than_its_timeout_after_the_request_never_starts() -> None:
    """The engine reads a request long after sending it, past the time the prefill side (with the same timeout)
    waits for its READ: the read fails before any READ. Before: the deadline started at ``read``, the READ ran
    on the slots the prefill side had since given to other prompts, and ``receive`` returned them as this one's
    (ContentError at every position)."""
    require_nixl()
    with child_side(impatient_prefill_side, 2.0) as side:
        manager = KVCacheManager(hybrid_config(8))
        receiver = KVReceiver(manager, side.connection, timeout_s=30)  # the child may take seconds to start
        receiver.timeout_s = 2.0
        prompt = tokens_of(95, 300)
        received = prepare_receiver(manager, prompt)
        assert received is not None
        cache, counts = received
        request_id = receiver.request(cache, prompt, counts)
        time.sleep(3.5)  # the engine is busy elsewhere
        with pytest.raises(TransferError, match="in time"):
            receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"
        receiver.close()
        manager.check_invariants()
        manager.shutdown()
        assert side.wait_exit() == 0


def resources() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count() + len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_closed_endpoint_lets_go_of_its_agent() -> None:
    """Before: a closed endpoint still referenced (a receiver kept by the engine, an exception's traceback) kept its
    NIXL agent: 15 descriptors and a thread each, until it was garbage."""
    require_nixl()
    manager = KVCacheManager(hybrid_config(8))
    NixlEndpoint(manager, "warm-up").close()  # NIXL's own one-time state
    before = resources()
    closed = [NixlEndpoint(manager, "closed") for _ in range(4)]
    for endpoint in closed:
        endpoint.close()
    assert resources() == before
    with pytest.raises(ValueError, match="this NIXL endpoint is closed"):
        closed[0].metadata()
    closed[0].close()  # idempotent
    manager.shutdown()


def test_sources_from_a_cache_of_another_prompt_are_refused() -> None:
    """The prefill engine hands ``send_sources`` the cache of another prompt of the same length. Before: its KV went
    out as the request's (the decode child exited 1, 'wrong content at positions [0, 1, ...]')."""
    require_nixl()
    with child_side(decode_side) as side:
        manager = KVCacheManager(hybrid_config(16))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        request = sender.next_request()
        assert request is not None
        caches = []
        for tokens in (tokens_of(64, len(request.tokens)), request.tokens):
            cache = manager.create_kv_cache(None, tokens)
            assert cache.resume() and cache.resize(len(tokens), 0)
            engine.step(cache, tokens)
            cache.commit(tokens)
            caches.append(cache)
        with pytest.raises(ValueError, match="committed 300 tokens that request 0's tokens do not start with"):
            sender.send_sources(request, caches[0])
        assert not caches[0].held_for
        sender.send_sources(request, caches[1])
        assert sender.wait_released(request, timeout_s=30)
        for cache in caches:
            cache.close()
        assert sender.next_request() is None
        assert side.wait_exit() == 0  # the decode side read every page as written
        sender.close()
        manager.check_invariants()
        manager.shutdown()


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
    manager = KVCacheManager(hybrid_config(3))
    engine = FakeEngine(manager)
    receiver = KVReceiver(manager, connection, timeout_s=30)
    for round_index in range(ROUNDS):
        pending = []
        for prompt in round_prompts(round_index):
            received = prepare_receiver(manager, prompt)
            assert received is not None
            pending.append((received[0], prompt, receiver.request(received[0], prompt, received[1])))
        rng.shuffle(pending)
        for cache, prompt, request_id in pending:
            churn(manager, engine, rng.randrange(10**6))
            receiver.read(cache, request_id)
            engine.check(cache, prompt)
            cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
        manager.check_invariants()
    receiver.close()
    manager.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_many_answers_ahead_read_in_random_order_amid_eviction_arrive_intact(seed: int) -> None:
    """Both sides admit and evict other requests between every handoff step; the prefill side answers a whole
    round before waiting for any READ. Before: the first read out of order failed ('expected the sources of
    request 4, got Sources(request_id=0, ...'), and the sender's wait_released was False."""
    require_nixl()
    with child_side(shuffling_decode_side, seed) as side:
        rng = random.Random(seed)
        manager = KVCacheManager(hybrid_config(8))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        for _ in range(ROUNDS):
            served = []
            for _ in range(PER_ROUND):
                request = sender.next_request()
                assert request is not None
                churn(manager, engine, rng.randrange(10**6))
                cache = manager.create_kv_cache(None, request.tokens)
                assert cache.resume() and cache.resize(len(request.tokens), cache.history_length)
                engine.step(cache, request.tokens)
                cache.commit(request.tokens[cache.num_committed_tokens :])
                sender.send_sources(request, cache)
                served.append((request, cache))
            for request, cache in served:
                assert sender.wait_released(request, timeout_s=30)
                cache.close()
            manager.check_invariants()
        assert sender.next_request() is None
        sender.close()
        manager.shutdown()
        assert side.wait_exit() == 0


def abandoning_decode_side(connection: Connection, pipelined: bool) -> None:
    """Request both ``PROMPTS`` (``pipelined``: both before any read; else the second after giving up the first),
    give one up by closing its cache, and read the other; a slow READ lets the prefill side hear the abort first."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30, agent_factory=SlowReadAgent)
    first_received, second_received = (prepare_receiver(manager, prompt) for prompt in PROMPTS)
    assert first_received is not None and second_received is not None
    (first, first_counts), (second, second_counts) = first_received, second_received
    if pipelined:  # the second is given up; the abort goes out with the first's read
        first_id = receiver.request(first, PROMPTS[0], first_counts)
        receiver.request(second, PROMPTS[1], second_counts)
        second.close()
        receiver.read(first, first_id)
        FakeEngine(manager).check(first, PROMPTS[0])
    else:  # the first is given up; the abort goes out with the second's request
        receiver.request(first, PROMPTS[0], first_counts)
        first.close()
        receiver.receive(second, PROMPTS[1], second_counts)
        FakeEngine(manager).check(second, PROMPTS[1])
    first.close()
    second.close()
    wait_for_the_end(connection)  # quiet until the prefill side is done: its wait must not end by our exit
    receiver.close()
    manager.shutdown()


@pytest.mark.parametrize("pipelined", [False, True], ids=["one_at_a_time", "answered_ahead"])
def test_a_request_whose_cache_was_closed_is_given_up_at_once(pipelined: bool) -> None:
    """The decode engine closes a receiving cache between ``request`` and ``read`` (its client left). Before: nothing
    told the prefill side, whose ``wait_released`` held the request's pages for its whole timeout (10 s here),
    and the receiver kept the request (and any answer) for its life. Now the receiver's next call sends an abort,
    which the sender keeps even when it comes before that request's sources went out."""
    require_nixl()
    with child_side(abandoning_decode_side, pipelined) as side:
        manager = KVCacheManager(hybrid_config(16))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        requests = [sender.next_request() for _ in range(2 if pipelined else 1)]
        served = []
        for request in requests:
            assert request is not None
            cache = manager.create_kv_cache(None, request.tokens)
            assert cache.resume() and cache.resize(len(request.tokens), 0)
            engine.step(cache, request.tokens)
            served.append((request, cache))
        if pipelined:
            sender.send_sources(*served[0])
            assert sender.wait_released(served[0][0], timeout_s=10)  # the abort of the second comes meanwhile
            given_up = served[1]
        else:
            given_up = served[0]
        sender.send_sources(*given_up)
        start = time.monotonic()
        assert not sender.wait_released(given_up[0], timeout_s=10)
        assert time.monotonic() - start < 2
        if not pipelined:
            request = sender.next_request()
            assert request is not None
            cache = manager.create_kv_cache(None, request.tokens)
            assert cache.resume() and cache.resize(len(request.tokens), 0)
            engine.step(cache, request.tokens)
            sender.send_sources(request, cache)
            assert sender.wait_released(request, timeout_s=10)
            served.append((request, cache))
        for _, cache in served:
            cache.close()
        sender.close()
        manager.check_invariants()
        manager.shutdown()
        side.connection.close()
        assert side.wait_exit() == 0


class LateLookingAgent(StuckReadAgent):
    """A real agent whose READ has ended (and notified the peer) when ``transfer`` returns, which reports PROC
    after a 0.5 s pause: the decode side looks at the state only after the prefill side may have left."""

    def transfer(self, handle: object) -> str:
        state = self.real.transfer(handle)
        while state == "PROC":
            state = self.real.check_xfer_state(handle)
        time.sleep(0.5)
        return "PROC"


def late_looking_decode_side(connection: Connection) -> None:
    """Receive one prompt through a ``LateLookingAgent`` and check it; exits 1 on any error."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30, agent_factory=LateLookingAgent)
    received = prepare_receiver(manager, PROMPTS[0])
    assert received is not None
    cache, counts = received
    receiver.receive(cache, PROMPTS[0], counts)
    FakeEngine(manager).check(cache, PROMPTS[0])
    cache.close()
    receiver.close()
    manager.shutdown()


def test_a_read_done_before_the_prefill_side_left_is_whole() -> None:
    """The prefill side, notified that the READ ended, closes its connection at once (its last request) while the
    decode side has yet to see the READ's state. Before: the decode side took the closed connection for a gone peer
    and failed a READ that had ended ('the prefill side closed the control connection (it died or gave up)',
    the child exited 1); now it asks NIXL first."""
    require_nixl()
    with child_side(late_looking_decode_side) as side:
        manager = KVCacheManager(hybrid_config(16))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection)
        request = sender.next_request()
        assert request is not None
        cache = manager.create_kv_cache(None, request.tokens)
        assert cache.resume() and cache.resize(len(request.tokens), 0)
        engine.step(cache, request.tokens)
        sender.send_sources(request, cache)
        assert sender.wait_released(request, timeout_s=10)
        cache.close()
        sender.close()
        side.connection.close()
        assert side.wait_exit() == 0
        manager.check_invariants()
        manager.shutdown()
