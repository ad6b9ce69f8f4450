"""Rows a batch admission lends: a later request of the batch (the follower) starts its history after blocks an
earlier one (the writer) computes in this very step (``batch_sharing.py``), so until that step has run those rows
hold nothing. A ``Loan`` records each such range on both caches; whatever makes the writer skip its step before
writing them (a resize below them, suspend, close) recalls them: the follower's ``history_length`` goes back to the
first row no step will write, so the engine computes them itself in the follower's step. A loan is settled (and
forgotten) once the writer's history covers it, or once the follower's history or commits moved on (its own step
ran, and with it, in the same forward, the writer's).

Each loan names the cache that computes its rows itself: a follower sharing pages its source borrowed in turn
borrows those rows from their writer (``lend_shared``), so a recall never has to follow a chain.
"""

from __future__ import annotations

from typing import Protocol


class Party(Protocol):
    """What a loan needs of a cache (``SuspendingCache``, the first layer on ``CacheView``): its lengths, its loans,
    and a recall of its history."""

    @property
    def history(self) -> int: ...

    @property
    def num_committed_tokens(self) -> int: ...

    @property
    def loans(self) -> RowLoans: ...

    def recall_history(self, position: int) -> None:
        """Move the history back to ``position`` (a follower whose lent rows from there on nobody will write)."""


class Loan:
    """Rows ``[begin, end)`` of ``follower``'s history that ``writer`` computes in its next step; empty once
    settled or recalled whole (``begin == end``), until the writer's list drops it."""

    def __init__(self, writer: Party, follower: Party, begin: int, end: int) -> None:
        self.writer = writer
        self.follower = follower
        self.begin = begin
        self.end = end


class RowLoans:
    """One cache's loans: those it writes (``lent``; ``lent_end`` is their highest row, below which the O(1)
    ``resize`` path must not cut) and those it reads (``borrowed``), and its lengths when it borrowed them
    (moved past: its step ran, so they are written)."""

    def __init__(self) -> None:
        self.lent: list[Loan] = []
        self.borrowed: list[Loan] = []
        self.lent_end: int = 0
        self.since_history: int = 0
        self.since_committed: int = 0


def lend(writer: Party, follower: Party, begin: int, end: int) -> None:
    """Record that ``writer``'s next step computes rows ``[begin, end)`` of ``follower``'s history."""
    if end <= begin:
        return
    loan = Loan(writer, follower, begin, end)
    lent = writer.loans
    lent.lent.append(loan)
    lent.lent_end = max(lent.lent_end, end)
    follower.loans.borrowed.append(loan)


def lend_shared(source: Party, follower: Party, begin: int, end: int, history: int) -> None:
    """``follower`` holds ``source``'s private pages of rows ``[begin, end)`` and starts its history at
    ``history``: rows ``source`` itself borrowed are lent by their writer, those past ``source``'s history by
    ``source``; rows below that and outside its loans are written already (copied at its admission)."""
    borrowed = follower.loans
    borrowed.since_history = history
    borrowed.since_committed = follower.num_committed_tokens
    for loan in source.loans.borrowed:
        lend(loan.writer, follower, max(begin, loan.begin), min(end, loan.end))
    lend(source, follower, max(begin, source.history), end)


def _advanced(follower: Party) -> bool:
    """Whether the follower computed or committed since it borrowed: its step ran, reading the lent rows."""
    loans = follower.loans
    return follower.history > loans.since_history or follower.num_committed_tokens > loans.since_committed


def recall_beyond(writer: Party, position: int) -> None:
    """``writer``'s next step computes no row from ``position`` on (cut there, or suspended or closed at its
    history): every follower still waiting for such a row gets its history back to the first of them. Loans the
    writer's history covers, or whose follower moved on, are settled and dropped."""
    loans = writer.loans
    if not loans.lent:
        return
    written = writer.history
    kept: list[Loan] = []
    for loan in loans.lent:
        if loan.end <= loan.begin:
            continue
        follower = loan.follower
        if written >= loan.end or _advanced(follower):
            _forget(loan)
            continue
        if loan.end > position:
            follower.recall_history(max(loan.begin, position))  # also cuts this loan back to the recalled rows
        if loan.end > loan.begin:
            kept.append(loan)
    loans.lent = kept
    loans.lent_end = max([loan.end for loan in kept], default=0)


def recall_to(follower: Party, position: int) -> None:
    """``follower``'s history went back to ``position``: it computes every later row itself, so no loan reaches
    past it any more, and it waits for its remaining loans from its new lengths."""
    loans = follower.loans
    kept: list[Loan] = []
    for loan in loans.borrowed:
        loan.end = min(loan.end, max(loan.begin, position))
        if loan.end > loan.begin:
            kept.append(loan)
    loans.borrowed = kept
    loans.since_history = follower.history
    loans.since_committed = follower.num_committed_tokens


def forget_borrowed(follower: Party) -> None:
    """``follower`` closed: its loans are void (each writer's list drops them at its next recall)."""
    for loan in follower.loans.borrowed:
        loan.end = loan.begin
    follower.loans.borrowed = []


def _forget(loan: Loan) -> None:
    """A settled loan leaves the follower's list (the writer's drops it as it goes)."""
    loan.end = loan.begin
    borrowed = loan.follower.loans.borrowed
    if loan in borrowed:
        borrowed.remove(loan)
