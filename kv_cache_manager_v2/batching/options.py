"""How the continuous batcher schedules: the knobs the simulator and the model server set differently."""

from __future__ import annotations

from dataclasses import dataclass

from .._base.validation import as_non_negative_int, as_positive_int


@dataclass(frozen=True)
class BatchingOptions:
    """``chunk``: most prompt tokens one step computes for a request. ``max_batch``: most requests running at once.
    ``snapshot_block``: see ``BatchedRequest.next_target`` (0: off). ``batch_admission``: admit a step's new
    requests with one ``create_kv_cache_batch`` call instead of one ``create_kv_cache`` each. ``probe_reuse``: ask
    ``probe_reuse`` before each single admission (what a scheduler does to size the first chunk; it costs a match).
    ``refusal_backoff`` (on by default): after a refused admission, try again only once the GPU tier has more
    available slots (each retry opens a cache, matches its prefix and closes it again: a request of thousands of
    pages retried every step costs more than the steps themselves). ``prefetch``:
    between steps, bring the pages of the suspended request next in line to resume to the GPU (``KVCache.prefetch``)
    and fetch the next waiting requests' prefixes from the remote tier when there is one (``prefetch_remote``); see
    ``prefetching.py``."""

    chunk: int = 256
    max_batch: int = 8
    snapshot_block: int = 0
    batch_admission: bool = False
    probe_reuse: bool = False
    refusal_backoff: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        as_positive_int(self.chunk, "chunk")
        as_positive_int(self.max_batch, "max_batch")
        as_non_negative_int(self.snapshot_block, "snapshot_block")
        for name in ("batch_admission", "probe_reuse", "refusal_backoff", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
