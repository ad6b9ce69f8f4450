"""Prefill -> decode KV handoff: what is sent, what the receiver lacks, and the copies.

The prefill side holds a prompt's KV in a cache of one manager; the decode side wants it in a cache of another
manager with the same layer layout and ``tokens_per_block`` (quotas and tiers may differ). The protocol:

1. Decode side (receiver), in this order: ``create_kv_cache`` (its own prefix match) -> ``resume`` ->
   ``resize(prompt_len, prompt_len)`` (history preset, so stale SWA blocks never get pages) ->
   ``cached_tokens_per_layer_group(cache, prompt_len)``: per layer group, how much it already holds.
   ``prepare_receiver`` does exactly these four calls.
2. Prefill side (sender): ``plan_transfer(...)`` turns a ``KVSlice`` (which tokens are sent; by default the whole
   prompt, independent of the receiver's cache) and those counts into a ``TransferPlan``: flat, picklable
   descriptors (slots, bytes, absolute addresses) per pool, ready for an RDMA engine; ``execute(plan)`` performs
   them locally, one batched gather/scatter per pool.
3. Decode continues (the receiver may commit the prompt so its blocks become reusable there).

Both caches address blocks by ordinal from block 0 (full page tables), so the sender's own reused prefix never
shifts anything: block ``b`` of the sender goes to block ``b`` of the receiver. The receiver never supplies a
token offset; the sender derives where to start from the counts and the block-list sizes (``align_block_lists``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, SupportsIndex

from ._hashing import ReuseScope, TokenSequence
from ._cache_handle import KVCache
from ._kv_cache import KVCacheStatus
from ._life_cycle import LifeCycle, ceil_div
from ._manager import KVCacheManager
from ._memory import copy_rows
from ._types import BAD_PAGE_INDEX, HalfOpenRange
from ._validation import as_index, as_int
from .config import AttentionLayerConfig, LayerConfig

# --------------------------------------------------------------------------------------------------- what is sent


class KVSlice:
    """What the prefill side sends: the tokens ``token_range`` of a prompt of ``prompt_len`` tokens.

    ``token_range`` defaults to the whole prompt ``[0, prompt_len)``. It is independent of how much the receiver
    already holds (the seed decouples the two): what the receiver has cached is skipped by ``plan_transfer`` from
    the receiver's per-layer-group counts, never by shrinking the range. A prompt may be sent as several slices
    whose ranges start on block boundaries; only the slice that ends at ``prompt_len`` carries SSM states.
    """

    def __init__(self, prompt_len: SupportsIndex, token_range: HalfOpenRange | None = None) -> None:
        length = as_int(prompt_len, "prompt_len")
        if length < 0:
            raise ValueError(f"prompt_len must be >= 0, got {length}")
        if token_range is None:
            token_range = HalfOpenRange(0, length)
        elif not isinstance(token_range, HalfOpenRange):
            raise TypeError(f"token_range must be a HalfOpenRange or None, got {token_range!r}")
        beg = as_int(token_range.beg, "token_range.beg")
        end = as_int(token_range.end, "token_range.end")
        if not 0 <= beg <= end <= length:
            raise ValueError(f"token_range [{beg}, {end}) must lie within the prompt [0, {length})")
        self._prompt_len = length
        self._token_range = HalfOpenRange(beg, end)

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def token_range(self) -> HalfOpenRange:
        return self._token_range

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KVSlice)
            and other._prompt_len == self._prompt_len
            and other._token_range == self._token_range
        )

    def __hash__(self) -> int:
        return hash((self._prompt_len, self._token_range.beg, self._token_range.end))

    def __repr__(self) -> str:
        return f"KVSlice(prompt_len={self._prompt_len}, token_range=[{self._token_range.beg}, {self._token_range.end}))"

    def __reduce__(self) -> tuple[type[KVSlice], tuple[int, HalfOpenRange]]:
        return (KVSlice, (self._prompt_len, self._token_range))


# ------------------------------------------------------------------------------------------- per layer-group kind


class _GroupRule:
    """How one layer group (life cycle) takes part in a handoff; one subclass per kind."""

    def __init__(self, life_cycle: LifeCycle) -> None:
        self.life_cycle = life_cycle
        self.tokens_per_block = life_cycle.tokens_per_block

    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        """The receiver's count for this group, given its reused prefix of ``reused`` tokens."""
        raise NotImplementedError

    def needs_block(self, ordinal: int, prompt_len: int) -> bool:
        """Whether the decode step at history ``prompt_len`` reads block ``ordinal`` of this group."""
        raise NotImplementedError


