"""What differs between the batcher's users: the engine that computes a step, and what each wants to count.

The simulator's engine writes and checks token records (``FakeEngine``) and fills its figures; a real model's
runs the forward pass and picks the next token. Every hook but ``compute`` and ``is_done`` does nothing by
default, so an engine overrides only what it needs.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from .. import KVCache
from .request import BatchedRequest

R = TypeVar("R", bound=BatchedRequest)


class BatchEngine(Generic[R]):
    """The batcher calls these hooks; subclass it and override ``compute`` and ``is_done`` at least."""

    def compute(self, scheduled: list[R]) -> None:
        """Compute this step: for each request, the tokens ``[cache.history_length, request.target)`` (whose
        pages the caches now have). A request whose step reaches its last known token appends the next one to its
        ``tokens`` here; the batcher then commits ``tokens[num_committed_tokens:target]``."""
        raise NotImplementedError

    def is_done(self, request: R) -> bool:
        """Whether ``request`` has finished after this step's commit (its cache is then closed)."""
        raise NotImplementedError

    def prepare(self, request: R) -> None:
        """Before each admission attempt (and before a remote prefetch of its prefix): make ``request.tokens`` and
        ``prompt_length`` ready (e.g. tokenise); it may be called more than once per request."""

    def before_admission(self) -> None:
        """Right before the manager calls that admit new requests (e.g. to reset onboarding counters)."""

    def after_admission(self) -> None:
        """Right after those calls, when they matched something (a resumed cache, or any batch answer)."""

    def matched(self, request: R, cache: KVCache) -> None:
        """``request``'s new cache holds its reused prefix (``num_committed_tokens``), before its first resize."""

    def admitted(self, requests: list[R]) -> None:
        """The requests one admission call let in (one, or the admitted part of a batch; maybe none)."""

    def finished(self, request: R) -> None:
        """``request`` is done and its cache closed."""

    def requeued(self, request: R) -> None:
        """``request``'s cache was closed to free memory: it will be recomputed from scratch (forget its output)."""

    def reject(self, request: R) -> None:
        """``request`` cannot fit even alone on the machine, or its step needs room that only running requests
        grown past ``max_util_for_resume`` hold (``request.refusal``: the manager's reason, when it gave one, its
        ``fits_empty_manager`` telling the two apart; ``request.rejection``: a sentence). Raise to stop serving;
        return to drop it (the batcher closes its cache and counts it as rejected; requests that follow it may then
        run)."""
        raise RuntimeError(request.rejection)

    def step_done(self) -> None:
        """After each step's commits (e.g. to drain the manager's event log)."""
