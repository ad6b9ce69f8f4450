"""``DeferredInterrupts``: a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, a
user's own class) raised by user code the manager runs in the middle of changing its state: a cold-page codec, a
remote store, an event-manager hook.

That code's ``Exception`` already degrades where it is caught (a lost page, a miss, a hook error kept for the next
flush). Raised through, a ``BaseException`` stopped the call half way: pages moved in the books whose bytes never
moved (served with the wrong content), locks taken and never filed, fetched pages left claimed. So the same places
catch it, degrade it the same way and hand it here; the call runs to its end and ``CallGuard`` (the subclass that
knows the call in flight) raises it there.
"""

from __future__ import annotations


class DeferredInterrupts:
    """The first ``BaseException`` user code raised during the call in flight, raised when the call ends."""

    def __init__(self) -> None:
        self.interrupt: BaseException | None = None

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
