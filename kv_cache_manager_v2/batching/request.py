"""The part of a request the continuous batcher reads and writes; applications subclass it with their own data."""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from .. import KVCache, Refusal, ReuseScope
from .._base.validation import as_int, as_non_negative_int


class BatchedRequest:
    """One request in the batcher's queues.

    ``follows``: the ``request_id`` of an earlier request (a previous chat turn) that must finish (or be rejected)
    before this one is admitted. ``max_length``: the tokens it computes in all, when known in advance (a replayed
    trace); None when decoding decides (a real model: the engine's ``is_done`` ends it). ``prompt_length`` may be
    set late (by ``BatchEngine.prepare``, e.g. after tokenising), but before the first admission attempt.
    ``refusal``: the manager's reason behind the batcher's latest failed attempt to admit, resume or grow it (what
    ``BatchEngine.reject`` reports when it gives up on the request; ``rejection`` says it in a sentence).
    """

    def __init__(
        self,
        request_id: int,
        prompt_length: int = 0,
        arrival_step: int = 0,
        follows: int | None = None,
        max_length: int | None = None,
    ) -> None:
        self.request_id: int = request_id
        self.prompt_length: int = prompt_length
        self.arrival_step: int = arrival_step
        self.follows: int | None = follows
        self.max_length: int | None = max_length
        self.cache: KVCache | None = None
        self.admitted: int = 0  # admission sequence number: the highest is the most recently admitted
        self.target: int = 0  # capacity scheduled for the current step
        self.requeues: int = 0  # times it was closed to be recomputed from scratch
        self.refusal: Refusal | None = None
        self._cut_chunk: tuple[int, int] = (0, 0)  # start and planned end of the chunk a snapshot point cut short

    @property
    def tokens(self) -> list[int]:
        """Every token known so far: the prompt, then what was generated (or, in a replay, all of them)."""
        raise NotImplementedError

    @property
    def scope(self) -> ReuseScope | None:
        """Where its prefix is looked up and its blocks are published (None: the shared default scope)."""
        return None

    @property
    def prefix_boundaries(self) -> tuple[int, ...]:
        """Prompt positions where a prefix other requests share ends (e.g. a system prompt's length), declared
        to the manager as ``snapshot_at`` so that a hybrid model's followers reuse up to there; () when unknown
        (the manager's ``snapshot_prefill_chunks`` still snapshots at chunk ends)."""
        return ()

    @property
    def rejection(self) -> str:
        """Why the batcher gave up on it, from ``refusal``: it does not fit even alone (``fits_empty_manager``
        False), or it fits alone but its step needs room no running request can give up, each having outgrown
        ``max_util_for_resume`` (suspended, it could never resume), so one of them had to go."""
        refusal = self.refusal
        reason = "" if refusal is None else f": {refusal.detail}"
        if refusal is None or not refusal.fits_empty_manager:
            return f"request {self.request_id} does not fit in the GPU tier even alone{reason}"
        return (
            f"request {self.request_id} fits the GPU tier alone, but its step needs room that no running request can "
            f"give up: each has outgrown max_util_for_resume (suspended, it could never resume; raise "
            f"max_util_for_resume or run fewer long requests at once){reason}"
        )

    def next_target(self, chunk: int, history: int, snapshot_block: int = 0, stops: Sequence[int] = ()) -> int:
        """The capacity of the next step: a prefill chunk of at most ``chunk`` tokens, or one decode token.

        A chunk also ends at the first of ``stops`` (ascending) inside it (the cache's ``snapshot_points``: the SSM
        state is snapshotted only where a computed chunk ends), and the next chunk then ends where the cut one would
        have: the chunk ends without stops (where ``snapshot_prefill_chunks`` snapshots too) stay where they were. With
        ``snapshot_block`` > 0 (the block size, with ``mamba_save_last_snapshot``) a chunk also stops where the
        prompt's last full block ends, so that the snapshot there is taken."""
        prompt_length = self.prompt_length
        if history < prompt_length:
            target = min(prompt_length, history + chunk)
            cut_start, cut_end = self._cut_chunk
            if cut_start < history < cut_end < target:
                target = cut_end
            end = target
            first = bisect_right(stops, history)  # stops ascend: the first past ``history`` is the only candidate
            if first < len(stops) and stops[first] < end:
                end = stops[first]
            if end < target:
                self._cut_chunk = (history, target)
            last_block_end = prompt_length // snapshot_block * snapshot_block if snapshot_block else 0
            return last_block_end if history < last_block_end < end else end
        if self.max_length is None:
            return history + 1
        return min(self.max_length, history + 1)


def check_requests(requests: Sequence[object]) -> None:
    """What the batcher needs of its requests, checked when it is built (each error names ``requests[i]`` and the
    field): ids unique integers; ``follows`` the id of an earlier request (a later one, itself or an unknown id
    would wait for ever); arrival steps non-negative and in order (an early arrival listed after a later one waits
    for it); lengths non-negative. Found in a step instead, a bad request failed half way through it."""
    positions: dict[int, int] = {}
    last_arrival = 0
    for position, request in enumerate(requests):
        name = f"requests[{position}]"
        if not isinstance(request, BatchedRequest):
            raise TypeError(f"{name} must be a BatchedRequest, got {request!r}")
        request_id = as_int(request.request_id, f"{name}.request_id")
        if request_id in positions:
            raise ValueError(f"{name}.request_id {request_id} is already used by requests[{positions[request_id]}]")
        if request.follows is not None:
            follows = as_int(request.follows, f"{name}.follows")
            if follows not in positions:
                raise ValueError(f"{name}.follows {follows} is the id of no earlier request")
        as_non_negative_int(request.prompt_length, f"{name}.prompt_length")
        if request.max_length is not None:
            as_non_negative_int(request.max_length, f"{name}.max_length")
        arrival = as_non_negative_int(request.arrival_step, f"{name}.arrival_step")
        if arrival < last_arrival:
            raise ValueError(
                f"{name}.arrival_step {arrival} is before requests[{position - 1}]'s {last_arrival}: requests are "
                f"listed in arrival order"
            )
        last_arrival = arrival
        positions[request_id] = position
