"""The manager's run-time memory decisions: tier quotas (``resize``), the split of a tier across pool groups for the
observed request mix (``adjust``), and what fits (``can_fit``, ``max_admissible``, ``clamp_max_seq_len_for_mem``)."""

from __future__ import annotations

from typing import SupportsIndex

from .._cache.refusal import Refusal, split_hint
from .._model.planning import closest_quota
from .._model.admission_limits import (
    admission_shortfall, chunked_shortfall, largest_chunked_request, peak_request_pages, step_shortfall,
)
from .._base.types import GPU_LEVEL, MAX_BLOCKS_PER_CACHE
from .._base.validation import as_int, as_non_negative_int
from .._base.wording import counted



from .layout_queries import ManagerLayoutQueries


class ManagerQuotas(ManagerLayoutQueries):
    """Quota changes and admission bounds; a call that changes a quota needs every cache suspended."""

    def get_quota(self, cache_level: SupportsIndex) -> int:
        """Bytes the cache tier at ``cache_level`` may use now (its config's quota, or the last ``resize``)."""
        return self._tiers[self._check_level(cache_level)].quota

    def resize(self, cache_level: SupportsIndex, quota: SupportsIndex, best_efforts: bool = False) -> bool:
        """Change a tier's quota at run time (every cache suspended). Pool base addresses never move: False,
        changing nothing, when the quota exceeds the tier's reservation (``max_quota``), held pages would not fit,
        a GPU quota would leave a pool group without a slot or below the ``constraints``, or a disk tier's
        filesystem cannot back the new slots; ``last_refusal`` then says which, for which pool group.

        ``best_efforts``: where ``quota`` cannot be had, move to the quota nearest it that can (each pool group
        within its reservation, held pages fitting); ``get_quota`` then reports the quota reached, and False only
        when the tier could not move towards ``quota`` at all."""
        guard = self._guard
        guard.enter("KVCacheManager.resize")
        try:
            level = self._check_level(cache_level)
            new_quota = as_int(quota, "quota")
            if not isinstance(best_efforts, bool):
                raise TypeError(f"best_efforts must be a bool, got {best_efforts!r}")
            if new_quota < 0 or (new_quota == 0 and level == GPU_LEVEL):
                raise ValueError(f"quota must be > 0 for the GPU tier and >= 0 for the others, got {new_quota}")
            for cache in self._caches.live.values():
                if cache.is_active:
                    raise ValueError(f"manager.resize needs every cache suspended; cache {cache.id} is active")
            applied = self._apply_quota(level, new_quota)
            if not applied and best_efforts:
                current = self._tiers[level].quota
                nearest = closest_quota(current, new_quota, lambda quota: self._quota_fits(level, quota))
                if nearest > current:  # the fewest bytes giving those slots (not a byte short of the next slot)
                    counts = self._quota_counts(level, nearest)
                    nearest = closest_quota(nearest, current, lambda quota: self._quota_counts(level, quota) == counts)
                applied = nearest != current and self._apply_quota(level, nearest)
            if not applied:
                split = self._tier_split(level, new_quota, self._planner.demand)
                self._services.note_refusal(self._quota_refusal("KVCacheManager.resize", level, new_quota, split))
            self._services.after_call()
            return applied
        finally:
            guard.leave()

    def _gpu_split_usable(self, counts: list[int]) -> bool:
        return all(count > 0 or not self._needs_slots(pool_group) for pool_group, count in enumerate(counts))

    def _quota_counts(self, level: int, quota: int) -> list[int] | None:
        """The tier's slot counts per pool group under ``quota``, or None where they could serve no request."""
        counts = self._tier_split(level, quota, self._planner.demand)
        if counts is None or (level == 0 and not self._gpu_split_usable(counts)):
            return None
        return counts

    def _quota_fits(self, level: int, quota: int) -> bool:
        counts = self._quota_counts(level, quota)
        return counts is not None and self._store.can_resize_slots(level, counts)

    def _quota_refusal(self, call: str, level: int, quota: int, split: list[int] | None) -> Refusal:
        """Why ``level`` cannot take ``split`` (its pool groups' slot counts under ``quota`` bytes; None: there is
        none). ``fits_empty_manager`` is True when only the pages held now stand in the way."""
        pool_groups = self._tiers[level].pool_groups
        tier = f"{self._tiers[level].tier.name} tier (level {level})"
        kind = self._tiers[level].tier
        if split is None:  # the constraints' floors alone exceed the quota (a GPU tier's only): no split exists
            floors = self._planner.floors
            group = floors.index(max(floors))
            needed = max(1, floors[group])
            slot_bytes = [layout.slot_bytes for layout in self._planner.layout.pool_groups]
            floor_bytes = sum(floor * size for floor, size in zip(floors, slot_bytes))
            detail = (
                f"{counted(quota, 'byte')} cannot cover the slots KVCacheManagerConfig.constraints keep in the {tier} "
                f"({counted(floor_bytes, 'byte')}): no split exists, so pool group {group} would get 0 slots, at least "
                f"{counted(needed, 'slot')} needed (raise the quota or declare smaller constraints)"
            )
            return Refusal(call, kind, level, group, needed, 0, pool_groups[group].num_slots, False, detail)
        if level == GPU_LEVEL and not self._gpu_split_usable(split):
            group = next(group for group, count in enumerate(split) if count == 0 and self._needs_slots(group))
            detail = (
                f"{counted(quota, 'byte')} cannot give the {tier}'s pool groups the slots the typical step and the "
                f"constraints ask for: pool group {group} would get 0 slots, at least 1 slot needed (raise the quota)"
            )
            return Refusal(call, kind, level, group, 1, 0, pool_groups[group].num_slots, False, detail)
        obstacle = self._store.resize_obstacle(level, split)
        if obstacle is None:  # the slots fit; the backing store could not be extended
            detail = f"the filesystem under the {tier} cannot back {counted(quota, 'byte')} (no space left, or an error: logged)"
            return Refusal(call, kind, level, 0, split[0], pool_groups[0].num_slots, pool_groups[0].num_slots, False,
                           detail)
        group, beyond = obstacle
        storage = pool_groups[group]
        if beyond:
            detail = (
                f"pool group {group} would need {counted(split[group], 'slot')} in the {tier}; it reserved room for "
                f"{storage.max_slots} (raise the tier's max_quota)"
            )
            return Refusal(call, kind, level, group, split[group], storage.max_slots, storage.num_slots, False, detail)
        staying = self._store.staying(level, group)  # what eviction cannot take out of the tier
        detail = (
            f"pool group {group} holds {counted(staying, 'page')} in the {tier} that can neither be dropped nor moved to a "
            f"colder tier, {staying - split[group]} more than the {counted(split[group], 'slot')} it would keep (close or "
            f"shorten the caches holding them first)"
        )
        return Refusal(call, kind, level, group, staying, split[group], storage.num_slots, True, detail)

    def _apply_quota(self, level: int, quota: int) -> bool:
        counts = self._quota_counts(level, quota)
        if counts is None or not self._store.resize_slots(level, counts):
            return False
        self._store.flush()
        self._tiers[level].quota = quota
        return True

    def _longest_cache(self) -> int:
        """Tokens of the longest cache (``MAX_BLOCKS_PER_CACHE`` blocks): the search bound of the length answers,
        so a larger one (2**64) never reaches the 64-bit ``KVCacheDesc`` the planner prices."""
        return MAX_BLOCKS_PER_CACHE * self.tokens_per_block

    def clamp_max_seq_len_for_mem(self, batch_size: SupportsIndex, token_num_upper_bound: SupportsIndex) -> int:
        """Largest ``L <= token_num_upper_bound`` such that ``batch_size`` caches of capacity ``L`` and history
        ``L - 1`` fit in the GPU tier at once (as the manager would allocate them, a hybrid's SSM live states within
        what their resumes may lock under ``max_util_for_resume``); 0 if none fits, and
        ``last_refusal`` then says why ``batch_size`` caches of one token do not (as ``can_fit`` records, between
        calls only).

        With sliding windows, pages are not monotonic in ``L``: a shorter length may need one page more per window
        (window 20, tpb 16, 2 slots: 200 fits, 33 does not), and a sequence growing to ``L`` passes through it.
        The answer comes from the slots the GPU quota holds; nothing is reserved for a length no ``constraints``
        entry declares (TensorRT-LLM raises the quota for a worst-case window), so declare the longest request there
        to have the tier sized for it."""
        self._check_alive()
        size = as_int(batch_size, "batch_size")
        bound = as_non_negative_int(token_num_upper_bound, "token_num_upper_bound")
        if size <= 0:
            raise ValueError(f"batch_size must be > 0, got {size}")
        bound = min(bound, self._longest_cache())  # a longer cache is refused by resize anyway
        counts = [pool_group.num_slots for pool_group in self._tiers[0].pool_groups]
        call, tier = "KVCacheManager.clamp_max_seq_len_for_mem", self._tiers[GPU_LEVEL].tier
        admission = self._admission_shortfall(counts, size)
        if admission is not None and bound > 0:  # their resumes lock a live state each: not all can run at once
            group, states = admission
            util = self._config.admission_util
            limit = int(util * counts[group])
            detail = (
                f"resuming {counted(size, 'cache')} locks {counted(states, 'SSM live state')} in pool group {group}; "
                f"admissions may lock at most {limit} of its {counted(counts[group], 'slot')} ({util}: max_util_for_resume less admission_watermark): "
                f"admit fewer at once, raise max_util_for_resume"
            )
            detail += split_hint(len(counts)) if len(counts) > 1 else " or give the GPU tier more memory"
            self._record_fit_refusal(Refusal(
                call, tier, GPU_LEVEL, group, states, counts[group], counts[group], False, detail,
            ))
            return 0
        longest = self._planner.clamp_max_seq_len(size, bound, counts)
        short = step_shortfall(self._planner, counts, 1, 1, size) if longest == 0 and bound > 0 else None
        if short is not None:  # one token each is the least the batch can ask: it is what does not fit
            group, pages = short
            detail = (
                f"admitting {counted(size, 'cache')} of one token needs {counted(pages, 'GPU page')} in pool group "
                f"{group}; it has {counted(counts[group], 'slot')}"
            )
            detail += split_hint(len(counts)) if len(counts) > 1 else ": admit fewer at once or give the GPU tier more memory"
            self._record_fit_refusal(Refusal(
                call, tier, GPU_LEVEL, group, pages, counts[group], counts[group], False, detail,
            ))
        return longest

    def can_fit(self, num_tokens: SupportsIndex, chunk_size: SupportsIndex = 1) -> bool:
        """Whether one request of ``num_tokens`` tokens whose last step computes ``chunk_size`` of them at once
        (capacity ``num_tokens``, history ``num_tokens - chunk_size``) fits the GPU tier of an otherwise empty
        manager (False: its first ``resume``, or that step, would be refused however long it waits; ``last_refusal``
        then says why: the pool group short, the pages the step needs there against its slots). A window's
        pages are not monotone in the length: an earlier chunk may need more, a shorter last chunk fewer, so for a
        computation in chunks ask ``can_fit_in_chunks`` (or ``can_fit(end, end - start)`` of each chunk: all True,
        every step fits, which is what ``resize`` then finds). Asked from a priority callback inside another call it
        answers but records nothing (``last_refusal`` is that call's). Admission (resume, batch) is bounded by
        ``max_util_for_resume`` (a new cache's resume locks its SSM live states, which this counts): admit the
        first chunk, then ``resize`` up to the rest."""
        tokens, chunk = self._request_shape(num_tokens, chunk_size)
        refusal = self._fit_refusal("KVCacheManager.can_fit", tokens, chunk, False)
        self._record_fit_refusal(refusal)
        return refusal is None

    def can_fit_in_chunks(self, num_tokens: SupportsIndex, chunk_size: SupportsIndex) -> bool:
        """Whether one request of ``num_tokens`` tokens computed from its first token in chunks of ``chunk_size``
        (the last one shorter) fits the GPU tier of an otherwise empty manager at every step: the answer
        ``can_fit(end, end - start)`` of every chunk would give together, found from a few steps (those of the last
        ``lcm(chunk_size, tokens_per_block)`` tokens where a page count can change, and the last one), so it is
        cheap for any length, window or chunk. False: ``last_refusal`` names the first step that does not fit (in
        its sentence), the pool group short there and the pages it needs against the slots. Admit the first chunk
        (``resume``), then ``resize`` to each next one. A request reusing a prefix starts its chunks where the reuse ends, not at 0:
        ask ``can_fit(end, end - start)`` of those steps, or end its chunks at multiples of ``chunk_size`` (steps
        this call counted)."""
        tokens, chunk = self._request_shape(num_tokens, chunk_size)
        refusal = self._fit_refusal("KVCacheManager.can_fit_in_chunks", tokens, chunk, True)
        self._record_fit_refusal(refusal)
        return refusal is None

    def peak_pages(self, num_tokens: SupportsIndex, chunk_size: SupportsIndex = 1) -> list[int]:
        """Per GPU pool group, the most pages one request of ``num_tokens`` tokens holds at any step computing at
        most ``chunk_size`` tokens, wherever it starts (its live SSM state included, scratch reuse as configured):
        what a guaranteed-no-evict admission (TensorRT-LLM's ``GUARANTEED_NO_EVICT`` policy, which asks
        ``get_remaining_blocks_to_completion`` per window size) reserves for a request until it finishes. A prompt
        prefilled in chunks of at most ``chunk_size`` (from its first token, a reused prefix or a snapshot point)
        and decoded a token and its drafts at a time stays within it where ``chunk_size`` is at least one more than
        the drafts; a reused prefix only shares pages. With a window it can exceed the most a computation in chunks
        from the first token holds by a page: a chunk starting elsewhere in a block may span one more. Admitting while the sums over the open requests stay within
        ``config.admission_util`` (``max_util_for_resume`` less the ``admission_watermark`` share) of each pool
        group's GPU slots (``get_storage_statistics(0)[group].total``), none of them suspended, none of their
        ``resume``/``resize`` calls is refused. A read: it changes nothing and
        records no refusal."""
        tokens, chunk = self._request_shape(num_tokens, chunk_size)
        tokens = min(tokens, MAX_BLOCKS_PER_CACHE * self.tokens_per_block)  # resize refuses anything longer
        return peak_request_pages(self._planner, tokens, chunk)

    def _record_fit_refusal(self, refusal: Refusal | None) -> None:
        """Keep a fit query's refusal in ``last_refusal``, except from inside another call (a priority callback):
        the queries stay answerable there, but ``last_refusal`` then belongs to the call in flight."""
        if refusal is not None and not self._guard.current:
            self._services.note_refusal(refusal)

    def _fit_refusal(self, call: str, tokens: int, chunk: int, chunked: bool) -> Refusal | None:
        """Why a request of ``tokens`` (its last step, or every step in chunks of ``chunk`` when ``chunked``)
        cannot fit an otherwise empty manager, or None when it fits: the cache's block limit, a new cache's SSM
        live states over the admission limit, or the first step needing more pages of a pool group than it has."""
        tier = self._tiers[GPU_LEVEL]
        counts = self._gpu_slot_counts()
        block_limit = MAX_BLOCKS_PER_CACHE * self.tokens_per_block
        if tokens > block_limit:  # resize refuses it whatever the pages
            detail = (
                f"{tokens} tokens span more than {MAX_BLOCKS_PER_CACHE} blocks ({block_limit} tokens), the most a cache "
                f"may span: shorten the request"
            )
            return Refusal(call, tier.tier, GPU_LEVEL, 0, 0, counts[0], counts[0], False, detail)
        util = self._config.admission_util
        admission = self._admission_shortfall(counts)
        if admission is not None:
            group, states = admission
            limit = int(util * counts[group])
            detail = (
                f"a new cache's resume locks {counted(states, 'SSM live state')} in pool group {group}; an admission may "
                f"lock at most {limit} of its {counted(counts[group], 'slot')} ({util}: max_util_for_resume less admission_watermark): "
                f"give the GPU tier more memory, raise max_util_for_resume or declare typical_step"
            )
            return Refusal(call, tier.tier, GPU_LEVEL, group, states, counts[group], counts[group], False, detail)
        if chunked:
            found = chunked_shortfall(self._planner, counts, tokens, chunk)
            if found is None:
                return None
            end, computed, group, pages = found
        else:
            step = step_shortfall(self._planner, counts, tokens, chunk)
            if step is None:
                return None
            (group, pages), end, computed = step, tokens, chunk
        detail = (
            f"the step ending at token {end} computing {counted(computed, 'token')} needs {counted(pages, 'GPU page')} in "
            f"pool group {group}; it has {counted(counts[group], 'slot')}"
        )
        if len(counts) > 1:
            detail += split_hint(len(counts))
        else:
            detail += ": shorten the request, compute it in smaller chunks, or give the GPU tier more memory"
        return Refusal(call, tier.tier, GPU_LEVEL, group, pages, counts[group], counts[group], False, detail)

    def _request_shape(self, num_tokens: SupportsIndex, chunk_size: SupportsIndex) -> tuple[int, int]:
        """The checked (tokens, chunk) of a ``can_fit`` question; the manager must still be open."""
        self._check_alive()
        tokens = as_int(num_tokens, "num_tokens")
        chunk = as_int(chunk_size, "chunk_size")
        if tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {tokens}")
        if chunk <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk}")
        return tokens, chunk

    def _admission_shortfall(self, counts: list[int], num_caches: int = 1) -> tuple[int, int] | None:
        """``admission_shortfall`` of ``num_caches`` new caches on the GPU tier's ``counts``: (pool group, SSM
        states) or None."""
        return admission_shortfall(
            self._registry.life_cycles, self._layout.life_cycle_pool_group, counts, self._config.admission_util,
            num_caches,
        )

    def max_admissible(self, chunk_size: SupportsIndex = 1, token_num_upper_bound: SupportsIndex | None = None) -> int:
        """The longest request (tokens, at most ``token_num_upper_bound``, default the per-cache block limit)
        computed from its first token in chunks of ``chunk_size`` that fits an otherwise empty manager at every
        step (``can_fit_in_chunks``), such that every shorter one fits too: a scheduler's cap on prompt plus output
        length. 0 when not even one token does; ``last_refusal`` then says why the one-token request does not fit
        (as ``can_fit_in_chunks`` would, between calls only), so a scheduler capped at 0 can tell its user. A
        request that reuses a prefix starts its chunks where the reuse ends, so its steps differ: with sliding
        windows ask ``can_fit(end, end - start)`` of such steps."""
        self._check_alive()
        chunk = as_int(chunk_size, "chunk_size")
        if chunk <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk}")
        bound = self._longest_cache()
        if token_num_upper_bound is not None:
            given = as_int(token_num_upper_bound, "token_num_upper_bound")
            if given < 0:
                raise ValueError(f"token_num_upper_bound must be >= 0, got {given}")
            bound = min(bound, given)
        if self._admission_shortfall(self._gpu_slot_counts()) is not None:
            longest = 0
        else:
            longest = largest_chunked_request(self._planner, self._gpu_slot_counts(), chunk, bound)
        if longest == 0 and bound > 0:
            self._record_fit_refusal(self._fit_refusal("KVCacheManager.max_admissible", 1, chunk, True))
        return longest

    @property
    def need_adjustment(self) -> bool:
        """Whether the lengths of recently closed requests call for another split of the GPU tier."""
        self._check_alive()
        self._guard.settle()
        gates = self._planner.rebalance
        if gates.cooling_down():
            return False
        demand = self._planner.rebalance_demand(self._caches.observed)
        if demand is None:
            return False
        ideal = self._planner.split(self._tiers[0].quota, demand, self._planner.floors)
        current = [pool_group.num_slots for pool_group in self._tiers[0].pool_groups]
        return ideal is not None and gates.departs(current, ideal)

    def adjust(self) -> bool:
        """Re-split every tier across pool groups for the observed request mix (every cache suspended).

        Bases never move (a pool group grows at most to its reservation) and held pages are never lost: a tier
        whose held pages would not fit keeps its split and the call returns False (``last_refusal`` names the tier
        and pool group). False too, changing nothing, until enough closed caches were observed (their lengths are
        what the split follows; ``need_adjustment`` says when there is a split to make): ``last_refusal`` says so,
        needing no page.
        """
        self._check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.adjust")
        try:
            for cache in self._caches.live.values():
                if cache.is_active:
                    raise ValueError(f"adjust needs every cache suspended; cache {cache.id} is active")
            demand = self._planner.rebalance_demand(self._caches.observed)
            if demand is None:  # said, so that an older refusal is not read as this False's reason
                slots = self._tiers[0].pool_groups[0].num_slots
                detail = (
                    "no split to make yet: too few closed caches observed to follow their mix (need_adjustment "
                    "says when there is one)"
                )
                self._services.note_refusal(Refusal(
                    "KVCacheManager.adjust", self._tiers[0].tier, GPU_LEVEL, 0, 0, slots, slots, True, detail
                ))
                return False
            refusal: Refusal | None = None
            for level, tier in enumerate(self._tiers):
                counts = self._tier_split(level, tier.quota, demand)
                if counts is not None:
                    counts = [min(count, pool_group.max_slots) for count, pool_group in zip(counts, tier.pool_groups)]
                usable = counts is not None and (level != GPU_LEVEL or self._gpu_split_usable(counts))
                if counts is None or not usable or not self._store.resize_slots(level, counts):
                    refusal = refusal or self._quota_refusal("KVCacheManager.adjust", level, tier.quota, counts)
            complete = refusal is None
            if refusal is not None:
                self._services.note_refusal(refusal)
            self._store.flush()
            if complete:
                self._planner.rebalance.last_adjustment = self._planner.rebalance.clock()
                self._planner.demand = demand
                self._planner.target_ratio = None
            self._services.after_call()
            return complete
        finally:
            guard.leave()
