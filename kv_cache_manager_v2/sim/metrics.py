"""The simulator's measurements: the result's per-group figures, reuse counted at each first admission (split by
the tier the pages were found on), the per-step memory samples, and the counters gathered at the end."""

from __future__ import annotations

import time

from .. import COMPILED, KVCache, KVCacheManager, SsmLayerConfig
from .._storage.memory import COPY_CLOCK
from ..testing.fake_engine import FakeEngine
from .options import SimulatorOptions, byte_divisor
from .result import LayerGroupFigures, PoolGroupFigures, SimulationResult
from .reuse_sources import EventForward, ReuseSources


class Metrics:
    """Fills one ``SimulationResult`` while ``Simulation`` runs (the figures the report shows)."""

    def __init__(self, options: SimulatorOptions, manager: KVCacheManager, kv_events: EventForward | None = None) -> None:
        """``kv_events`` gets every KV event the run records, once per step (and around admissions)."""
        self.options = options
        self.manager = manager
        self.num_groups: int = manager.num_layer_groups
        self.group_pool: list[int] = [manager.get_pool_group_index(group) for group in range(self.num_groups)]
        self.kinds: list[str] = [group_kind(manager, group) for group in range(self.num_groups)]
        # The layer group whose reused pages cover every reused token: tokens per tier are counted on it.
        self.token_group: int = self.kinds.index("full") if "full" in self.kinds else -1
        self.sources: ReuseSources = ReuseSources(manager, kv_events)
        self.byte_scale: int = byte_divisor(options)  # bytes are reported at the preset's real sizes
        result = SimulationResult(options, manager.backend, COMPILED)
        for group, layers in enumerate(manager.layer_grouping):
            window, _ = manager.get_layer_window(layers[0])
            figures = LayerGroupFigures(group, self.kinds[group], window, len(layers), self.group_pool[group])
            figures.reused_pages_by_tier = [0] * manager.num_cache_levels
            result.layer_groups.append(figures)
        for pool_group, stat in enumerate(manager.get_storage_statistics(0)):
            slot_bytes = sum(manager.get_slot_bytes(pool_group)) * self.byte_scale
            result.pool_groups.append(PoolGroupFigures(pool_group, slot_bytes, stat.total))
        self.colder_levels: range = range(1, manager.num_cache_levels)
        for level in self.colder_levels:
            result.colder_slots.append([stat.total for stat in manager.get_storage_statistics(level)])
        self.result = result
        self.copy_ns_at_start: int = COPY_CLOCK.ns  # every page copy of the run happens inside a timed manager call

    def count_reuse(self, prompt_length: int, reused: int, reused_pages: list[int], sign: int = 1) -> None:
        """Reuse at a request's first admission (a recomputed request reusing its own earlier work is not a
        prefix hit any ideal would count). A cache reuses one prefix length for every layer group (the match is
        pruned until every group can serve it). ``sign=-1`` takes a rejected request's share back out: the hit
        rate is over served requests."""
        result = self.result
        result.prompt_tokens += sign * prompt_length
        result.reused_tokens += sign * reused
        for group, figures in enumerate(result.layer_groups):
            figures.reused_tokens += sign * reused
            figures.reused_pages += sign * reused_pages[group]

    def count_sources(self, reused: int, reused_pages: list[int], cold_pages: list[list[int]], sign: int = 1) -> None:
        """Split reused pages (and, on the full-attention group, reused tokens) by the tier they were found on:
        those onboarded from a colder tier, the rest on the GPU (``sign=-1``: a rejected request's share out)."""
        result = self.result
        tpb = self.options.tokens_per_block
        for group, figures in enumerate(result.layer_groups):
            cold = cold_pages[group]
            by_tier = figures.reused_pages_by_tier
            by_tier[0] += sign * (reused_pages[group] - sum(cold))
            for level in range(1, len(cold)):
                by_tier[level] += sign * cold[level]
        if self.token_group < 0:
            return
        cold = cold_pages[self.token_group]
        cold_tokens = 0
        for level in range(1, len(cold)):
            tokens = min(cold[level] * tpb, reused - cold_tokens)
            result.reused_tokens_by_tier[level] += sign * tokens
            cold_tokens += tokens
        result.reused_tokens_by_tier[0] += sign * (reused - cold_tokens)

    def reused_pages(self, cache: KVCache, reused: int) -> list[int]:
        """Cached pages each layer group got back: blocks of the reused prefix that have a GPU page."""
        blocks = -(-reused // self.options.tokens_per_block)
        counts: list[int] = []
        for group in range(self.num_groups):
            if self.kinds[group] == "ssm":
                counts.append(1 if reused > 0 else 0)  # SSM reuse always restores one snapshot
                continue
            indices = cache.get_base_page_indices(group)
            counts.append(sum(1 for index in indices[:blocks] if index >= 0))
        return counts

    def sample(self, step: int, caches: list[KVCache]) -> None:
        """Memory high-water mark of this step (after every resize, before any commit) and the hit rate so far."""
        result = self.result
        stats = self.manager.get_storage_statistics(0)
        in_use = [stat.unavailable for stat in stats]
        occupied = [stat.total - stat.free for stat in stats]
        savings = [0] * len(stats)
        if self.options.scratch:
            for cache in caches:
                for group in range(self.num_groups):
                    if self.kinds[group] != "swa":
                        continue
                    desc = cache.get_scratch_desc(group)
                    if desc is not None and desc:
                        savings[self.group_pool[group]] += len(desc.range) - len(desc.slot_ids)
        for pool_group, figures in enumerate(result.pool_groups):
            figures.peak_in_use = max(figures.peak_in_use, in_use[pool_group])
            figures.peak_occupied = max(figures.peak_occupied, occupied[pool_group])
            figures.peak_without_scratch = max(figures.peak_without_scratch, in_use[pool_group] + savings[pool_group])
        result.timeline_steps.append(step)
        result.timeline_hit_rate.append(result.hit_rate)
        result.timeline_in_use.append(in_use)
        result.timeline_occupied.append(occupied)
        result.timeline_colder.append(
            [[stat.total - stat.free for stat in self.manager.get_storage_statistics(level)] for level in self.colder_levels]
        )
        result.timeline_running.append(len(caches))
        result.timeline_preemptions.append(result.preemptions)

    def gather(self, engine: FakeEngine | None, done: int, start: float) -> None:
        """Copy the manager's and the engine's counters into the result (at the end, or when interrupted);
        ``done`` counts finished and rejected requests."""
        result = self.result
        counters = self.manager.movement_counters
        result.onboarded_pages = counters.onboarded_pages
        result.offloaded_pages = counters.offloaded_pages
        result.copied_pages = counters.copied_pages
        result.dropped_pages = counters.dropped_pages
        result.onboarded_bytes = counters.onboarded_bytes * self.byte_scale
        result.offloaded_bytes = counters.offloaded_bytes * self.byte_scale
        result.manager_copy_ns = COPY_CLOCK.ns - self.copy_ns_at_start
        if engine is not None:
            result.checked_tokens = engine.tokens_checked
        result.finished = done - result.rejected
        if result.timeline_hit_rate:
            # A request rejected alone (it outgrew the GPU tier) leaves in a step that computes nothing, so takes
            # no sample: the series' end would still count it while the summary does not.
            result.timeline_hit_rate[-1] = result.hit_rate
        result.wall_s = time.perf_counter() - start


def share_cold_pages(reused_pages: list[list[int]], cold_pages: list[list[int]]) -> list[list[list[int]]]:
    """The pages an admission call onboarded (per layer group and tier), shared out among the requests it
    admitted (their reused pages per group, in call order), coldest tier first, so a rejected request's share can
    be taken back out; the shares add up to the call's figures."""
    left = [list(levels) for levels in cold_pages]
    shares: list[list[list[int]]] = []
    for pages in reused_pages:
        share: list[list[int]] = []
        for group, levels in enumerate(left):
            room = pages[group]
            taken = [0] * len(levels)
            for level in range(len(levels) - 1, 0, -1):
                taken[level] = min(room, levels[level])
                levels[level] -= taken[level]
                room -= taken[level]
            share.append(taken)
        shares.append(share)
    return shares


def group_kind(manager: KVCacheManager, group: int) -> str:
    """``"full"``, ``"swa"`` (sliding window) or ``"ssm"``."""
    layer_id = manager.layer_grouping[group][0]
    for layer in manager.config.layers:
        if layer.layer_id == layer_id and isinstance(layer, SsmLayerConfig):
            return "ssm"
    window, _ = manager.get_layer_window(layer_id)
    return "swa" if window > 0 else "full"
