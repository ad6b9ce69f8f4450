"""Iteration statistics in TensorRT-LLM's shape: ``KVCacheIterationStatsDelta`` per layer group, what
``KVCacheManager.get_and_reset_iteration_stats`` returns, and the per-request ``KVCacheStatsDelta``.

They are views of the per-layer-group ``IterationStats`` the page store counts (one page = one block of one layer
group); bytes come from the slot size of the group's pool group, since every page of a group has that size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from .events import IterationStats
from .._base.types import Sealed


@final
@dataclass
class KVCacheStatsDelta(Sealed):
    """Blocks of one request (or a sum of them): allocated in all (new + reused), new, reused, missed."""

    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0


@final
@dataclass
class KVCacheIterationStatsDelta(Sealed):
    """What one layer group did since the previous ``get_and_reset_iteration_stats``.

    ``iter_alloc_new_blocks``: pages allocated (new blocks, copy-on-write copies and SSM snapshots);
    ``iter_alloc_total_blocks``: those plus reused ones (a readmission's too); ``iter_reused_blocks`` = full +
    partial reuse; ``iter_reused_blocks`` and ``iter_missed_blocks`` count new requests' lookups, and
    ``iter_preempted_reused_blocks`` / ``iter_preempted_missed_blocks`` those of requests readmitted after a
    recompute preemption (``create_kv_cache(preempted=True)``), as vLLM's ``PrefixCacheStats`` keeps
    ``preempted_hits`` apart from ``hits``; a cache created with ``lookup=False`` (a KV connector's save) counts in
    none of them, nor its reused blocks in ``iter_alloc_total_blocks``;
    ``iter_gen_alloc_blocks``: pages allocated by decode steps (a resize adding one token of input);
    ``iter_intra_device_copy_*``: page copies inside a tier (copy-on-write, snapshots);
    ``iter_host_dropped_*``: cached pages dropped for good (evicted from the coldest tier, or cleared).
    """

    iter_alloc_total_blocks: int = 0
    iter_alloc_new_blocks: int = 0
    iter_reused_blocks: int = 0
    iter_full_reused_blocks: int = 0
    iter_partial_reused_blocks: int = 0
    iter_missed_blocks: int = 0
    iter_gen_alloc_blocks: int = 0
    iter_onboard_blocks: int = 0
    iter_onboard_bytes: int = 0
    iter_offload_blocks: int = 0
    iter_offload_bytes: int = 0
    iter_intra_device_copy_blocks: int = 0
    iter_intra_device_copy_bytes: int = 0
    iter_host_dropped_blocks: int = 0
    iter_host_dropped_bytes: int = 0
    iter_preempted_reused_blocks: int = 0
    iter_preempted_missed_blocks: int = 0


def iteration_delta(stats: IterationStats, page_bytes: int) -> KVCacheIterationStatsDelta:
    """``stats`` of one layer group whose pages are ``page_bytes`` each, in TensorRT-LLM's field names."""
    reused = stats.reused_full_blocks + stats.reused_partial_blocks
    return KVCacheIterationStatsDelta(
        iter_alloc_total_blocks=stats.allocated_pages + reused + stats.preempted_reused_blocks,
        iter_alloc_new_blocks=stats.allocated_pages,
        iter_reused_blocks=reused,
        iter_full_reused_blocks=stats.reused_full_blocks,
        iter_partial_reused_blocks=stats.reused_partial_blocks,
        iter_missed_blocks=stats.missed_blocks,
        iter_gen_alloc_blocks=stats.generation_pages,
        iter_onboard_blocks=stats.onboarded_pages,
        iter_onboard_bytes=stats.onboarded_bytes,
        iter_offload_blocks=stats.offloaded_pages,
        iter_offload_bytes=stats.offloaded_bytes,
        iter_intra_device_copy_blocks=stats.copied_pages,
        iter_intra_device_copy_bytes=stats.copied_pages * page_bytes,
        iter_host_dropped_blocks=stats.dropped_pages,
        iter_host_dropped_bytes=stats.dropped_pages * page_bytes,
        iter_preempted_reused_blocks=stats.preempted_reused_blocks,
        iter_preempted_missed_blocks=stats.preempted_missed_blocks,
    )