class _AttentionRule(_GroupRule):
    """Full and windowed attention: the needed blocks at ``prompt_len`` are all blocks but the stale range.

    Full attention has no stale range; a window of ``W`` tokens with ``S`` sink blocks needs the sinks and
    the blocks from ``(prompt_len + 1 - W) // tpb`` on (the stale range at history ``prompt_len``).
    """

    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        tpb = self.tokens_per_block
        first = reused // tpb  # the receiver holds every needed block below its reused prefix (block aligned)
        stale_beg, stale_end = self.life_cycle.stale(prompt_len)
        if stale_beg <= first < stale_end:
            first = stale_end  # skip the gap of blocks nobody needs: only in-window blocks are requested
        return prompt_len if first >= ceil_div(prompt_len, tpb) else first * tpb

    def needs_block(self, ordinal: int, prompt_len: int) -> bool:
        stale_beg, stale_end = self.life_cycle.stale(prompt_len)
        return not stale_beg <= ordinal < stale_end


class _SsmRule(_GroupRule):
    """SSM: one live state per cache; the receiver's equals the prompt's only after a whole-prompt reuse."""

    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        # A reused prefix ends on a state snapshot that resume copied into the live state; it is the state
        # after the prompt only when the reuse is the whole (block-aligned) prompt.
        if reused == prompt_len and prompt_len % self.tokens_per_block == 0:
            return prompt_len
        return 0

    def needs_block(self, ordinal: int, prompt_len: int) -> bool:
        return False


def _rule_of(life_cycle: LifeCycle) -> _GroupRule:
    if life_cycle.is_ssm:
        return _SsmRule(life_cycle)
    return _AttentionRule(life_cycle)


# ----------------------------------------------------------------------------------------------- receiver side


def cached_tokens_per_layer_group(cache: KVCache, prompt_len: SupportsIndex) -> list[int]:
    """Per layer group (indexed by ``LayerGroupId``), how many leading prompt tokens the receiver needs no data for.

    Call it on the decode-side cache after ``resize(prompt_len, prompt_len)``. ``r`` is the cache's reused
    prefix, ``num_committed_tokens`` rounded down to a block. Every count is a multiple of ``tokens_per_block``
    or equals ``prompt_len`` (nothing requested). The sender moves, for each group, the blocks it needs at
    history ``prompt_len`` from block ``count // tpb`` on (``plan_transfer``). Per kind:

    - full attention: ``r`` — the receiver holds blocks ``[0, r / tpb)``; every later block is requested.
    - sliding window (``W`` tokens, ``S`` sink blocks): the first needed block the receiver lacks, times ``tpb``.
      Needed at ``prompt_len`` = the sinks plus blocks from ``e = (prompt_len + 1 - W) // tpb`` on. When
      ``r / tpb`` falls in the unneeded gap ``[S, e)`` the count is clamped up to ``e * tpb``, so only in-window
      blocks are requested; a receiver still missing sink blocks reports ``r`` (the missing sinks move too).
    - SSM: ``prompt_len`` when the receiver's live state already is the state after the prompt (its reuse is the
      whole block-aligned prompt: the snapshot there was copied into the live slot on resume), else 0 (the
      sender's live state is sent).
    Whatever the kind, a receiver holding everything reports ``prompt_len``.

    Worked example (tpb 32, prompt_len 1000, so blocks 0..31; the receiver reused 300 tokens, r = 288):
    full attention -> 288 (blocks 9..31 requested); window 128 without sinks -> e = 873 // 32 = 27, 9 is in the
    gap [0, 27) -> 864 (blocks 27..31 only); window 128 with 10 sink tokens -> sink block 0 is held, 9 is in
    [1, 27) -> 864; the same window with no reuse (r = 0) -> 0 (sink block 0 plus blocks 27..31); SSM -> 0.
    A receiver whose reuse is the whole block-aligned prompt (prompt_len 288, 288 reused) reports 288 for every
    group, SSM included, and nothing moves.
    """
    length = as_int(prompt_len, "prompt_len")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {cache!r}")
    if cache.status == KVCacheStatus.CLOSED:
        raise ValueError(f"cache {cache.id} is closed")
    if length < 0:
        raise ValueError(f"prompt_len must be >= 0, got {length}")
    reused = cache.num_committed_tokens
    if reused > length:
        raise ValueError(f"cache {cache.id} holds {reused} committed tokens, more than prompt_len {length}")
    return [_rule_of(life_cycle).cached_tokens(reused, length) for life_cycle in cache.manager._services.life_cycles]


