"""``KVReceiver.abandon``: the decode engine gives up one request (its client disconnected) without closing the
receiver: its receiving cache is closed, the prefill side hears it at once and releases the pages it offered, and
whatever of that request comes late (its answer, a READ completing) changes nothing.

Abandoned before its answer came, while its read waits for the answer on another thread, or while its READ runs;
after its read returned it is a no-op (False: the cache is the engine's). The prefill child reports how each wait of
its ``wait_released`` ended in the next answer's ``extra``; every received prompt is checked token by token. Every
process and agent is started and stopped here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable, Sized

import pytest

from kv_cache_manager_v2 import KVCache, KVCacheManager
from kv_cache_manager_v2._handoff.nixl_agent import UNFINISHED_READ
from kv_cache_manager_v2.disagg import KVReceiver, TransferError
from tests.helpers import compute_prompt
from tests.nixl_helpers import (
    DecodeSide, PrefillSide, child_side, prefill, require_nixl, settle_unfinished_reads, tokens_of,
)
from tests.remote_scenarios import wait_stopped
from tests.test_nixl_unfinished_read import StuckReadAgent

PROMPTS = [tokens_of(801, 300), tokens_of(802, 200), tokens_of(803, 250)]


def reporting_prefill_side(
    connection: Connection, first_answer_delay_s: float, first_wait_delay_s: float = 0.0
) -> None:
    """Serves each request (the first one's answer ``first_answer_delay_s`` late, as a long prefill, and its wait
    ``first_wait_delay_s`` after the answer, as a process busy elsewhere); each answer's ``extra`` lists how the
    earlier waits ended: [read (True) or given up (False), within 2 s]. Closing each cache after its wait proves
    the hold was released."""
    prefill_side = PrefillSide(connection)
    sender = prefill_side.sender
    waits: list[list[bool]] = []
    while (request := sender.next_request()) is not None:
        cache = prefill(prefill_side.manager, prefill_side.engine, request)
        cache.commit(request.tokens)
        time.sleep(first_answer_delay_s if not waits else 0.0)
        sender.send_sources(request, cache, extra=waits)
        time.sleep(first_wait_delay_s if not waits else 0.0)
        start = time.monotonic()
        released = sender.wait_released(request)
        waits.append([released, time.monotonic() - start < 2])
        cache.close()
    prefill_side.close()


def free_gpu_pages(manager: KVCacheManager) -> list[tuple[int, int]]:
    """Per GPU pool group: pages locked by active caches, pages free."""
    return [(usage.used, usage.free) for usage in manager.get_usage() if usage.level == 0]


def test_a_request_abandoned_before_its_answer_is_released_on_both_sides() -> None:
    """Abandoned right after the request: the cache closes, its pages are free again, the prefill side's wait
    ends at once (False) and the late answer is dropped; abandoning a request already read is a no-op. Before:
    no such call (AttributeError); closing the cache instead told the prefill side only at the receiver's next
    request or read, and the pages it offered stayed held until then."""
    require_nixl()
    with child_side(reporting_prefill_side, 1.0) as side:
        decode = DecodeSide(side.connection)
        manager, engine, receiver = decode.manager, decode.engine, decode.receiver
        idle = free_gpu_pages(manager)
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        other, other_counts = decode.open(PROMPTS[1])
        with pytest.raises(ValueError, match=f"cache {other.id} is not the cache request {request_id} was made for"):
            receiver.abandon(other, request_id)
        with pytest.raises(ValueError, match="request_id 7 names no request this receiver sent"):
            receiver.abandon(cache, 7)
        assert cache.is_active  # refused, nothing changed
        other.close()
        assert receiver.abandon(cache, request_id)
        assert cache.status.name == "CLOSED" and free_gpu_pages(manager) == idle
        assert not receiver.abandon(cache, request_id)  # once
        with pytest.raises(ValueError, match="names no request of this receiver still to read"):
            receiver.read(cache, request_id)

        cache, counts = decode.open(PROMPTS[1])
        received = receiver.receive(cache, PROMPTS[1], counts)  # request 0's late answer comes first: dropped
        engine.check(cache, PROMPTS[1])
        assert received.extra == [[False, True]]  # request 0's wait ended by the abort, at once
        assert not receiver.abandon(cache, request_id + 1)  # read already: the cache is the engine's
        assert cache.is_active
        engine.check(cache, PROMPTS[1])
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def abandon_once_posted(receiver: KVReceiver, cache: KVCache, request_id: int, posted: Sized) -> None:
    """Read ``request_id`` while another thread (a client leaving) abandons it as soon as its READ is posted
    (``posted`` not empty): the read raises, the abandon returns True."""
    outcome: list[bool] = []

    def disconnect() -> None:
        while not posted:
            time.sleep(0.01)
        outcome.append(receiver.abandon(cache, request_id))

    client = threading.Thread(target=disconnect)
    client.start()
    with pytest.raises(TransferError, match=f"request {request_id} was abandoned"):
        receiver.read(cache, request_id)
    client.join(10)
    assert outcome == [True]


class DeferredReadAgent(StuckReadAgent):
    """A real agent whose READs start only ``delay_s`` after ``transfer`` (PROC until then): a long transfer that
    ``abandon`` can overtake. The receiver never releases it while it is PROC (NIXL would not stop it)."""

    delay_s = 2.0

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.posted: dict[int, float] = {}
        self.started: list[object] = []

    def transfer(self, handle: object) -> str:
        self.posted[id(handle)] = time.monotonic()
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        if any(handle is started for started in self.started):
            return self.real.check_xfer_state(handle)
        if time.monotonic() - self.posted[id(handle)] < self.delay_s:
            return "PROC"
        self.started.append(handle)
        return self.real.transfer(handle)


@pytest.mark.parametrize("when", ["waiting_for_the_answer", "mid_read", "mid_read_while_the_prefill_side_is_busy"])
def test_a_read_abandoned_from_another_thread_stops_and_releases_both_sides(when: str) -> None:
    """The engine's thread is in ``receive`` when a client's disconnect, on another thread, abandons the request:
    that read raises TransferError, ``abandon`` returns once it has, the cache is closed (or, its READ posted, held
    until that READ ends: NIXL cannot stop it), the prefill side released
    its pages at once (False), and the next request (into the same slots) arrives intact. Before: no such call;
    the read ran on until its answer and READ came (the whole 2 s READ here). A prefill side that starts waiting
    only after the abort and the posted READ's notification both came takes the abort (sent first): before, it
    took the notification first (``[[True, True]]``; seen once in a loaded CI run)."""
    require_nixl()
    busy = 1.5 if when == "mid_read_while_the_prefill_side_is_busy" else 0.0
    with child_side(reporting_prefill_side, 2.0 if when == "waiting_for_the_answer" else 0.0, busy) as side:
        decode = DecodeSide(side.connection, agent_type=DeferredReadAgent)
        manager, receiver, agent = decode.manager, decode.receiver, decode.agent(DeferredReadAgent)
        idle = free_gpu_pages(manager)
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        outcome: list[tuple[bool, float]] = []

        def disconnect() -> None:
            if when != "waiting_for_the_answer":
                while not agent.posted:  # the READ is posted: the answer came and the read began
                    time.sleep(0.01)
            time.sleep(0.3)
            start = time.monotonic()
            outcome.append((receiver.abandon(cache, request_id), time.monotonic() - start))

        client = threading.Thread(target=disconnect)
        client.start()
        start = time.monotonic()
        with pytest.raises(TransferError, match=f"request {request_id} was abandoned"):
            receiver.read(cache, request_id)
        assert time.monotonic() - start < 1.5  # before the answer (2 s late) or the READ (2 s long)
        client.join(10)
        assert outcome and outcome[0][0] and outcome[0][1] < 1.0
        if when != "waiting_for_the_answer":  # the READ is posted: NIXL cannot stop it, so its pages stay held
            assert cache.status.name == "ACTIVE" and list(cache.held_for) == [UNFINISHED_READ]
            assert free_gpu_pages(manager) != idle
        else:
            assert cache.status.name == "CLOSED" and free_gpu_pages(manager) == idle
        assert not agent.started
        assert not receiver.abandon(cache, request_id)
        agent.delay_s = 0.0

        settle_unfinished_reads(receiver)  # the posted READ ends: its cache is closed
        assert cache.status.name == "CLOSED" and free_gpu_pages(manager) == idle
        cache, counts = decode.open(PROMPTS[2])
        received = receiver.receive(cache, PROMPTS[2], counts)
        decode.engine.check(cache, PROMPTS[2])
        assert received.extra == [[False, True]]  # the prefill side's wait ended by the abort, at once
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_an_abandoned_read_nixl_will_not_release_keeps_its_pages_held_until_it_does() -> None:
    """Abandoned mid-READ, the READ refuses release (NIXL could not stop it): ``abandon`` still returns and the
    prefill side is told, but the cache stays open under the unfinished READ's hold (late bytes may land there),
    until the receiver's next call finds NIXL let go; then it is closed and its pages come back."""
    require_nixl()
    with child_side(reporting_prefill_side, 0.0) as side:
        decode = DecodeSide(side.connection, agent_type=DeferredReadAgent)
        manager, receiver, agent = decode.manager, decode.receiver, decode.agent(DeferredReadAgent)
        idle = free_gpu_pages(manager)
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        agent.stall_next = True  # its release is refused while stuck
        abandon_once_posted(receiver, cache, request_id, agent.posted)
        assert cache.status.name == "ACTIVE" and list(cache.held_for) == [UNFINISHED_READ]
        assert free_gpu_pages(manager) != idle
        agent.unstick()
        agent.delay_s = 0.0
        settle_unfinished_reads(receiver)  # NIXL lets go: the cache is closed
        assert cache.status.name == "CLOSED"
        other, other_counts = decode.open(PROMPTS[2])
        received = receiver.receive(other, PROMPTS[2], other_counts)
        decode.engine.check(other, PROMPTS[2])
        assert received.extra == [[False, True]]
        other.close()
        assert free_gpu_pages(manager) == idle
        decode.close()
        assert side.wait_exit() == 0


