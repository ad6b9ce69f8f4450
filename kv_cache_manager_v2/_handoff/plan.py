"""The two halves of a handoff plan (prefill to decode), each made where its cache lives: ``plan_source`` on the prefill
side (which blocks move and where they are there), ``complete_plan`` on the decode side (where they land), and the
checks of the prompt's rows. ``disagg.plan_transfer`` runs both halves in one process; ``nixl`` runs them in two
(the layouts both compare: ``same_layout``)."""

from __future__ import annotations

from typing import Sequence, SupportsIndex

from .._manager.manager import KVCache
from .._model.life_cycle import ceil_div
from .._manager.manager import KVCacheManager
from .._cache.group_state import GroupState
from .._cache.handle import state_of
from .._cache.kv_cache import CacheState, KVCacheStatus
from .transfer import GroupTransfer, KVSlice, PageStamps, SourceBlock, SourcePlan, TransferDescriptor, TransferPlan
from .._base.hashing import Token, block_key, root_key
from .._pages.page import Page
from .._base.types import BAD_PAGE_INDEX
from .._base.validation import as_int, as_non_negative_int
from .._base.wording import counted


def align_block_lists(num_src_blocks: SupportsIndex, num_dst_blocks: SupportsIndex) -> tuple[int, int, int]:
    """Sender-side block alignment (seed 001): two block lists that end at the same block are aligned by their
    tails. Returns ``(src_skip, dst_skip, count)``: skip that many leading entries of each list, then pair
    ``count`` entries one to one.

    The sender's list covers the slice ``[token_range.beg, token_range.end)``; the receiver's covers the blocks it
    lacks up to the same end. Examples: sender 10 blocks (slice from block 0), receiver 4 (it holds 6) -> (6, 0, 4);
    a slice from block 8 of 10 (2 blocks) while the receiver lacks 5 -> (0, 3, 2); receiver lacks none ->
    (10, 0, 0).
    """
    src = as_non_negative_int(num_src_blocks, "num_src_blocks")
    dst = as_non_negative_int(num_dst_blocks, "num_dst_blocks")
    count = min(src, dst)
    return src - count, dst - count, count


def blocks_moved(group: GroupState, count: int, kv_slice: KVSlice, tpb: int) -> tuple[int, int, list[int]]:
    """The blocks a handoff of ``kv_slice`` moves for one layer group whose receiver reported ``count``:
    ``(start, end, ordinals)``, the ordinals those of ``[start, end)`` read at history ``prompt_len`` (a window
    skips its stale blocks). An SSM group moves its live state (ordinal -1) when the receiver lacks it and the
    slice ends the prompt. Both halves of a plan ask this: the sender to choose, the receiver to check."""
    prompt_len = kv_slice.prompt_len
    slice_end = kv_slice.token_range.end
    if not group.sends_blocks:  # one live state, sent with the slice that ends the prompt
        return 0, 0, [-1] if count < prompt_len and slice_end == prompt_len else []
    beg_block = kv_slice.token_range.beg // tpb
    end_block = ceil_div(slice_end, tpb)
    first_needed = ceil_div(prompt_len, tpb) if count >= prompt_len else count // tpb
    dst_list_beg = min(first_needed, end_block)
    src_skip, dst_skip, _ = align_block_lists(end_block - beg_block, end_block - dst_list_beg)
    start = beg_block + src_skip
    assert start == dst_list_beg + dst_skip, "both tables are full from block 0"
    life_cycle = group.life_cycle
    return start, end_block, [ordinal for ordinal in range(start, end_block) if life_cycle.reads_block(ordinal, prompt_len)]


def check_cache(manager: KVCacheManager, cache: object, name: str) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be a KVCache, got {cache!r}")
    if cache.manager is not manager:
        raise ValueError(f"{name} (cache {cache.id}) does not belong to the given manager")
    if not cache.is_active:
        raise ValueError(f"{name} (cache {cache.id}) must be active, it is {cache.status.name}")
    return cache


