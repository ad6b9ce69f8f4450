"""The seam through which the page store tells a colder layer above it (the remote tier) what happens to pages.

The store must not import that layer; it calls whatever listener the manager plugged in, through this Protocol.
"""

from __future__ import annotations

from typing import Protocol

from .page import Page


class PageListener(Protocol):
    """What the page store reports, in its own order: drops one page at a time, then the end of a batch of moves."""

    def capture(self, page: Page) -> None:
        """``page`` (committed, still linked to its block) is about to be dropped: take what is needed now."""

    def send(self) -> None:
        """The recorded copies ran: act on what was captured since the last call."""