def prepare_receiver(
    manager: KVCacheManager,
    input_tokens: TokenSequence,
    reuse_scope: ReuseScope | None = None,
    cuda_stream: SupportsIndex | None = None,
) -> tuple[KVCache, list[int]] | None:
    """The decode side's steps of the handoff, in order, for a prompt of ``len(input_tokens)`` tokens:

    ``create_kv_cache`` (own prefix match) -> ``resume`` -> ``resize(prompt_len, prompt_len)`` ->
    ``cached_tokens_per_layer_group``. Returns the ACTIVE cache and the counts to send to the prefill side, or
    None (the cache closed, nothing held) when GPU memory is short.
    """
    tokens = list(input_tokens)
    prompt_len = len(tokens)
    cache = manager.create_kv_cache(reuse_scope, tokens)
    if not cache.resume(cuda_stream) or not cache.resize(prompt_len, prompt_len):
        cache.close()
        return None
    return cache, cached_tokens_per_layer_group(cache, prompt_len)


# ------------------------------------------------------------------------------------------------ plan records


@dataclass(frozen=True)
class TransferDescriptor:
    """One slot copy of one pool: ``num_bytes`` from ``src_address`` to ``dst_address`` (plain ints).

    ``block`` is the block ordinal moved (the same in both caches), or -1 for an SSM live state. The addresses are
    ``pool base + slot * num_bytes`` of each side's GPU tier.
    """

    layer_group: int
    block: int
    pool_group: int
    pool: int
    src_slot: int
    dst_slot: int
    num_bytes: int
    src_address: int
    dst_address: int

    def __reduce__(self) -> tuple[type[TransferDescriptor], tuple[int, int, int, int, int, int, int, int, int]]:
        return (
            TransferDescriptor,
            (
                self.layer_group,
                self.block,
                self.pool_group,
                self.pool,
                self.src_slot,
                self.dst_slot,
                self.num_bytes,
                self.src_address,
                self.dst_address,
            ),
        )


@dataclass(frozen=True)
class GroupTransfer:
    """What one layer group moves.

    ``cached_tokens``: the receiver's count. ``src_start_block`` / ``dst_start_block``: first block ordinal read
    from the sender / written at the receiver (equal: both tables start at block 0, whatever the sender reused),
    ``end_block``: one past the slice's last block. Attention moves the needed blocks of ``[start, end)``;
    ``num_blocks`` counts them (for SSM: 1 when the live state moves, else 0; starts and end are then 0).
    """

    layer_group: int
    kind: str
    cached_tokens: int
    src_start_block: int
    dst_start_block: int
    end_block: int
    num_blocks: int
    num_bytes: int

    def __reduce__(self) -> tuple[type[GroupTransfer], tuple[int, str, int, int, int, int, int, int]]:
        return (
            GroupTransfer,
            (
                self.layer_group,
                self.kind,
                self.cached_tokens,
                self.src_start_block,
                self.dst_start_block,
                self.end_block,
                self.num_blocks,
                self.num_bytes,
            ),
        )