def plan_source(
    src_manager: KVCacheManager, src_cache: KVCache, kv_slice: KVSlice, cached_per_group: Sequence[SupportsIndex]
) -> SourcePlan:
    """The sender's half of ``plan_transfer``, for a receiver in another process: which blocks of ``src_cache``
    move (the same rules, from the receiver's counts alone) and where they are in the sender's GPU tier.

    The plan carries ``prompt_key``, the key of the tokens ``src_cache``'s rows up to ``token_range.end`` are known
    to hold (committed, or given to ``create_kv_cache`` past them), in its reuse scope: ``complete_plan`` compares it.

    ValueError when the slice does not start on a block boundary or does not end on one or at ``prompt_len``, the
    counts are malformed, ``src_cache`` is below ``token_range.end``, not known to hold that many tokens or lacks a
    GPU page for a block sent, or an SSM live state is to be sent from a cache that spans more than the prompt (the
    state would be a later one).
    """
    src = check_cache(src_manager, src_cache, "src_cache")
    if not isinstance(kv_slice, KVSlice):
        raise TypeError(f"kv_slice must be a KVSlice, got {kv_slice!r}")
    tpb = src_manager.tokens_per_block
    prompt_len = kv_slice.prompt_len
    slice_end = kv_slice.token_range.end
    check_slice(kv_slice, tpb)
    if src.capacity < slice_end:
        raise ValueError(f"src_cache (cache {src.id}) has capacity {src.capacity}, below token_range.end {slice_end}")
    counts = check_counts(cached_per_group, len(state_of(src).groups), prompt_len, tpb)
    key = prompt_key(state_of(src), f"src_cache (cache {src.id})", slice_end, tpb)
    src_bases = _pool_bases(src_manager)
    groups: list[GroupTransfer] = []
    sources: list[SourceBlock] = []
    for group in state_of(src).groups:
        lg = int(group.id)
        kind = group.life_cycle.describe()
        pool_group = src_manager.get_pool_group_index(lg)
        slot_bytes = src_manager.get_slot_bytes(pool_group)
        count = counts[lg]
        first_before = len(sources)
        start, end, ordinals = blocks_moved(group, count, kv_slice, tpb)
        if group.sends_blocks:
            src_table = src.get_base_page_indices(lg)
            blocks = [(ordinal, src_table[ordinal]) for ordinal in ordinals]  # (block, src slot)
        else:
            if ordinals and src.capacity != prompt_len:
                raise ValueError(
                    f"src_cache (cache {src.id}) spans {src.capacity} tokens, not prompt_len {prompt_len}: its SSM live "
                    f"state (layer group {lg}) may be past the prompt; send the sources before computing beyond it"
                )
            blocks = [(-1, src.get_ssm_block_base_index(lg))] if ordinals else []
        for block, src_slot in blocks:
            if src_slot == BAD_PAGE_INDEX:
                what = "the SSM live state" if block < 0 else f"block {block}"
                raise ValueError(
                    f"src_cache (cache {src.id}) has no GPU page for {what} of layer group {lg} "
                    f"({kind}); the sender must hold the prompt's KV"
                )
            for pool, size in enumerate(slot_bytes):
                sources.append(
                    SourceBlock(lg, block, pool_group, pool, src_slot, size, src_bases[pool_group][pool] + src_slot * size)
                )
        group_bytes = 0
        for position in range(first_before, len(sources)):
            group_bytes += sources[position].num_bytes
        groups.append(GroupTransfer(lg, kind, count, start, start, end, len(blocks), group_bytes))
    return SourcePlan(kv_slice, tpb, tuple(groups), tuple(sources), key)


