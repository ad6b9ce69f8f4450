"""Publishing a manager's KV events to routers in vLLM's format: drain, translate, send.

Threading contract: the engine calls ``publish_pending()`` from its loop (after each step is simplest), on the
thread that may drain the manager's events (the scheduler thread, or the one reader thread the manager allows);
every method of this class runs on that one thread. ``clear_reusable_blocks`` changes the manager's state, which
only the scheduler thread may do: a publisher that uses it runs on the scheduler thread. Draining, translating
and encoding happen there; sending and answering replay requests happen on the publisher's own background thread
(``ZmqEventPublisher``), which touches neither the manager nor this object.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence, SupportsFloat, SupportsIndex, final

from .._observe.events import KVEvent
from .._manager.manager import KVCacheManager
from .adapter import EventTranslator
from .publisher import CLOSE_TIMEOUT_S, DEFAULT_BUFFER_STEPS, DEFAULT_HWM, ZmqEventPublisher
from .wire import AllBlocksCleared, WireEvent
from .._base.types import Handle


@final
class KVEventsPublisher(Handle):
    """Sends what ``manager`` records (``enable_kv_events`` must be on) to ``endpoint``, one batch per call.

    ``replay_endpoint``: a ROUTER socket answering replay requests from the last ``buffer_steps`` batches.
    ``full_attention_only``: leave sliding-window and Mamba groups out, for routers that do not read
    ``group_idx``. ``lora_names``: the ``lora_name`` to send for a reuse scope's ``lora_id``. ``clock`` stamps
    batches (wall-clock seconds by default): subscribers tell a restarted engine's replay by these stamps, so a
    clock of your own must keep increasing across restarts (a constant or one restarting at 0 makes the new
    engine's replayed batches read as the old one's, recovered).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: SupportsIndex = DEFAULT_BUFFER_STEPS,
        data_parallel_rank: SupportsIndex = 0,
        full_attention_only: bool = False,
        lora_names: Mapping[int, str] | None = None,
        hwm: SupportsIndex = DEFAULT_HWM,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not manager.config.enable_kv_events:
            raise ValueError("publishing KV events needs KVCacheManagerConfig.enable_kv_events=True")
        self._manager = manager
        self._translator: EventTranslator = EventTranslator.for_manager(manager, full_attention_only, lora_names)
        self._clock = clock
        self._sockets: ZmqEventPublisher = ZmqEventPublisher(endpoint, replay_endpoint, topic, buffer_steps, data_parallel_rank, hwm)

    @property
    def endpoint(self) -> str:
        """Where subscribers connect (a bound ``*`` port resolved)."""
        return self._sockets.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """Where subscribers ask for missed batches (a bound ``*`` port resolved); None without a replay socket."""
        return self._sockets.replay_endpoint

    def wait_sent(self, timeout_s: SupportsFloat = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every batch published so far has been handed to the socket (e.g. before reading what a
        subscriber got); False on timeout. ``ValueError`` for a ``timeout_s`` below 0, NaN or infinite."""
        return self._sockets.wait_sent(timeout_s)

    def publish_pending(self, events: Sequence[KVEvent] | None = None) -> int | None:
        """Send the manager's new events as one batch (or ``events``, when the caller drained them itself for
        another use too); the batch's sequence number, None when there was nothing to send.

        Once the manager is shut down there is nothing more to send (None): what it still held is superseded by
        the ``AllBlocksCleared`` that ``shutdown`` sends. A reader thread cannot test for that beforehand (the
        scheduler thread may shut the manager down between the test and the drain), so the drain's refusal is
        what tells it."""
        if events is None:
            try:
                drained: Sequence[KVEvent] = self._manager.get_latest_events()
            except ValueError:
                if self._manager.is_shut_down:
                    return None
                raise
        else:
            drained = events
        return self._send(self._translator.translate(drained))

    def clear_reusable_blocks(self) -> int | None:
        """``manager.clear_reusable_blocks()``, published: ``AllBlocksCleared`` when nothing published is left
        (no live cache kept a page), else the exact ``BlockRemoved`` events (an ``AllBlocksCleared`` would make
        routers forget blocks still cached). A refusal (a cache still open) still publishes the events that were
        pending, then propagates: they must be drained before the clear to be told apart from its removals."""
        before = self._translator.translate(self._manager.get_latest_events())
        try:
            self._manager.clear_reusable_blocks()
        except BaseException:
            self._send(before)
            raise
        removals = self._translator.translate(self._manager.get_latest_events())
        if self._translator.num_published_pages == 0:
            return self._send([*before, AllBlocksCleared()])
        return self._send([*before, *removals])

    def shutdown(self) -> None:
        """The engine stops: send ``AllBlocksCleared`` and close the sockets (before or after
        ``manager.shutdown()``; events not yet published are superseded by it). Calling it again does nothing."""
        if self._sockets.closed:
            return
        self._translator.forget_all()
        self._send([AllBlocksCleared()])
        self._sockets.close()

    def _send(self, events: list[WireEvent]) -> int | None:
        if not events:
            return None
        return self._sockets.publish(events, self._clock())
