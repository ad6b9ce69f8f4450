"""How a NIXL handoff ends early, and what each side holds afterwards: the decode side gives a request up (an
abort, a receiving cache closed before its read, a read that timed out), reads later than its request's timeout,
or the prefill side leaves (its sender closed, its connection ended after the READ). Pages are released at once
and never read once released, an answer that comes late is dropped, a READ that ended is kept, a closed endpoint's
agent (threads, descriptors) is gone. Every process and agent is started and stopped here."""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._handoff.control_messages import Abort, send
from kv_cache_manager_v2.disagg import NixlEndpoint, TransferError
from tests.nixl_helpers import (
    DecodeSide, PrefillSide, child_side, hybrid_config, prefill, require_nixl, tokens_of, wait_for_the_end,
)
from tests.test_nixl_request_pairing import PROMPTS, SlowReadAgent
from tests.test_nixl_unfinished_read import StuckReadAgent


def decode_aborting_the_second(connection: Connection) -> None:
    """Request both ``PROMPTS``, give the second up at once (an abort, as a decode side of another make may send),
    then read the first."""
    decode = DecodeSide(connection)
    (first, first_counts), (second, second_counts) = decode.open(PROMPTS[0]), decode.open(PROMPTS[1])
    request_id = decode.receiver.request(first, PROMPTS[0], first_counts)
    given_up = decode.receiver.request(second, PROMPTS[1], second_counts)
    send(connection, Abort(given_up, "the user left"))
    decode.receiver.read(first, request_id)
    decode.engine.check(first, PROMPTS[0])
    first.close()
    second.close()
    decode.receiver.close()
    wait_for_the_end(connection)
    decode.close()


def test_an_abort_of_a_request_waited_for_later_releases_it_at_once() -> None:
    """The abort of request 1 reaches the sender while it waits for request 0's READ. Before: it was queued as if
    a request and dropped, and ``wait_released`` of request 1 held its pages for its whole timeout (10 s)."""
    require_nixl()
    with child_side(decode_aborting_the_second) as side:
        prefill_side = PrefillSide(side.connection)
        sender = prefill_side.sender
        served = [prefill_side.serve(send=True) for _ in PROMPTS]
        assert sender.wait_released(served[0][0])
        start = time.monotonic()
        assert not sender.wait_released(served[1][0])
        assert time.monotonic() - start < 2
        for _, cache in served:
            cache.close()
        assert sender.next_request() is None  # bye
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0


def late_first_answer_side(connection: Connection, delay_s: float) -> None:
    """``fake_prefill_side``'s service, its first answer ``delay_s`` late (a long prefill)."""
    prefill_side = PrefillSide(connection)
    sender = prefill_side.sender
    released: list[bool] = []
    while (request := sender.next_request()) is not None:
        cache = prefill(prefill_side.manager, prefill_side.engine, request)
        cache.commit(request.tokens)
        time.sleep(delay_s if not released else 0)
        sender.send_sources(request, cache)
        released.append(sender.wait_released(request))
        cache.close()
    assert released == [False, True], released  # the first was given up (an abort), the second read
    prefill_side.close()


def test_an_answer_after_its_read_gave_up_is_dropped_not_taken_for_the_next() -> None:
    """The decode side's read of request 0 times out; the prefill side's late answer then reaches the read of
    request 1. Before: that read failed too ('expected the sources of request 1, got Sources(request_id=0...')."""
    require_nixl()
    with child_side(late_first_answer_side, 1.5) as side:
        decode = DecodeSide(side.connection)  # 30 s: the child may take seconds to start
        receiver = decode.receiver
        receiver.timeout_s = 1.0
        for seed, late in ((91, True), (92, False)):
            prompt = tokens_of(seed, 300)
            cache, counts = decode.open(prompt)
            if late:
                with pytest.raises(TransferError, match="no the sources of request 0 from the peer in time"):
                    receiver.receive(cache, prompt, counts)
                assert cache.status.name == "CLOSED"
                receiver.timeout_s = 30.0  # the next request waits for the late answer, then its own
                continue
            receiver.receive(cache, prompt, counts)
            decode.engine.check(cache, prompt)
            cache.close()
        decode.close()
        assert side.wait_exit() == 0