class _Endpoints:
    """The live objects a plan was made from, for a local ``execute`` (never pickled)."""

    def __init__(self, src_manager: KVCacheManager, src_cache: KVCache, dst_manager: KVCacheManager, dst_cache: KVCache) -> None:
        self.src_manager = src_manager
        self.src_cache = src_cache
        self.dst_manager = dst_manager
        self.dst_cache = dst_cache


class TransferPlan:
    """Flat copy descriptors of one ``KVSlice`` from a prefill cache to a decode cache, with per-group summaries.

    Plain data (ints, strs, tuples, frozen dataclasses): it pickles, so a transport can carry it between machines.
    A plan made in this process also remembers its caches so ``execute`` can run it here; an unpickled copy
    cannot be executed locally.
    """

    def __init__(
        self,
        kv_slice: KVSlice,
        tokens_per_block: int,
        groups: tuple[GroupTransfer, ...],
        descriptors: tuple[TransferDescriptor, ...],
    ) -> None:
        self._kv_slice = kv_slice
        self._tokens_per_block = tokens_per_block
        self._groups = groups
        self._descriptors = descriptors
        self._endpoints: _Endpoints | None = None

    @property
    def kv_slice(self) -> KVSlice:
        return self._kv_slice

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def groups(self) -> tuple[GroupTransfer, ...]:
        """One summary per layer group, indexed by ``LayerGroupId``."""
        return self._groups

    @property
    def descriptors(self) -> tuple[TransferDescriptor, ...]:
        """Every slot copy, grouped by layer group, then block, then pool."""
        return self._descriptors

    @property
    def num_descriptors(self) -> int:
        return len(self._descriptors)

    @property
    def total_bytes(self) -> int:
        total = 0
        for descriptor in self._descriptors:
            total += descriptor.num_bytes
        return total

    @property
    def blocks_per_layer_group(self) -> list[int]:
        """Blocks moved per layer group (an SSM group counts its live state as one)."""
        return [group.num_blocks for group in self._groups]

    @property
    def bytes_per_layer_group(self) -> list[int]:
        return [group.num_bytes for group in self._groups]

    @property
    def is_local(self) -> bool:
        """Whether ``execute`` can run this plan here (it was planned in this process, not unpickled)."""
        return self._endpoints is not None

    def descriptors_of(self, layer_group: SupportsIndex) -> list[TransferDescriptor]:
        value = as_index(layer_group, "layer_group", len(self._groups))
        return [descriptor for descriptor in self._descriptors if descriptor.layer_group == value]

    def __repr__(self) -> str:
        return (
            f"TransferPlan({self._kv_slice!r}, blocks_per_layer_group={self.blocks_per_layer_group}, "
            f"num_descriptors={len(self._descriptors)}, total_bytes={self.total_bytes})"
        )

    def __reduce__(
        self,
    ) -> tuple[
        type[TransferPlan], tuple[KVSlice, int, tuple[GroupTransfer, ...], tuple[TransferDescriptor, ...]]
    ]:
        return (TransferPlan, (self._kv_slice, self._tokens_per_block, self._groups, self._descriptors))


# ------------------------------------------------------------------------------------------------- sender side