def complete_plan(dst_manager: KVCacheManager, dst_cache: KVCache, source: SourcePlan) -> TransferPlan:
    """The receiver's half: pair every source slot of ``source`` with the slot of the same block in ``dst_cache``
    (or its SSM live state). The result has no local endpoints (``execute`` refuses it): a transport moves it.

    ValueError when ``dst_cache`` is not at ``history_length == prompt_len``, lacks a GPU page for a block, would
    have a committed (reused) page overwritten, the plan's layout (``tokens_per_block``, layer groups, slot bytes)
    differs from ``dst_manager``'s, or its ``prompt_key`` is not that of ``dst_cache``'s tokens up to
    ``token_range.end`` in its reuse scope (the sent rows hold another prompt's KV, or the receiver does not know its
    tokens that far).
    """
    dst = check_cache(dst_manager, dst_cache, "dst_cache")
    if not isinstance(source, SourcePlan):
        raise TypeError(f"source must be a SourcePlan, got {source!r}")
    prompt_len = source.kv_slice.prompt_len
    check_receiver_history(state_of(dst), prompt_len)
    if source.tokens_per_block != dst_manager.tokens_per_block:  # the handshake's text (``same_layout``)
        raise ValueError(
            f"layouts differ: tokens_per_block is {source.tokens_per_block} on the sender, "
            f"{dst_manager.tokens_per_block} on the receiver"
        )
    if len(source.groups) != len(state_of(dst).groups):
        raise ValueError(
            f"layouts differ: number of layer groups is {len(source.groups)} on the sender, "
            f"{len(state_of(dst).groups)} on the receiver"
        )
    slice_end = source.kv_slice.token_range.end
    if prompt_key(state_of(dst), f"dst_cache (cache {dst.id})", slice_end, source.tokens_per_block) != source.prompt_key:
        raise ValueError(
            f"the plan's rows [0, {slice_end}) were computed for other tokens or another reuse scope than dst_cache "
            f"(cache {dst.id}) holds (their prompt keys differ): the receiver would serve another prompt's KV"
        )
    check_sources_cover(dst_manager, dst, source)
    dst_bases = _pool_bases(dst_manager)
    tables: dict[int, list[int]] = {}
    descriptors: list[TransferDescriptor] = []
    for item in source.sources:
        lg = item.layer_group
        if not 0 <= lg < len(source.groups) or dst_manager.get_pool_group_index(lg) != item.pool_group:
            raise ValueError(f"source slot {item} names layer group {lg} / pool group {item.pool_group}, not in this layout")
        dst_sizes = dst_manager.get_slot_bytes(item.pool_group)
        if not 0 <= item.pool < len(dst_sizes) or dst_sizes[item.pool] != item.num_bytes:
            raise ValueError(f"source slot {item}: the receiver's pool group {item.pool_group} has slot bytes {dst_sizes}")
        group = state_of(dst).groups[lg]
        kind = group.life_cycle.describe()
        if item.block < 0:
            dst_slot = dst.get_ssm_block_base_index(lg)
        else:
            table = tables.get(lg)
            if table is None:
                table = list(dst.get_base_page_indices(lg))
                tables[lg] = table
            if item.block >= len(table):
                raise ValueError(f"dst_cache (cache {dst.id}) has no block {item.block} in layer group {lg} ({kind})")
            if group.committed_entry_at(item.block):
                raise ValueError(
                    f"cached_per_group[{lg}] = {source.groups[lg].cached_tokens} would overwrite block {item.block} of "
                    f"layer group {lg}, a reused (committed) page of dst_cache (cache {dst.id}); pass its "
                    "cached_tokens_per_layer_group"
                )
            dst_slot = table[item.block]
        if dst_slot == BAD_PAGE_INDEX:
            what = "the SSM live state" if item.block < 0 else f"block {item.block}"
            raise ValueError(
                f"dst_cache (cache {dst.id}) has no GPU page for {what} of layer group {lg} "
                f"({kind}); call resize({prompt_len}, {prompt_len}) before planning"
            )
        descriptors.append(
            TransferDescriptor(
                lg,
                item.block,
                item.pool_group,
                item.pool,
                item.src_slot,
                dst_slot,
                item.num_bytes,
                item.src_address,
                dst_bases[item.pool_group][item.pool] + dst_slot * item.num_bytes,
            )
        )
    return TransferPlan(source.kv_slice, source.tokens_per_block, source.groups, tuple(descriptors))


