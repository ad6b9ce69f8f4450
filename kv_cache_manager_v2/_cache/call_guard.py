"""``CallGuard``: keeps manager code from running inside another manager call (the manager is not
re-entrant).

Two ways user code could otherwise run the manager in the middle of one of its own calls: a callback (priority
callback, event-manager hook) calling back in, and the cycle collector finalizing a dropped handle (``KVCache``,
``PlannedDropHandle``, ``CacheHold``) at any allocation. The guard names the public call in flight and refuses a
second one with ``RuntimeError`` before it changes anything; a dropped handle's finalizer only queues what it leaves
to do here (a cache to close, a plan to apply, a hold to lift), and the queue is run at the entry of the next
guarded call (or by ``shutdown``), when no other call is half done. It is also where an interrupt that user code
raised mid-call (``DeferredInterrupts``) comes out and where the warnings logged mid-call go to the logging
handlers (user code too): when the call has finished changing state.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from types import TracebackType
from typing import Protocol

from .._base.interrupts import DeferredInterrupts

# What the guard says is in flight while it finishes what dropped handles left.
CLOSING_DROPPED: str = "the close of a dropped handle"


class LeftByDroppedHandle(Protocol):
    """What a dropped handle's finalizer queues (a ``CacheState``, a planned drop, a hold's reason): ``close``
    finishes it between two calls."""

    def close(self) -> None: ...


class CallGuard(DeferredInterrupts):
    """One per manager: the public call in flight (``""`` when none), what dropped handles left to finish, and the
    interrupt user code raised during the call (raised when it ends)."""

    def __init__(self) -> None:
        super().__init__()
        # One entry while no call is in flight: a call pops it in ``enter`` and puts it back in ``leave``. The pop
        # is the test and the mark in one step (a C call: no thread switch inside it), so two threads never both
        # get in, as a test and then a mark would let them (interpreted, a switch could fall between the two).
        # A ``threading.Lock`` taken without waiting would add ~190 ns a call compiled, the pop adds ~4
        # (tools/bench_call_guard.py). ``current`` only names the call in flight, for refusals.
        self.idle: list[None] = [None]
        self.current: str = ""
        # Appended by handles' ``__del__`` on whatever thread the collector runs (``deque.append`` is atomic),
        # popped only by ``close_dropped`` on the thread making manager calls.
        self.dropped: deque[LeftByDroppedHandle] = deque()
        # The thread of the last guarded call that may change state: the scheduler thread. Only it settles
        # (``settle``): a read made on the other thread must not close caches beside a call the scheduler thread may
        # be starting. A guarded read (``enter_read``) made on another thread does not take that role over.
        self.scheduler_thread: int = threading.get_ident()
        self.call_thread: int = self.scheduler_thread  # the thread of the call in flight (or of the last one)

    def enter(self, call: str) -> None:
        """Start public call ``call`` (e.g. ``"KVCache.resize"``); the caller runs ``leave`` in a ``finally``.

        Refuses (``RuntimeError``, nothing changed) when another call is in flight, then closes what dropped
        handles left behind."""
        try:
            self.idle.pop()
        except IndexError:
            raise RuntimeError(self._refusal(call)) from None
        self.call_thread = self.scheduler_thread = threading.get_ident()
        if self.dropped:
            self.current = CLOSING_DROPPED
            try:
                self._close_queued()
            except BaseException:
                self.leave()
                raise
            if self.interrupt is not None:
                self.leave()  # raises it: the call does not start
        self.current = call

    def enter_read(self, call: str) -> None:
        """``enter`` for a guarded call that changes nothing (``probe_reuse``, ``check_invariants``): made on another
        thread between two calls it does not make that thread the scheduler thread, whose next ``get_usage``
        would then be refused. (Restored after ``enter``: meanwhile this call is in flight, which refuses any other.)"""
        scheduler = self.scheduler_thread
        self.enter(call)
        self.scheduler_thread = scheduler

    def enter_scheduler_read(self, call: str) -> None:
        """``enter`` for a read of what the scheduler thread changes in the middle of its calls (``get_usage``,
        ``get_dirty_stats_kv_cache_ids``): refused on any other thread, even between two calls (one could start
        halfway through the read), before it reads anything."""
        if threading.get_ident() != self.scheduler_thread:
            raise RuntimeError(
                f"{call} was called on thread {threading.current_thread().name!r}, not the scheduler thread (the "
                f"thread of the last call that may change state): it reads what that thread changes in the middle "
                f"of its calls, so only that thread may call it; "
                f"another thread may read get_storage_statistics, movement_counters, num_live_caches, events and "
                f"iteration statistics"
            )
        self.enter(call)

    def _refusal(self, call: str) -> str:
        # Read once: the holder may leave meanwhile (then the refused call names what it found a moment ago).
        current = self.current or "another call"
        if threading.get_ident() != self.call_thread:
            return (
                f"{call} was called on thread {threading.current_thread().name!r} while {current} is in flight on "
                f"another thread: one thread makes every call that changes state (another may only read events, "
                f"statistics and counters)"
            )
        return (
            f"{call} was called while {current} is in flight: the manager is not re-entrant (user code a call runs, "
            f"a priority callback, an event-manager hook, a token iterator or an argument's __index__, must not "
            f"call the manager or its caches)"
        )

    def leave(self) -> None:
        """End the call started by ``enter``: log the warnings it held, then raise what user code interrupted it
        with."""
        self.current = ""
        self.idle.append(None)
        if self.warnings or self.interrupt is not None:
            self.deliver()

    def deliver(self) -> None:
        """After a call left (``leave``, the hot paths' inline copy): log the held warnings, each one even when a
        handler raised for an earlier one, then raise the first interrupt kept (that of the call, else the first
        handler's error: a handler raising is the caller's to see, now that nothing is half done)."""
        if self.warnings:
            for logger, message, args in self.take_warnings():
                try:
                    logger.warning(message, *args)
                except BaseException as error:
                    self.keep_first(error)
        if self.interrupt is not None:
            self.raise_deferred()

    def warn(self, logger: logging.Logger, message: str, *args: object) -> None:
        """``logger.warning(message, *args)``, held until the call in flight ends (at once when none is): a logging
        handler run mid-call could stop it half way (raising) or call the manager (refused, so raising)."""
        if self.current:
            self.warnings.append((logger, message, args))
        else:
            logger.warning(message, *args)

    def defer(self, error: BaseException) -> None:
        """``DeferredInterrupts.defer`` during a call; outside one (nothing half done) ``error`` goes on at once."""
        if not self.current and not isinstance(error, Exception):
            self.raise_now(error)
        super().defer(error)

    def entering(self, call: str) -> CallGuard:
        """``enter(call)`` for a ``with`` block, which runs ``leave`` on the way out (a refused ``enter`` raises
        before the block, leaving the call in flight alone): ``with guard.entering("KVCache.suspend"): ...``."""
        self.enter(call)
        return self

    def __enter__(self) -> None:
        pass

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.leave()

    def settle(self) -> None:
        """Close what dropped handles left behind unless a call is in flight (for reads that count open caches), on
        the scheduler thread only: from another thread the close would run beside that thread's next call (which
        would find it in flight and refuse), so there the read counts a dropped cache as open."""
        if not self.dropped or threading.get_ident() != self.scheduler_thread:
            return
        try:
            self.idle.pop()
        except IndexError:
            return  # a call is in flight (the next call closes them)
        self.current = CLOSING_DROPPED
        try:
            self._close_queued()
        finally:
            self.leave()

    def _close_queued(self) -> None:
        """Close everything queued, oldest first, inside the guard (named ``CLOSING_DROPPED``): a hook it runs
        cannot re-enter, and a handle dropped meanwhile joins this round. A close that raises leaves the rest
        queued."""
        dropped = self.dropped
        while dropped:
            dropped.popleft().close()