def align_block_lists(num_src_blocks: int, num_dst_blocks: int) -> tuple[int, int, int]:
    """Sender-side block alignment (seed 001): two block lists that end at the same block are aligned by their
    tails. Returns ``(src_skip, dst_skip, count)``: skip that many leading entries of each list, then pair
    ``count`` entries one to one.

    The sender's list covers the slice ``[token_range.beg, token_range.end)``; the receiver's covers the blocks it
    lacks up to the same end. Examples: sender 10 blocks (slice from block 0), receiver 4 (it holds 6) -> (6, 0, 4);
    a slice from block 8 of 10 (2 blocks) while the receiver lacks 5 -> (0, 3, 2); receiver lacks none ->
    (10, 0, 0).
    """
    count = min(num_src_blocks, num_dst_blocks)
    return num_src_blocks - count, num_dst_blocks - count, count


def check_same_layout(src_manager: KVCacheManager, dst_manager: KVCacheManager) -> None:
    """ValueError naming the first difference between the two managers' layer layouts or ``tokens_per_block``."""
    if not isinstance(src_manager, KVCacheManager) or not isinstance(dst_manager, KVCacheManager):
        raise TypeError("src_manager and dst_manager must be KVCacheManager instances")
    src_tpb = src_manager.tokens_per_block
    dst_tpb = dst_manager.tokens_per_block
    if src_tpb != dst_tpb:
        raise ValueError(f"tokens_per_block differs: {src_tpb} on the sender, {dst_tpb} on the receiver")
    src_layers = list(src_manager.config.layers)
    dst_layers = list(dst_manager.config.layers)
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"number of layers differs: {len(src_layers)} on the sender, {len(dst_layers)} on the receiver")
    for position in range(len(src_layers)):
        _check_same_layer(position, src_layers[position], dst_layers[position])
    if src_manager.layer_grouping != dst_manager.layer_grouping:
        raise ValueError(
            f"layer groups differ: {src_manager.layer_grouping} on the sender, {dst_manager.layer_grouping} on the receiver"
        )
    for pool_group in range(src_manager.num_pool_groups):
        src_bytes = src_manager.get_slot_bytes(pool_group)
        dst_bytes = dst_manager.get_slot_bytes(pool_group)
        if src_bytes != dst_bytes:
            raise ValueError(f"pool group {pool_group} slot bytes differ: {src_bytes} on the sender, {dst_bytes} on the receiver")


def _check_same_layer(position: int, src: LayerConfig, dst: LayerConfig) -> None:
    if src.layer_id != dst.layer_id:
        raise ValueError(f"layer at position {position}: layer_id {src.layer_id} on the sender, {dst.layer_id} on the receiver")
    layer = src.layer_id
    src_kind = type(src).__name__
    dst_kind = type(dst).__name__
    if src_kind != dst_kind:
        raise ValueError(f"layer {layer}: {src_kind} on the sender, {dst_kind} on the receiver")
    if isinstance(src, AttentionLayerConfig) and isinstance(dst, AttentionLayerConfig):
        if src.sliding_window_size != dst.sliding_window_size:
            raise ValueError(
                f"layer {layer}: sliding_window_size {src.sliding_window_size} on the sender, "
                f"{dst.sliding_window_size} on the receiver"
            )
        if (src.num_sink_tokens or 0) != (dst.num_sink_tokens or 0):
            raise ValueError(
                f"layer {layer}: num_sink_tokens {src.num_sink_tokens} on the sender, {dst.num_sink_tokens} on the receiver"
            )
    src_roles = [buffer.role for buffer in src.buffers]
    dst_roles = [buffer.role for buffer in dst.buffers]
    if src_roles != dst_roles:
        raise ValueError(f"layer {layer}: buffer roles {src_roles} on the sender, {dst_roles} on the receiver")
    for src_buffer, dst_buffer in zip(src.buffers, dst.buffers):
        if src_buffer.size != dst_buffer.size:
            raise ValueError(
                f"layer {layer} buffer {src_buffer.role!r}: size {src_buffer.size} on the sender, "
                f"{dst_buffer.size} on the receiver"
            )
        if src_buffer.tokens_per_block_override != dst_buffer.tokens_per_block_override:
            raise ValueError(
                f"layer {layer} buffer {src_buffer.role!r}: tokens_per_block_override "
                f"{src_buffer.tokens_per_block_override} on the sender, {dst_buffer.tokens_per_block_override} "
                "on the receiver"
            )