class SelfAbandoningAgent(DeferredReadAgent):
    """Calls ``on_check`` (once) from the READ's own state check: an abandon from inside the read's thread."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.on_check: Callable[[], None] | None = None

    def check_xfer_state(self, handle: object) -> str:
        hook, self.on_check = self.on_check, None
        if hook is not None:
            hook()
        return super().check_xfer_state(handle)


def test_an_abandon_from_inside_the_read_s_own_thread_does_not_wait_for_itself() -> None:
    """Abandoning the request whose read runs on this very thread (from a callback inside it) must not wait for
    that read to end, which it never would: it returns True and the read stops at its next look."""
    require_nixl()
    with child_side(reporting_prefill_side, 0.0) as side:
        decode = DecodeSide(side.connection, agent_type=SelfAbandoningAgent)
        receiver, agent = decode.receiver, decode.agent(SelfAbandoningAgent)
        cache, counts = decode.open(PROMPTS[0])
        other, _ = decode.open(PROMPTS[1])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        outcome: list[bool | str] = []

        def abandon_twice() -> None:
            try:
                receiver.abandon(other, request_id)  # not the read's cache: refused, the read goes on
            except ValueError as error:
                outcome.append(str(error))
            outcome.append(receiver.abandon(cache, request_id))

        agent.on_check = abandon_twice
        with pytest.raises(TransferError, match=f"request {request_id} was abandoned"):
            receiver.read(cache, request_id)
        assert outcome == [f"cache {other.id} is not the cache request {request_id} was made for", True]
        assert list(cache.held_for) == [UNFINISHED_READ] and other.is_active  # held until the posted READ ends
        other.close()
        decode.close()
        assert side.wait_exit() == 0


class PausingAgent(StuckReadAgent):
    """A real agent that stops the prefill child (SIGSTOP) just before its first READ is posted: over UCX's TCP
    transport the READ then really stays in flight (PROC) until the child runs again; NIXL still releases its
    handle on request, and the READ lands anyway (measured with nixl-cu12 1.5.1: 268 MB read after release)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.pause_pid = 0
        self.posted: list[object] = []

    def transfer(self, handle: object) -> str:
        if not self.posted:
            os.kill(self.pause_pid, signal.SIGSTOP)
            wait_stopped(self.pause_pid)  # kill only queues it: under load the child once served the whole READ first
        self.posted.append(handle)
        return super().transfer(handle)


