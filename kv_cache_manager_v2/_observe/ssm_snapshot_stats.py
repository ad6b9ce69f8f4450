"""How often new caches of an SSM model found a state snapshot to start from (TensorRT-LLM's
``SsmSnapshotIterationStatsDelta``): with SSM layers a prefix is reusable only up to a snapshot, so the snapshot
hit rate, not the block hit rate, says whether ``ssm_reuse_interval`` suits the traffic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from .._base.types import FrozenValue, LayerGroupId

# Positions of the counters in a life cycle's running totals.
_LOOKUPS, _HITS, _MISSES, _REUSED, _UNREUSED, _ALIGNED, _UNALIGNED, _PREEMPTED_LOOKUPS, _PREEMPTED_HITS = range(9)


@final
@dataclass(frozen=True)
class SsmSnapshotIterationStatsDelta(FrozenValue):
    """One SSM layer group's snapshot lookups since the previous ``get_and_reset_ssm_snapshot_iteration_stats``: a
    lookup per new cache with input tokens, a hit when it reused any (always from one complete snapshot), the
    tokens reused and not, and whether the reused length ended on a block boundary. A cache readmitted after a
    recompute preemption (``create_kv_cache(preempted=True)``) counts only in ``iter_preempted_snapshot_lookups``
    and ``iter_preempted_snapshot_hits`` (vLLM's ``preempted_requests`` / ``preempted_hits``); one created with
    ``lookup=False`` (a KV connector's save) counts nowhere."""

    iter_snapshot_lookups: int = 0
    iter_snapshot_hits: int = 0
    iter_snapshot_misses: int = 0
    iter_reused_tokens: int = 0
    iter_unreused_tokens: int = 0
    iter_aligned_snapshot_hits: int = 0
    iter_unaligned_snapshot_hits: int = 0
    iter_preempted_snapshot_lookups: int = 0
    iter_preempted_snapshot_hits: int = 0

    @property
    def iter_snapshot_hit_rate(self) -> float:
        """Hits per lookup, 0.0 without lookups."""
        return self.iter_snapshot_hits / self.iter_snapshot_lookups if self.iter_snapshot_lookups else 0.0


class SsmSnapshotCounters:
    """Running totals per SSM layer group, read as differences (the stats reader may run beside the scheduler)."""

    def __init__(self, ssm_life_cycles: list[LayerGroupId], tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.totals: dict[LayerGroupId, list[int]] = {lc: [0] * 9 for lc in ssm_life_cycles}
        self.taken: dict[LayerGroupId, list[int]] = {lc: [0] * 9 for lc in ssm_life_cycles}

    def record_lookup(self, lookup_tokens: int, reused_tokens: int, preempted: bool = False) -> None:
        """A new cache looked up ``lookup_tokens`` input tokens and starts from ``reused_tokens`` of them (a
        readmission after preemption when ``preempted``: counted apart)."""
        if lookup_tokens <= 0:
            return
        hit = reused_tokens > 0
        if preempted:
            for totals in self.totals.values():
                totals[_PREEMPTED_LOOKUPS] += 1
                totals[_PREEMPTED_HITS] += 1 if hit else 0
            return
        aligned = hit and reused_tokens % self.tokens_per_block == 0
        for totals in self.totals.values():
            totals[_LOOKUPS] += 1
            totals[_HITS if hit else _MISSES] += 1
            totals[_REUSED] += reused_tokens
            totals[_UNREUSED] += lookup_tokens - reused_tokens
            if hit:
                totals[_ALIGNED if aligned else _UNALIGNED] += 1

    def take(self) -> dict[LayerGroupId, SsmSnapshotIterationStatsDelta]:
        """Per SSM layer group with lookups since the previous take, what they were."""
        result: dict[LayerGroupId, SsmSnapshotIterationStatsDelta] = {}
        for lc, totals in self.totals.items():
            now = list(totals)
            before = self.taken[lc]
            if now[_LOOKUPS] == before[_LOOKUPS] and now[_PREEMPTED_LOOKUPS] == before[_PREEMPTED_LOOKUPS]:
                continue
            d = [a - b for a, b in zip(now, before)]
            result[lc] = SsmSnapshotIterationStatsDelta(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8])
            self.taken[lc] = now
        return result