def _check_cache(manager: KVCacheManager, cache: object, name: str) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be a KVCache, got {cache!r}")
    if cache.manager is not manager:
        raise ValueError(f"{name} (cache {cache.id}) does not belong to the given manager")
    if not cache.is_active:
        raise ValueError(f"{name} (cache {cache.id}) must be active, it is {cache.status.name}")
    return cache


def plan_transfer(
    src_manager: KVCacheManager,
    src_cache: KVCache,
    dst_manager: KVCacheManager,
    dst_cache: KVCache,
    kv_slice: KVSlice,
    cached_per_group: Sequence[SupportsIndex],
) -> TransferPlan:
    """The copies that bring ``kv_slice`` of ``src_cache`` (prefill side) into ``dst_cache`` (decode side).

    ``cached_per_group``: the receiver's ``cached_tokens_per_layer_group`` (each a multiple of ``tokens_per_block``
    or ``prompt_len``). Per attention group, with ``n = ceil(token_range.end / tpb)``: the sender's block list is
    the slice's blocks ``[token_range.beg / tpb, n)``, the receiver's is ``[count / tpb, n)``; aligned by their tails
    (``align_block_lists``) they give the start block, and the blocks needed at history ``prompt_len`` from there to
    ``n`` move (for a window: only sinks and in-window blocks). An SSM group moves the sender's live state into
    the receiver's when the receiver's count is below ``prompt_len`` and the slice ends at ``prompt_len``.

    Requirements (ValueError otherwise, naming what is wrong): same layer layout and ``tokens_per_block`` on both
    managers; both caches active and owned by their managers; the receiver at ``history_length == prompt_len``;
    the sender at capacity >= ``token_range.end`` with a GPU page for every block sent; no destination page is a
    committed (shared, reused) page of the receiver.
    """
    check_same_layout(src_manager, dst_manager)
    src = _check_cache(src_manager, src_cache, "src_cache")
    dst = _check_cache(dst_manager, dst_cache, "dst_cache")
    if src is dst:
        raise ValueError("src_cache and dst_cache are the same cache")
    if not isinstance(kv_slice, KVSlice):
        raise TypeError(f"kv_slice must be a KVSlice, got {kv_slice!r}")
    tpb = src_manager.tokens_per_block
    prompt_len = kv_slice.prompt_len
    slice_beg = kv_slice.token_range.beg
    slice_end = kv_slice.token_range.end
    if slice_beg % tpb != 0:
        raise ValueError(f"token_range.beg {slice_beg} is not a multiple of tokens_per_block {tpb}")
    if slice_end % tpb != 0 and slice_end != prompt_len:
        raise ValueError(f"token_range.end {slice_end} is neither a multiple of tokens_per_block {tpb} nor prompt_len {prompt_len}")
    if dst.history_length != prompt_len:
        raise ValueError(
            f"dst_cache (cache {dst.id}) has history_length {dst.history_length}, not prompt_len {prompt_len}: call "
            f"resize({prompt_len}, {prompt_len}) before planning"
        )
    if src.capacity < slice_end:
        raise ValueError(f"src_cache (cache {src.id}) has capacity {src.capacity}, below token_range.end {slice_end}")
    life_cycles = src.manager._services.life_cycles
    counts = _check_counts(cached_per_group, len(life_cycles), prompt_len, tpb)
    beg_block = slice_beg // tpb
    end_block = ceil_div(slice_end, tpb)
    prompt_blocks = ceil_div(prompt_len, tpb)
    src_bases = _pool_bases(src_manager)
    dst_bases = _pool_bases(dst_manager)
    groups: list[GroupTransfer] = []
    descriptors: list[TransferDescriptor] = []
    for life_cycle in life_cycles:
        lg = int(life_cycle.id)
        pool_group = src_manager.get_pool_group_index(lg)
        slot_bytes = src_manager.get_slot_bytes(pool_group)
        count = counts[lg]
        first_before = len(descriptors)
        pairs: list[tuple[int, int, int]] = []  # (block, src slot, dst slot)
        start = 0
        end = 0
        if life_cycle.is_ssm:
            if count < prompt_len and slice_end == prompt_len:
                pairs.append((-1, src.get_ssm_block_base_index(lg), dst.get_ssm_block_base_index(lg)))
        else:
            rule = _rule_of(life_cycle)
            first_needed = prompt_blocks if count >= prompt_len else count // tpb
            dst_list_beg = min(first_needed, end_block)
            src_skip, dst_skip, _ = align_block_lists(end_block - beg_block, end_block - dst_list_beg)
            start = beg_block + src_skip
            assert start == dst_list_beg + dst_skip, "both tables are full from block 0"
            end = end_block
            src_table = src.get_base_page_indices(lg)
            dst_table = dst.get_base_page_indices(lg)
            dst_pages = dst._state._pages[lg]
            for ordinal in range(start, end):
                if not rule.needs_block(ordinal, prompt_len):
                    continue
                page = dst_pages[ordinal]
                if page is not None and page.block is not None:
                    raise ValueError(
                        f"cached_per_group[{lg}] = {count} would overwrite block {ordinal} of layer group {lg}, a "
                        f"reused (committed) page of dst_cache (cache {dst.id}); pass its cached_tokens_per_layer_group"
                    )
                pairs.append((ordinal, src_table[ordinal], dst_table[ordinal]))
        for block, src_slot, dst_slot in pairs:
            what = "the SSM live state" if block < 0 else f"block {block}"
            if src_slot == BAD_PAGE_INDEX:
                raise ValueError(
                    f"src_cache (cache {src.id}) has no GPU page for {what} of layer group {lg} "
                    f"({life_cycle.describe()}); the sender must hold the prompt's KV"
                )
            if dst_slot == BAD_PAGE_INDEX:
                raise ValueError(
                    f"dst_cache (cache {dst.id}) has no GPU page for {what} of layer group {lg} "
                    f"({life_cycle.describe()}); call resize({prompt_len}, {prompt_len}) before planning"
                )
            for pool, size in enumerate(slot_bytes):
                descriptors.append(
                    TransferDescriptor(
                        lg,
                        block,
                        pool_group,
                        pool,
                        src_slot,
                        dst_slot,
                        size,
                        src_bases[pool_group][pool] + src_slot * size,
                        dst_bases[pool_group][pool] + dst_slot * size,
                    )
                )
        group_bytes = 0
        for position in range(first_before, len(descriptors)):
            group_bytes += descriptors[position].num_bytes
        groups.append(GroupTransfer(lg, life_cycle.describe(), count, start, start, end, len(pairs), group_bytes))
    plan = TransferPlan(kv_slice, tpb, tuple(groups), tuple(descriptors))
    plan._endpoints = _Endpoints(src_manager, src, dst_manager, dst)
    return plan


