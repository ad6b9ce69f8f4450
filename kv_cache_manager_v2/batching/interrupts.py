"""Ctrl-C held until the end of a step, so that it never lands inside a manager call.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when SIGINT arrives: between ``create_kv_cache``
returning and the request keeping its cache, or halfway through a batch of admissions. A cache opened there is
owned by nobody, so cleanup cannot close it and ``shutdown()`` refuses. Deferring the interrupt to the step boundary
removes every such window at once: between steps each open cache belongs to a queued request.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Callable


class StepBoundaryInterrupts:
    """A context: while inside it, the first SIGINT is recorded and ``check()`` raises it at the next boundary.

    A second SIGINT before that boundary raises at once (a step stuck for good can still be stopped). Only the main
    thread's default handler is replaced: an ignored SIGINT (nohup, CI runners) stays ignored and a handler the
    application installed stays in charge."""

    def __init__(self, terminate: bool = False) -> None:
        """``terminate``: hold SIGTERM the same way where its default (end the process at once) is in place, so a
        tool stopped by ``kill`` or a supervisor ends as on Ctrl-C, with what it has to say. A SIGTERM the command
        line turned into an interrupt is held in any case."""
        self.pending: bool = False
        self._terminate = terminate
        self._held_interrupt: bool = False
        self._terminate_before: signal.Handlers | Callable[[int, FrameType | None], object] | int | None = None

    def __enter__(self) -> StepBoundaryInterrupts:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._hold)
                self._held_interrupt = True
            before = signal.getsignal(signal.SIGTERM)
            # The command line's SIGTERM raises as SIGINT does (``_base/startup.py``): held alike by every app.
            if before is signal.default_int_handler or (self._terminate and before == signal.SIG_DFL):
                signal.signal(signal.SIGTERM, self._hold)
                self._terminate_before = before
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._held_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._held_interrupt = False
        if self._terminate_before is not None:
            signal.signal(signal.SIGTERM, self._terminate_before)
            self._terminate_before = None

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a held signal arrived since the last check (call it between steps)."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