def check_sources_cover(dst_manager: KVCacheManager, dst: KVCache, source: SourcePlan) -> None:
    """ValueError unless ``source`` moves exactly the blocks the receiver needs (``blocks_moved`` from its own
    groups, the slice and the counts the plan names), each pool of each once: a block left out would keep whatever
    its slot held before, and the receiver would serve it as the prompt's."""
    kv_slice = source.kv_slice
    tpb = source.tokens_per_block
    check_slice(kv_slice, tpb)
    counts = check_counts([group.cached_tokens for group in source.groups], len(source.groups), kv_slice.prompt_len, tpb)
    needed: set[tuple[int, int, int]] = set()  # (layer group, block, pool)
    for group, summary in zip(state_of(dst).groups, source.groups):
        lg = int(group.id)
        if summary.layer_group != lg:
            raise ValueError(f"the plan's summary of layer group {lg} names layer group {summary.layer_group}")
        pools = len(dst_manager.get_slot_bytes(dst_manager.get_pool_group_index(lg)))
        for block in blocks_moved(group, counts[lg], kv_slice, tpb)[2]:
            needed.update((lg, block, pool) for pool in range(pools))
    seen: set[tuple[int, int, int]] = set()
    for item in source.sources:
        key = (item.layer_group, item.block, item.pool)
        where = f"block {item.block} (pool {item.pool}) of layer group {item.layer_group}"
        if key in seen:
            raise ValueError(f"the plan moves {where} twice")
        if key not in needed:
            raise ValueError(f"the plan moves {where}, which the receiver does not need for {kv_slice!r} at counts {counts}")
        seen.add(key)
    if len(seen) < len(needed):
        lg, block, pool = min(needed - seen)
        raise ValueError(
            f"the plan lacks block {block} (pool {pool}) of layer group {lg} for {kv_slice!r} at counts {counts}: "
            "its slot would keep other bytes"
        )


def check_slice(kv_slice: KVSlice, tpb: int) -> None:
    """ValueError unless the slice starts on a block boundary and ends on one or at ``prompt_len``."""
    prompt_len = kv_slice.prompt_len
    slice_beg = kv_slice.token_range.beg
    slice_end = kv_slice.token_range.end
    if slice_beg % tpb != 0:
        raise ValueError(f"token_range.beg {slice_beg} is not a multiple of tokens_per_block {tpb}")
    if slice_end % tpb != 0 and slice_end != prompt_len:
        raise ValueError(f"token_range.end {slice_end} is neither a multiple of tokens_per_block {tpb} nor prompt_len {prompt_len}")


def check_receiver_history(dst: CacheState, prompt_len: int) -> None:
    if dst.history_length != prompt_len:
        raise ValueError(
            f"dst_cache (cache {dst.id}) has history_length {dst.history_length}, not prompt_len {prompt_len}: call "
            f"resize({prompt_len}, {prompt_len}) before planning"
        )


def check_same_prompt(src: CacheState, dst: CacheState, kv_slice: KVSlice) -> None:
    """ValueError unless the two caches of a local handoff hold one prompt's KV: the same reuse scope, the receiver's
    tokens known up to ``prompt_len`` and the sender's rows up to ``token_range.end`` known to hold those
    (``check_prompt_rows``). The receiver commits what it is sent under its own tokens and scope, where every later
    request reusing them reads it."""
    if root_key(src.reuse_scope) != root_key(dst.reuse_scope):
        raise ValueError(
            f"src_cache (cache {src.id}) is of {src.reuse_scope!r}, dst_cache (cache {dst.id}) of "
            f"{dst.reuse_scope!r}: its KV is another scope's"
        )
    receiver = f"dst_cache (cache {dst.id})"
    prompt = known_prompt(dst, receiver, kv_slice.prompt_len, "prompt_len")
    check_prompt_rows(src, f"src_cache (cache {src.id})", prompt[: kv_slice.token_range.end], f"{receiver}'s")


def prompt_key(cache: CacheState, label: str, end: int, tpb: int) -> bytes:
    """The chained block key (``block_key`` from the scope's root, ``tpb`` tokens a block, the last one partial
    where ``end`` is) of the tokens ``cache``'s first ``end`` rows are known to hold (``known_prompt``): a
    ``SourcePlan`` carries the sender's, ``complete_plan`` compares the receiver's, so a plan made apart from its
    receiver lands rows only under the prompt and scope they were computed for. The cache's committed full blocks
    are the tree's, keyed the same way from the same root: their key is taken from there
    (``committed_prefix_key``), and only the tokens past them are hashed here."""
    tokens = known_prompt(cache, label, end, "token_range.end")
    count, key = cache.committed_prefix_key(end, tpb)
    for begin in range(count * tpb, end, tpb):
        key = block_key(key, tokens[begin : begin + tpb])
    return key


def stamp_pages(src: CacheState, dst: CacheState, blocks: list[tuple[int, int]]) -> PageStamps:
    """Each (layer group, block) of ``blocks`` with the sender's and the receiver's page there and their
    generations (-1: no page): a local plan keeps them from planning, ``check_pages`` compares them at ``execute``."""
    src_groups = src.groups
    dst_groups = dst.groups
    stamps: PageStamps = {}
    for lg, block in blocks:
        src_page = src_groups[lg].handoff_page(block)
        dst_page = dst_groups[lg].handoff_page(block)
        stamps[(lg, block)] = (src_page, _generation(src_page), dst_page, _generation(dst_page))
    return stamps