def test_a_read_that_finishes_after_abandon_never_writes_into_pages_given_to_another_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real READ in flight when ``abandon`` returns (the prefill child stopped, UCX over TCP): its pages must
    stay held until NIXL reports it ended, so a request computed meanwhile into free pages keeps its own bytes
    when the late READ lands. Before: the READ's handle was released (NIXL says OK; it does not stop the READ),
    the cache closed, its slots handed to the next request, and the prefill side's bytes overwrote them."""
    require_nixl()
    monkeypatch.setenv("UCX_TLS", "tcp")  # shared memory would read a stopped child's memory at once
    with child_side(reporting_prefill_side, 0.0) as side:
        decode = DecodeSide(side.connection, agent_type=PausingAgent)
        manager, engine, receiver, agent = decode.manager, decode.engine, decode.receiver, decode.agent(PausingAgent)
        assert side.process.pid is not None
        agent.pause_pid = pid = side.process.pid
        idle = free_gpu_pages(manager)
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        try:
            abandon_once_posted(receiver, cache, request_id, agent.posted)
            other = compute_prompt(manager, engine, tokens_of(804, 600))  # takes free pages, its own records
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)  # the late READ lands now, wherever it still may
        engine.check(other, tokens_of(804, 600))
        assert cache.status.name == "ACTIVE" and list(cache.held_for) == [UNFINISHED_READ]
        settle_unfinished_reads(receiver)  # the READ ended: the held cache is closed
        assert cache.status.name == "CLOSED"
        cache2, counts2 = decode.open(PROMPTS[2])
        receiver.receive(cache2, PROMPTS[2], counts2)
        engine.check(cache2, PROMPTS[2])
        cache2.close()
        other.close()
        assert [used for used, _ in free_gpu_pages(manager)] == [used for used, _ in idle]  # other's are reusable
        decode.close()
        assert side.wait_exit() == 0


