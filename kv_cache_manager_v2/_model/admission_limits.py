"""What one request can ever be, asked at start-up: an engine sizes its scheduler (longest prompt, chunk size) from
these answers instead of discovering the limit as refusals under load.

The answers are about an otherwise empty manager with the GPU tier split as it is now: one request whose largest
step holds ``num_tokens`` tokens, the last ``chunk`` of them computed in that step (history ``num_tokens - chunk``;
sliding windows keep a chunk's out-of-window blocks until the step ends, so a larger chunk needs more pages).
"""

from __future__ import annotations

import logging

from .planning import QuotaPlanner
from ..config import BatchDesc

logger = logging.getLogger("kv_cache_manager_v2")


def request_fits(planner: QuotaPlanner, slot_counts: list[int], num_tokens: int, chunk: int) -> bool:
    return planner.lengths_fit(num_tokens, 1, slot_counts, chunk)


def largest_request(planner: QuotaPlanner, slot_counts: list[int], chunk: int, upper_bound: int) -> int:
    """The largest ``num_tokens <= upper_bound`` that ``request_fits``; 0 when none does."""
    return planner.clamp_max_seq_len(1, upper_bound, slot_counts, chunk)


def warn_if_declared_request_cannot_fit(planner: QuotaPlanner, slot_counts: list[int], typical_step: BatchDesc) -> bool:
    """Log once (at construction) when the longest cache the config's ``typical_step`` declares cannot fit the
    GPU tier even alone: every such request would be refused forever. Returns whether it warned."""
    if not typical_step.kv_caches:
        return False
    longest = max(typical_step.kv_caches, key=lambda desc: desc.capacity)
    chunk = longest.capacity - longest.history_length
    if request_fits(planner, slot_counts, longest.capacity, chunk):
        return False
    logger.warning(
        "the GPU tier cannot hold one request of %d tokens with a %d-token chunk (typical_step's longest cache): "
        "every such request will be refused; the longest that fits is %d tokens",
        longest.capacity,
        chunk,
        largest_request(planner, slot_counts, chunk, longest.capacity),
    )
    return True