def impatient_prefill_side(connection: Connection, wait_s: float, read: bool = False) -> None:
    """Answers the first request without publishing it, waits for its READ at most ``wait_s`` (when that is
    shorter than the decode side's read timeout: as long as that instead), closes the cache and fills every free
    GPU slot with other prompts' KV, as a busy prefill side does with the slots it got back. ``read``: whether
    the decode side's READ came first."""
    prefill_side = PrefillSide(connection, gpu_mib=2)
    manager, engine, sender = prefill_side.manager, prefill_side.engine, prefill_side.sender
    request, cache = prefill_side.serve(commit=False, send=True)
    try:
        released = sender.wait_released(request, timeout_s=wait_s)
    except ValueError as error:  # shorter than the request's read_timeout_s: nothing changed, the cache held
        assert "shorter than request 0's read_timeout_s" in str(error), error
        released = sender.wait_released(request)
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
    prefill_side.close()
    assert released == read, released


def test_a_read_later_than_its_timeout_after_the_request_never_starts() -> None:
    """The engine reads a request long after sending it, past the time the prefill side (with the same timeout)
    waits for its READ: the read fails before any READ. Before: the deadline started at ``read``, the READ ran
    on the slots the prefill side had since given to other prompts, and ``receive`` returned them as this one's
    (ContentError at every position)."""
    require_nixl()
    with child_side(impatient_prefill_side, 1.0) as side:
        decode = DecodeSide(side.connection)  # 30 s: the child may take seconds to start
        receiver = decode.receiver
        receiver.timeout_s = 1.0
        prompt = tokens_of(95, 300)
        cache, counts = decode.open(prompt)
        request_id = receiver.request(cache, prompt, counts)
        time.sleep(2.0)  # the engine is busy elsewhere
        with pytest.raises(TransferError, match="in time"):
            receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"
        decode.close()
        assert side.wait_exit() == 0


def test_a_prefill_side_waiting_less_than_the_decode_side_reads_never_hands_out_the_pages_early() -> None:
    """The prefill side waits 0.5 s for the READ, the decode side reads 1.5 s after the answer, within its 30 s.
    Before: the prefill side gave the pages up at 0.5 s and wrote other prompts' KV there; the late READ brought
    that KV and ``read`` returned it as this prompt's (ContentError at the first position, the child's assert
    failed). Now the request carries the decode side's deadline and ``wait_released`` refuses a shorter wait."""
    require_nixl()
    with child_side(impatient_prefill_side, 0.5, True) as side:
        decode = DecodeSide(side.connection)  # 30 s
        prompt = tokens_of(96, 300)
        cache, counts = decode.open(prompt)
        request_id = decode.receiver.request(cache, prompt, counts)
        assert side.connection.poll(30)  # the answer came: the prefill side waits from now on
        time.sleep(1.5)  # the engine is busy elsewhere, well within its timeout
        decode.receiver.read(cache, request_id)
        decode.engine.check(cache, prompt)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


class LatePostingAgent(StuckReadAgent):
    """A real agent whose READ starts 2 s after ``transfer`` is called (a thread descheduled right after its
    deadline check) and which reports DONE once it ended, at the first look."""

    def transfer(self, handle: object) -> str:
        time.sleep(2.0)
        state = self.real.transfer(handle)
        while state == "PROC":
            state = self.real.check_xfer_state(handle)
        return state