def check_pages(src: CacheState, dst: CacheState, planned: PageStamps) -> None:
    """ValueError unless every page a local plan moves is still the planned one with the planned content (the
    same object, its ``generation`` unchanged): a page freed and its object or slot given new content meanwhile has
    the same slot number, so a slot check alone would copy another request's bytes as the prompt's."""
    now = stamp_pages(src, dst, list(planned))
    for where, (src_page, src_generation, dst_page, dst_generation) in planned.items():
        src_now, src_generation_now, dst_now, dst_generation_now = now[where]
        for label, cache, then, generation, page, generation_now in (
            ("src_cache", src, src_page, src_generation, src_now, src_generation_now),
            ("dst_cache", dst, dst_page, dst_generation, dst_now, dst_generation_now),
        ):
            if page is not then or generation_now != generation:
                lg, block = where
                what = f"the SSM live state of layer group {lg}" if block < 0 else f"block {block} of layer group {lg}"
                raise ValueError(
                    f"{label} (cache {cache.id}) let go of the page planned for {what} since planning (its slot may "
                    "hold other content now); plan the transfer again"
                )


def _generation(page: Page | None) -> int:
    return -1 if page is None else page.generation


def known_prompt(cache: CacheState, label: str, length: int, what: str) -> list[Token]:
    """The tokens of ``cache``'s first ``length`` rows (``CacheView.known_tokens``: committed, then its input past
    them); ValueError when the manager does not know that many: the rows past them may hold any prompt's KV."""
    known = cache.known_tokens()
    if len(known) < length:
        raise _unknown_rows(label, len(known), length, what)
    return known[:length]


def check_prompt_rows(cache: CacheState, label: str, prompt: list[Token], whose: str) -> None:
    """ValueError unless ``cache``'s first ``len(prompt)`` rows are known to hold ``prompt`` (``known_prompt``),
    naming the first position that differs, else how many are known. The one check of a handoff's tokens:
    ``plan_transfer`` and ``execute`` ask it of the sender against the receiver's tokens, ``KVSender.send_sources``
    of the sender and ``KVReceiver.request`` and ``read`` of the receiver against the request's."""
    known = cache.known_tokens()
    both = min(len(known), len(prompt))
    if known[:both] != prompt[:both]:
        position = next(index for index in range(both) if known[index] != prompt[index])
        raise ValueError(
            f"{label} token {position} is {known[position]!r}, {whose} is {prompt[position]!r}: the receiver would "
            "serve another prompt's KV"
        )
    if len(known) < len(prompt):
        raise _unknown_rows(label, len(known), len(prompt), whose + " tokens")


def _unknown_rows(label: str, known: int, length: int, what: str) -> ValueError:
    return ValueError(
        f"{label} is known to hold the tokens of its first {known} positions only, not the {length} of {what}: its "
        "later rows may be another prompt's; give create_kv_cache the whole prompt or commit it first"
    )


def check_counts(cached_per_group: Sequence[SupportsIndex], num_groups: int, prompt_len: int, tpb: int) -> list[int]:
    if isinstance(cached_per_group, (str, bytes)):
        raise TypeError("cached_per_group must be a sequence of ints")
    counts = [as_int(value, f"cached_per_group[{i}]") for i, value in enumerate(cached_per_group)]
    if len(counts) != num_groups:
        raise ValueError(
            f"cached_per_group has {counted(len(counts), 'entry', 'entries')}, expected one per layer group "
            f"({num_groups})"
        )
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


def still_active(state: CacheState, label: str) -> CacheState:
    """ValueError unless the planned cache is still active. A plan keeps the state, not the handle, so a handle
    dropped without ``close()`` is closed as any other (when ``execute`` enters the manager, at the latest); its
    pages may be another request's by now."""
    if state.status == KVCacheStatus.CLOSED:
        raise ValueError(
            f"{label} (cache {state.id}) was closed (or its handle dropped) since planning: its pages may hold "
            "another request's bytes now; nothing was copied"
        )
    if not state.is_active:
        raise ValueError(f"{label} (cache {state.id}) must be active, it is {state.status.name}")
    return state