def _check_counts(cached_per_group: Sequence[SupportsIndex], num_groups: int, prompt_len: int, tpb: int) -> list[int]:
    if isinstance(cached_per_group, (str, bytes)):
        raise TypeError("cached_per_group must be a sequence of ints")
    counts = [as_int(value, f"cached_per_group[{i}]") for i, value in enumerate(cached_per_group)]
    if len(counts) != num_groups:
        raise ValueError(f"cached_per_group has {len(counts)} entries, expected one per layer group ({num_groups})")
    for lg, count in enumerate(counts):
        if not 0 <= count <= prompt_len:
            raise ValueError(f"cached_per_group[{lg}] = {count} is outside [0, prompt_len {prompt_len}]")
        if count % tpb != 0 and count != prompt_len:
            raise ValueError(
                f"cached_per_group[{lg}] = {count} is neither a multiple of tokens_per_block {tpb} nor prompt_len"
            )
    return counts


def _pool_bases(manager: KVCacheManager) -> list[list[int]]:
    """GPU-tier base address of every pool, per pool group."""
    return [
        [int(manager.get_pool_base_address(pool_group, pool, 0)) for pool in range(len(manager.get_slot_bytes(pool_group)))]
        for pool_group in range(manager.num_pool_groups)
    ]


# --------------------------------------------------------------------------------------------------- execution