def test_a_read_seen_done_only_after_its_deadline_is_not_used() -> None:
    """The decode side's READ runs past its 1 s deadline, after the prefill side (waiting as long) gave the pages
    to other prompts; NIXL reports it DONE at the first look. Before: the read took it ('ContentError: cache 0
    layer 1 role 'key': wrong content at positions [0, 1, ...]'); now a READ seen done after the deadline fails
    the read and its cache is closed."""
    require_nixl()
    with child_side(impatient_prefill_side, 1.0) as side:
        decode = DecodeSide(side.connection, agent_type=LatePostingAgent)  # 30 s: the child may take seconds to start
        receiver = decode.receiver
        receiver.timeout_s = 1.0
        prompt = tokens_of(97, 300)
        cache, counts = decode.open(prompt)
        with pytest.raises(TransferError, match="seen done only after its deadline"):
            receiver.receive(cache, prompt, counts)
            decode.engine.check(cache, prompt)  # reached before: the prefill side's other KV
        assert cache.status.name == "CLOSED"
        decode.close()
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


def abandoning_decode_side(connection: Connection, pipelined: bool) -> None:
    """Request both ``PROMPTS`` (``pipelined``: both before any read; else the second after giving up the first),
    give one up by closing its cache, and read the other; a slow READ lets the prefill side hear the abort first."""
    decode = DecodeSide(connection, agent_type=SlowReadAgent)
    receiver = decode.receiver
    (first, first_counts), (second, second_counts) = decode.open(PROMPTS[0]), decode.open(PROMPTS[1])
    if pipelined:  # the second is given up; the abort goes out with the first's read
        first_id = receiver.request(first, PROMPTS[0], first_counts)
        receiver.request(second, PROMPTS[1], second_counts)
        second.close()
        receiver.read(first, first_id)
        decode.engine.check(first, PROMPTS[0])
    else:  # the first is given up; the abort goes out with the second's request
        receiver.request(first, PROMPTS[0], first_counts)
        first.close()
        receiver.receive(second, PROMPTS[1], second_counts)
        decode.engine.check(second, PROMPTS[1])
    first.close()
    second.close()
    wait_for_the_end(connection)  # quiet until the prefill side is done: its wait must not end by our exit
    decode.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["one_at_a_time", "answered_ahead"])
def test_a_request_whose_cache_was_closed_is_given_up_at_once(pipelined: bool) -> None:
    """The decode engine closes a receiving cache between ``request`` and ``read`` (its client left). Before: nothing
    told the prefill side, whose ``wait_released`` held the request's pages for its whole timeout (10 s here),
    and the receiver kept the request (and any answer) for its life. Now the receiver's next call sends an abort,
    which the sender keeps even when it comes before that request's sources went out."""
    require_nixl()
    with child_side(abandoning_decode_side, pipelined) as side:
        prefill_side = PrefillSide(side.connection)
        sender = prefill_side.sender
        served = [prefill_side.serve(commit=False) for _ in range(2 if pipelined else 1)]
        if pipelined:
            sender.send_sources(*served[0])
            assert sender.wait_released(served[0][0])  # the abort of the second comes meanwhile
            given_up = served[1]
        else:
            given_up = served[0]
        sender.send_sources(*given_up)
        start = time.monotonic()
        assert not sender.wait_released(given_up[0])
        assert time.monotonic() - start < 2
        if not pipelined:
            request, cache = prefill_side.serve(commit=False, send=True)
            assert sender.wait_released(request)
            served.append((request, cache))
        for _, cache in served:
            cache.close()
        prefill_side.close()
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
    decode = DecodeSide(connection, agent_type=LateLookingAgent)
    cache, counts = decode.open(PROMPTS[0])
    decode.receiver.receive(cache, PROMPTS[0], counts)
    decode.engine.check(cache, PROMPTS[0])
    cache.close()
    decode.close()


def test_a_read_done_before_the_prefill_side_left_is_whole() -> None:
    """The prefill side, notified that the READ ended, closes its connection at once (its last request) while the
    decode side has yet to see the READ's state. Before: the decode side took the closed connection for a gone peer
    and failed a READ that had ended ('the prefill side closed the control connection (it died or gave up)',
    the child exited 1); now it asks NIXL first."""
    require_nixl()
    with child_side(late_looking_decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        request, cache = prefill_side.serve(commit=False, send=True)
        assert prefill_side.sender.wait_released(request)
        cache.close()
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0