def test_an_abandon_from_another_thread_while_no_read_runs_is_refused() -> None:
    """Only a running read may be stopped from another thread: with the request still to read, its cache belongs
    to the manager's thread, so ``abandon`` elsewhere is a ``RuntimeError`` naming both threads, nothing changed
    (the read then receives the prompt intact); once read, it is False from any thread. Before: it closed the
    cache on the client's thread (racing the manager's) and returned True."""
    require_nixl()
    with child_side(reporting_prefill_side, 0.0) as side:
        decode = DecodeSide(side.connection)
        receiver = decode.receiver
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)

        def from_another_thread() -> bool | str:
            outcome: list[bool | str] = []

            def client() -> None:
                try:
                    outcome.append(receiver.abandon(cache, request_id))
                except RuntimeError as error:
                    outcome.append(str(error))

            thread = threading.Thread(target=client)
            thread.start()
            thread.join(10)
            (answer,) = outcome
            return answer

        refusal = from_another_thread()
        assert isinstance(refusal, str) and refusal.startswith(f"KVReceiver.abandon of request {request_id} from thread")
        assert f"call it from the thread that sent it ({threading.get_ident()})" in refusal
        assert cache.is_active and not cache.held_for
        receiver.read(cache, request_id)
        decode.engine.check(cache, PROMPTS[0])
        assert from_another_thread() is False and cache.is_active
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


def test_closing_the_receiver_while_a_given_up_read_is_in_flight_frees_no_page_it_still_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver closes while an abandoned READ is still in flight (the prefill child stopped, continued 1 s
    into the close): ``close`` waits for that READ to end (at most ``timeout_s``) before it forgets the peer and
    closes the held cache, so a request computed afterwards into the freed pages keeps its own bytes. Before:
    close forgot the peer, deregistered the pools and closed the cache at once, and the late READ still landed
    ('ContentError: cache 1 layer 1 role 'key': wrong content at positions [0, 1, 2, ...] (448 of 600 checked
    tokens)')."""
    require_nixl()
    monkeypatch.setenv("UCX_TLS", "tcp")
    with child_side(reporting_prefill_side, 0.0) as side:
        decode = DecodeSide(side.connection, agent_type=PausingAgent)
        manager, engine, receiver, agent = decode.manager, decode.engine, decode.receiver, decode.agent(PausingAgent)
        receiver.timeout_s = 5.0  # close waits this long at most (after the handshake: the child may start slowly)
        assert side.process.pid is not None
        agent.pause_pid = pid = side.process.pid
        cache, counts = decode.open(PROMPTS[0])
        request_id = receiver.request(cache, PROMPTS[0], counts)
        wake = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
        try:
            abandon_once_posted(receiver, cache, request_id, agent.posted)
            assert list(cache.held_for) == [UNFINISHED_READ]
            wake.start()
            receiver.close()
            assert cache.status.name == "CLOSED"
            other = compute_prompt(manager, engine, tokens_of(804, 600))
        finally:
            wake.cancel()
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)  # whatever of the READ still lands, lands now
        engine.check(other, tokens_of(804, 600))
        other.close()
        manager.check_invariants()
        manager.shutdown()
        assert side.wait_exit() == 0
