"""``DeferredInterrupts``: a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, a
user's own class) raised by user code the manager runs in the middle of changing its state: a cold-page codec, a
remote store, an event-manager hook.

That code's ``Exception`` already degrades where it is caught (a lost page, a miss, a hook error kept for the next
flush). Raised through, a ``BaseException`` stopped the call half way: pages moved in the books whose bytes never
moved (served with the wrong content), locks taken and never filed, fetched pages left claimed. So the same places
catch it, degrade it the same way and hand it here; the call runs to its end and ``CallGuard`` (the subclass that
knows the call in flight) raises it there. An error kept longer than its call (an event-manager hook's, until the
next flush) is kept through ``drop_frames``.

A warning the manager logs in the middle of a call (a lost page, a store treated as down) runs user code too: the
handlers and filters of the logging configuration. ``warn`` holds it while a call is in flight; it is logged when the
call ends, where a handler may call the manager and whatever it raises leaves nothing half done.
"""

from __future__ import annotations

import logging
import traceback


class DeferredInterrupts:
    """The first ``BaseException`` user code raised during the call in flight, raised when the call ends."""

    def __init__(self) -> None:
        self.interrupt: BaseException | None = None
        # (logger, message, arguments) of the warnings held until the call ends (``CallGuard.warn``)
        self.warnings: list[tuple[logging.Logger, str, tuple[object, ...]]] = []

    def warn(self, logger: logging.Logger, message: str, *args: object) -> None:
        """Log a warning (``logger.warning(message, *args)``): here at once, since no call is known to be in flight;
        ``CallGuard`` holds it until the call in flight ends."""
        logger.warning(message, *args)

    def take_warnings(self) -> list[tuple[logging.Logger, str, tuple[object, ...]]]:
        """The warnings held so far, handed over once (none are held after)."""
        held = self.warnings
        self.warnings = []
        return held

    def keep_first(self, error: BaseException) -> None:
        """Keep ``error`` to raise when the call ends unless one is kept already (an ``Exception`` too: a logging
        handler's, raised once nothing is half done)."""
        if self.interrupt is None:
            self.interrupt = error

    def defer(self, error: BaseException) -> None:
        """Called where user code's error was caught and degraded: keep ``error`` for the end of the call unless it
        is an ``Exception`` (degrading it was the whole answer); the first one kept wins."""
        if not isinstance(error, Exception) and self.interrupt is None:
            self.interrupt = error

    def raise_now(self, error: BaseException) -> None:
        """Raise ``error`` at once (nothing is half done), as ``raise_deferred`` would."""
        self.interrupt = error
        self.raise_deferred()

    def raise_deferred(self) -> None:
        """Raise (and forget) the kept interrupt, if any."""
        error = self.interrupt
        if error is not None:
            self.interrupt = None
            try:
                raise error
            finally:
                error = None  # no cycle through this frame: the traceback's frames (a dropped handle) go at once



def drop_frames(error: BaseException) -> None:
    """Clear the traceback of ``error`` (and of the errors chained to it), which is kept past the call that raised
    it: a traceback holds its frames and, through ``f_back``, every caller's (the manager, the engine's ``KVCache``
    handles) alive until the error is dropped. Where it was raised stays readable in a note (Python 3.11+)."""
    where = "".join(traceback.format_tb(error.__traceback__))
    add_note = getattr(error, "add_note", None)
    if where and add_note is not None:
        add_note("raised at (traceback cleared where the error was kept):\n" + where.rstrip("\n"))
    seen: set[int] = set()
    chained: list[BaseException] = [error]
    while chained:
        current = chained.pop()
        if id(current) not in seen:
            seen.add(id(current))
            current.__traceback__ = None
            chained.extend(linked for linked in (current.__cause__, current.__context__) if linked is not None)
