"""A READ that NIXL cannot stop must keep its landing pages out of every free list until NIXL lets it go.

The decode side wraps its real NIXL agent (``KVReceiver``'s ``agent_factory``) so that one chosen READ reports
PROC forever and refuses to be released, as a stuck transfer does; the READ itself really runs over loopback.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import receiver_endpoint
from kv_cache_manager_v2 import KVCache
from kv_cache_manager_v2._handoff.nixl_agent import UNFINISHED_READ, NixlAgent, new_agent
from kv_cache_manager_v2.disagg import TransferError
from tests.nixl_helpers import DecodeSide, child_side, fake_prefill_side, require_nixl, tokens_of


STUCK_WAIT_S = 1.0
"""How long a test lets a READ it stalled on purpose wait (``receive`` waits it out in full; it also bounds the
prefill child's answer, so it cannot be much shorter under load)."""
CLOSE_WAIT_S = 0.1
"""How long ``close`` waits for a READ stalled until the test lets it go: only that READ, never the child."""


class StuckReadAgent:
    """A real agent whose READs, while ``stall_next`` marks them, look in progress and refuse release until
    ``unstick``; records the local (landing) addresses of every READ."""

    def __init__(self, name: str) -> None:
        self.real: NixlAgent = new_agent(name)
        self.stall_next = False
        self.stuck: list[object] = []
        self.hide_state = True  # False: stuck READs report their real state, yet still refuse release
        self.landing: list[set[int]] = []
        self._last_local: set[int] = set()

    def unstick(self) -> None:
        self.stuck.clear()

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object:
        return self.real.register_memory(reg_list, mem_type)

    def deregister_memory(self, dereg_list: object) -> None:
        self.real.deregister_memory(dereg_list)

    def get_agent_metadata(self) -> bytes:
        return self.real.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str | bytes:
        return self.real.add_remote_agent(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.real.remove_remote_agent(agent)

    def get_xfer_descs(self, descs: object, mem_type: str) -> object:
        if not self._last_local and isinstance(descs, np.ndarray):
            self._last_local = {int(row[0]) for row in descs}  # the first list of a READ is the local one
        return self.real.get_xfer_descs(descs, mem_type)

    def initialize_xfer(self, operation: str, local_descs: object, remote_descs: object, remote_agent: str, notif_msg: bytes) -> object:
        handle = self.real.initialize_xfer(operation, local_descs, remote_descs, remote_agent, notif_msg)
        self.landing.append(self._last_local)
        self._last_local = set()
        if self.stall_next:
            self.stuck.append(handle)
            self.stall_next = False
        return handle

    def transfer(self, handle: object) -> str:
        state = self.real.transfer(handle)
        return "PROC" if any(handle is stuck for stuck in self.stuck) else state

    def check_xfer_state(self, handle: object) -> str:
        state = self.real.check_xfer_state(handle)
        return "PROC" if self.hide_state and any(handle is stuck for stuck in self.stuck) else state

    def release_xfer_handle(self, handle: object) -> None:
        if any(handle is stuck for stuck in self.stuck):
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT: cannot cancel the transfer")  # as NIXL's binding does
        self.real.release_xfer_handle(handle)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.real.get_new_notifs()

    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None:
        self.real.send_notif(remote_agent_name, notif_msg)


@pytest.mark.parametrize("ending", ["released", "reported_done"])
def test_pages_of_a_read_nixl_cannot_stop_stay_held_until_it_is_released(ending: str) -> None:
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection, agent_type=StuckReadAgent)  # 30 s for the child to start
        manager, engine, receiver = decode.manager, decode.engine, decode.receiver
        agent = decode.agent(StuckReadAgent)
        prompt = tokens_of(41, 300)
        stuck_cache, counts = decode.open(prompt)
        agent.stall_next = True
        receiver.timeout_s = STUCK_WAIT_S  # after the handshake; only the stuck READ waits it out
        with pytest.raises(TransferError, match="did not complete in time"):
            receiver.receive(stuck_cache, prompt, counts)
        receiver.timeout_s = 5.0  # the real READs that follow get room under load
        assert receiver_endpoint(receiver).unfinished.count == 1
        assert stuck_cache.status.name == "ACTIVE"  # its pages are still held: the READ may write there
        assert list(stuck_cache.held_for) == [UNFINISHED_READ]
        indices = list(stuck_cache.get_base_page_indices(0))
        # The engine's own calls cannot free, move or share the landing pages behind NIXL's back.
        for call in (stuck_cache.close, stuck_cache.suspend, lambda: stuck_cache.resize(16, 16),
                     lambda: stuck_cache.commit(prompt), stuck_cache.stop_committing):
            with pytest.raises(RuntimeError, match="held .*unfinished NIXL READ"):
                call()
        assert stuck_cache.status.name == "ACTIVE" and list(stuck_cache.get_base_page_indices(0)) == indices
        with pytest.raises(RuntimeError, match="still open"):
            manager.shutdown()
        manager.check_invariants()

        for seed in (42, 43):  # later requests never land in the stuck READ's pages
            other = tokens_of(seed, 300)
            cache, counts = decode.open(other)
            receiver.receive(cache, other, counts)
            assert not agent.landing[-1] & agent.landing[0]
            engine.check(cache, other)
            cache.close()
        assert receiver_endpoint(receiver).unfinished.count == 1
        assert any(stats.free < stats.total for stats in manager.get_storage_statistics(0))  # held, not free

        if ending == "released":  # NIXL now releases it: the next call closes the cache and its pages come back
            agent.unstick()
        else:  # NIXL still refuses the release but reports the READ DONE: it cannot write any more
            agent.hide_state = False
        again = tokens_of(44, 300)
        cache, counts = decode.open(again)
        receiver.receive(cache, again, counts)
        assert receiver_endpoint(receiver).unfinished.count == 0 and stuck_cache.status.name == "CLOSED"
        assert not stuck_cache.held_for
        cache.close()
        assert all(stats.free == stats.total for stats in manager.get_storage_statistics(0))  # all back
        decode.close()


def test_a_read_still_in_progress_after_close_keeps_its_pages_until_a_later_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close`` waits ``timeout_s`` for a stuck READ; past it the READ could still land, so its cache stays held
    (its pages free for no one), the agent and registration stay, and the manager's shutdown refuses. Before:
    close closed the cache and deregistered, its pages went back to the free lists under the READ. Once NIXL lets
    go, a second close tears down."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection, agent_type=StuckReadAgent)  # 30 s for the child to start
        receiver = decode.receiver
        prompt = tokens_of(45, 300)
        cache, counts = decode.open(prompt)
        agent = decode.agent(StuckReadAgent)
        agent.stall_next = True
        receiver.timeout_s = STUCK_WAIT_S  # after the handshake: the answer must come within it, under load too
        with pytest.raises(TransferError, match="did not complete in time"):
            receiver.receive(cache, prompt, counts)
        assert cache.status.name == "ACTIVE"
        free_before = [stats.free for stats in decode.manager.get_storage_statistics(0)]
        receiver.timeout_s = CLOSE_WAIT_S  # the READ is stuck until unstick: close waits out any timeout in full
        with caplog.at_level("WARNING", logger="kv_cache_manager_v2"):
            receiver.close()  # waits timeout_s for the stuck READ, which NIXL still reports in progress
        assert (
            f"1 NIXL READ still in progress after {CLOSE_WAIT_S:.1f} s keeps its cache held and the NIXL agent alive "
            f"(it could still land); call close() again once it ended" in caplog.text
        )
        assert receiver.unfinished_reads == 1 and cache.status.name == "ACTIVE" and cache.held_for
        assert [stats.free for stats in decode.manager.get_storage_statistics(0)] == free_before
        with pytest.raises(ValueError, match="closed"):
            receiver.request(cache, prompt, counts)
        with pytest.raises(RuntimeError, match="still open"):
            decode.manager.shutdown()
        agent.unstick()
        receiver.close()  # NIXL let go: the cache closes, the endpoint is torn down
        assert receiver.unfinished_reads == 0 and cache.status.name == "CLOSED"
        decode.close()


class Interrupt(BaseException):
    """What the agent raises here, as a Ctrl-C would: not an ``Exception``."""


class InterruptingAgent(StuckReadAgent):
    """Stuck READs report their real state (they may end) but refuse release; while ``interrupt_on`` names a
    handle, asking its state raises ``Interrupt``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.hide_state = False
        self.interrupt_on: object = None

    def check_xfer_state(self, handle: object) -> str:
        if handle is self.interrupt_on:
            self.interrupt_on = None
            raise Interrupt("check_xfer_state")
        return super().check_xfer_state(handle)


def test_an_interrupt_part_way_through_the_retry_keeps_the_list_of_unfinished_reads_true() -> None:
    """Two stuck READs; NIXL says the first is done, asking about the second is interrupted: the first has left
    the list with its cache closed (before: still listed, its handle to be released again), the second is still
    held, and a later retry ends it."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection, agent_type=InterruptingAgent)
        receiver = decode.receiver
        receiver.timeout_s = 2.0  # after the handshake: under load the child took over 2 s to answer the hello
        agent = decode.agent(InterruptingAgent)
        stuck: list[KVCache] = []
        for seed in (51, 52):
            prompt = tokens_of(seed, 300)
            cache, counts = decode.open(prompt)
            agent.hide_state, agent.stall_next = True, True
            with pytest.raises(TransferError, match="did not complete in time"):
                receiver.receive(cache, prompt, counts)
            stuck.append(cache)
        unfinished = receiver_endpoint(receiver).unfinished
        assert unfinished.count == 2
        agent.hide_state = False
        agent.interrupt_on = agent.stuck[1]
        again = tokens_of(53, 300)
        cache, counts = decode.open(again)
        with pytest.raises(Interrupt):
            receiver.request(cache, again, counts)  # retries the unfinished READs first
        assert stuck[0].status.name == "CLOSED" and unfinished.count == 1 and stuck[1].held_for
        agent.unstick()
        unfinished.retry()
        assert unfinished.count == 0 and stuck[1].status.name == "CLOSED"
        cache.close()
        decode.close()


def test_an_interrupt_in_a_read_s_retry_ends_that_read_and_the_next_one_works() -> None:
    """The retry of an unfinished READ that ``read`` runs first is interrupted. Before: the request had already
    been taken off the receiver's list, yet its cache stayed open and nothing told the prefill side, which held
    its pages until its own timeout while its answer sat unread, so the next request's read failed too. Now the
    interrupted read ends like any failed one: its cache closed, the sender told, its answer dropped."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "none") as side:
        decode = DecodeSide(side.connection, agent_type=InterruptingAgent)
        receiver = decode.receiver
        receiver.timeout_s = 2.0  # after the handshake: the child may take seconds to start
        agent = decode.agent(InterruptingAgent)
        prompt = tokens_of(54, 300)
        cache, counts = decode.open(prompt)
        agent.hide_state, agent.stall_next = True, True
        with pytest.raises(TransferError, match="did not complete in time"):
            receiver.receive(cache, prompt, counts)
        interrupted = tokens_of(55, 300)
        cache, counts = decode.open(interrupted)
        request_id = receiver.request(cache, interrupted, counts)
        agent.hide_state = False
        agent.interrupt_on = agent.stuck[0]
        with pytest.raises(Interrupt):
            receiver.read(cache, request_id)
        assert cache.status.name == "CLOSED"
        agent.unstick()
        receiver.timeout_s = 30.0
        for seed in (56, 57):
            again = tokens_of(seed, 300)
            cache, counts = decode.open(again)
            receiver.receive(cache, again, counts)
            decode.engine.check(cache, again)
            cache.close()
        assert receiver_endpoint(receiver).unfinished.count == 0
        decode.close()
        assert side.wait_exit() == 0