def execute(plan: TransferPlan, stream: SupportsIndex | None = None) -> None:
    """Perform a locally made plan: one batched gather/scatter per pool (``_memory.copy_rows``; the NumPy copy on
    the cpu backend, the page-copy kernel on cuda).

    ``stream`` is the engine's CUDA stream handle (validated). ``copy_rows`` takes no stream yet, so the copies are
    issued on the current stream, like the manager's own migrations. ValueError when the plan is not local
    (unpickled), a cache is no longer active, or a slot in the plan no longer matches the caches' tables (a
    suspend/resume in between may move pages: plan again).
    """
    if not isinstance(plan, TransferPlan):
        raise TypeError(f"plan must be a TransferPlan, got {plan!r}")
    if stream is not None and as_int(stream, "stream") < 0:
        raise ValueError(f"stream must be >= 0, got {as_int(stream, 'stream')}")
    endpoints = plan._endpoints
    if endpoints is None:
        raise ValueError("this TransferPlan has no local caches (it was unpickled): hand its descriptors to the transport")
    _check_still_current(plan, endpoints)
    src_groups = endpoints.src_manager._tiers[0].groups
    dst_groups = endpoints.dst_manager._tiers[0].groups
    runs: dict[tuple[int, int], tuple[list[int], list[int], int]] = {}
    for descriptor in plan.descriptors:
        key = (descriptor.pool_group, descriptor.pool)
        run = runs.get(key)
        if run is None:
            run = ([], [], descriptor.num_bytes)
            runs[key] = run
        run[0].append(descriptor.src_slot)
        run[1].append(descriptor.dst_slot)
    for key, (src_rows, dst_rows, row_bytes) in runs.items():
        pool_group, pool = key
        copy_rows(dst_groups[pool_group].pools[pool], dst_rows, src_groups[pool_group].pools[pool], src_rows, row_bytes)


def _check_still_current(plan: TransferPlan, endpoints: _Endpoints) -> None:
    src_manager = endpoints.src_manager
    dst_manager = endpoints.dst_manager
    src_manager._check_alive()
    dst_manager._check_alive()
    src = _check_cache(src_manager, endpoints.src_cache, "src_cache")
    dst = _check_cache(dst_manager, endpoints.dst_cache, "dst_cache")
    tables: dict[int, tuple[list[int], list[int]]] = {}
    for descriptor in plan.descriptors:
        lg = descriptor.layer_group
        if descriptor.block < 0:
            src_slot = src.get_ssm_block_base_index(lg)
            dst_slot = dst.get_ssm_block_base_index(lg)
        else:
            pair = tables.get(lg)
            if pair is None:
                pair = (list(src.get_base_page_indices(lg)), list(dst.get_base_page_indices(lg)))
                tables[lg] = pair
            src_slot = pair[0][descriptor.block] if descriptor.block < len(pair[0]) else BAD_PAGE_INDEX
            dst_slot = pair[1][descriptor.block] if descriptor.block < len(pair[1]) else BAD_PAGE_INDEX
        if src_slot != descriptor.src_slot or dst_slot != descriptor.dst_slot:
            raise ValueError(
                f"layer group {lg} block {descriptor.block} moved since planning (slots {descriptor.src_slot} -> "
                f"{descriptor.dst_slot} planned, now {src_slot} -> {dst_slot}); plan the transfer again"
            )
