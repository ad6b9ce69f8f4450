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

Across processes the two halves of step 2 run where their caches live: ``plan_source`` on the prefill side (the
same rules, from the receiver's counts alone) and ``complete_plan`` on the decode side, which then READs every
descriptor in one NIXL transfer: ``KVSender`` / ``KVReceiver`` (``_nixl_transport``, where the control messages
and the failure handling are documented).

Both caches address blocks by ordinal from block 0 (full page tables), so the sender's own reused prefix never
shifts anything: block ``b`` of the sender goes to block ``b`` of the receiver. The receiver never supplies a
token offset; the sender derives where to start from the counts and the block-list sizes (``align_block_lists``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, SupportsIndex

from ._base.hashing import ReuseScope, TokenSequence
from ._manager.manager import KVCache
from ._cache.kv_cache import KVCacheStatus
from ._manager.manager import KVCacheManager
from ._cache.handle import state_of
from ._manager.core import check_alive, internals_of
from ._handoff.nixl import NIXL_INSTALL as NIXL_INSTALL
from ._handoff.kv_format import KVFormat as KVFormat
from ._handoff.nixl import KVReceiver as KVReceiver
from ._handoff.nixl import KVSender as KVSender
from ._handoff.nixl import NixlEndpoint as NixlEndpoint
from ._handoff.nixl import PrefillRequest as PrefillRequest
from ._handoff.nixl import ReceivedKV as ReceivedKV
from ._handoff.nixl import TransferError as TransferError
from ._handoff.nixl import nixl_available as nixl_available
from ._handoff.plan import align_block_lists as align_block_lists
from ._handoff.plan import (
    check_cache, check_pages, check_receiver_history, check_same_prompt, stamp_pages, still_active,
)
from ._handoff.plan import complete_plan as complete_plan
from ._handoff.plan import plan_source as plan_source
from ._handoff.same_layout import check_same_layout as check_same_layout
from ._handoff.same_layout import check_same_layout_summary as check_same_layout_summary
from ._handoff.same_layout import layout_summary as layout_summary
from ._handoff.transfer import GroupTransfer as GroupTransfer
from ._handoff.transfer import KVSlice as KVSlice
from ._handoff.transfer import LocalEndpoints, endpoints_of
from ._handoff.transfer import SourceBlock as SourceBlock
from ._handoff.transfer import SourcePlan as SourcePlan
from ._handoff.transfer import TransferDescriptor as TransferDescriptor
from ._handoff.transfer import TransferPlan as TransferPlan
from ._base.types import BAD_PAGE_INDEX
from ._base.validation import as_int, as_stream_handle
from ._base.wording import counted

if TYPE_CHECKING:
    from ._pages.page_store import PageStore

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
      whole prompt: the snapshot there, at a block boundary or saved inside the last block, was copied into the
      live slot on resume), else 0 (the sender's live state is sent).
    Whatever the kind, a receiver holding everything (its reuse is the whole prompt) reports ``prompt_len``.

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
        raise ValueError(f"cache {cache.id} holds {counted(reused, 'committed token')}, more than prompt_len {length}")
    return [group.cached_tokens(reused, length) for group in state_of(cache).groups]


def prepare_receiver(
    manager: KVCacheManager,
    input_tokens: TokenSequence,
    reuse_scope: ReuseScope | None = None,
    cuda_stream: SupportsIndex | None = None,
) -> tuple[KVCache, list[int]] | None:
    """The decode side's steps of the handoff, in order, for a prompt of ``len(input_tokens)`` tokens:

    ``create_kv_cache`` (own prefix match) -> ``resume`` -> ``resize(prompt_len, prompt_len)`` ->
    ``cached_tokens_per_layer_group``. Returns the ACTIVE cache and the counts to send to the prefill side, or
    None (the cache closed, nothing held) when GPU memory is short: ``manager.last_refusal`` says why.
    """
    tokens = list(input_tokens)
    prompt_len = len(tokens)
    stream = None if cuda_stream is None else as_stream_handle(cuda_stream, "cuda_stream")  # before a cache exists
    cache = manager.create_kv_cache(reuse_scope, tokens)
    if not cache.resume(stream) or not cache.resize(prompt_len, prompt_len):
        cache.close()
        return None
    return cache, cached_tokens_per_layer_group(cache, prompt_len)


# ------------------------------------------------------------------------------------------------- sender side


def check_same_format(src_format: KVFormat | None, dst_format: KVFormat | None) -> None:
    """ValueError naming the first difference between the two engines' ``KVFormat`` (the NIXL handshake's entries
    and comparison); nothing to compare when both are None. TypeError unless each is a ``KVFormat``, or both None."""
    src_entries, dst_entries = _format_entries(src_format, dst_format)
    check_same_layout_summary(src_entries, dst_entries)


def _format_entries(
    src_format: KVFormat | None, dst_format: KVFormat | None
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    if src_format is None and dst_format is None:
        return (), ()
    given: tuple[tuple[object, str], ...] = ((src_format, "src_format"), (dst_format, "dst_format"))
    for value, name in given:  # a declared type: mypyc inferred ``None`` for ``value`` from the literal
        if not isinstance(value, KVFormat):
            raise TypeError(f"{name} must be a KVFormat (pass both formats or neither), got {value!r}")
    assert src_format is not None and dst_format is not None
    return src_format.summary(), dst_format.summary()


def plan_transfer(
    src_manager: KVCacheManager,
    src_cache: KVCache,
    dst_manager: KVCacheManager,
    dst_cache: KVCache,
    kv_slice: KVSlice,
    cached_per_group: Sequence[SupportsIndex],
    *,
    src_format: KVFormat | None = None,
    dst_format: KVFormat | None = None,
) -> TransferPlan:
    """The copies that bring ``kv_slice`` of ``src_cache`` (prefill side) into ``dst_cache`` (decode side), both
    in this process: ``plan_source`` on the sender's side, then ``complete_plan`` on the receiver's.

    ``cached_per_group``: the receiver's ``cached_tokens_per_layer_group`` (each a multiple of ``tokens_per_block``
    or ``prompt_len``). Per attention group, with ``n = ceil(token_range.end / tpb)``: the sender's block list is
    the slice's blocks ``[token_range.beg / tpb, n)``, the receiver's is ``[count / tpb, n)``; aligned by their tails
    (``align_block_lists``) they give the start block, and the blocks needed at history ``prompt_len`` from there to
    ``n`` move (for a window: only sinks and in-window blocks). An SSM group moves the sender's live state into
    the receiver's when the receiver's count is below ``prompt_len`` and the slice ends at ``prompt_len``.

    ``src_format`` / ``dst_format``: what each engine's page bytes mean (``KVFormat``: dtype, model, arrangement,
    tensor-parallel rank), compared as the NIXL handshake compares them; pass both (one alone is a TypeError), or
    neither when one engine fills both managers' pages (two models of one layout in one process are told apart by
    nothing else).

    Requirements (ValueError otherwise, naming what is wrong): same layer layout, ``tokens_per_block`` and
    ``KVFormat`` on both sides; both caches active and owned by their managers, of one reuse scope; the receiver's
    tokens known up to ``prompt_len`` and the sender's rows up to ``token_range.end`` known to hold them (known:
    committed, or given to ``create_kv_cache`` past them; another prompt's or scope's KV would be committed as the
    receiver's); the receiver at ``history_length == prompt_len``;
    the sender at capacity >= ``token_range.end`` with a GPU page for every block sent (and at capacity
    ``prompt_len`` when its SSM live state is sent: a state past the prompt is not the prompt's); no destination
    page is a committed (shared, reused) page of the receiver.
    """
    src_entries, dst_entries = _format_entries(src_format, dst_format)
    check_same_layout(src_manager, dst_manager, src_entries, dst_entries)  # the handshake's entries, in its order
    src = check_cache(src_manager, src_cache, "src_cache")
    dst = check_cache(dst_manager, dst_cache, "dst_cache")
    if src is dst:
        raise ValueError("src_cache and dst_cache are the same cache")
    if not isinstance(kv_slice, KVSlice):
        raise TypeError(f"kv_slice must be a KVSlice, got {kv_slice!r}")
    src_state, dst_state = state_of(src), state_of(dst)
    check_receiver_history(dst_state, kv_slice.prompt_len)
    check_same_prompt(src_state, dst_state, kv_slice)
    source = plan_source(src_manager, src, kv_slice, cached_per_group)
    plan = complete_plan(dst_manager, dst, source)
    stamps = stamp_pages(src_state, dst_state, _blocks_of(plan))
    endpoints = LocalEndpoints(src_manager, src_state, dst_manager, dst_state, stamps)  # the states: see its doc
    return TransferPlan(kv_slice, plan.tokens_per_block, plan.groups, plan.descriptors, endpoints)


def _blocks_of(plan: TransferPlan) -> list[tuple[int, int]]:
    """Each (layer group, block) the plan moves, once (block -1: an SSM live state)."""
    return list(dict.fromkeys((descriptor.layer_group, descriptor.block) for descriptor in plan.descriptors))


# --------------------------------------------------------------------------------------------------- execution


def execute(plan: TransferPlan, stream: SupportsIndex | None = None) -> None:
    """Perform a locally made plan: one batched gather/scatter per pool group, through the receiving manager's page
    store (``PageStore.copy_from``): both managers' pending copies run first, then the plan's copies run on
    ``stream`` (default: the receiving cache's stream) after both sides' fences, and fence it on both sides.

    A plan runs once. ValueError when the plan is not local (unpickled), ran already, a cache is no longer active
    (a plan keeps no handle: a cache whose handle was dropped without ``close()`` is closed as any other, and
    refused here) or committed tokens of another prompt since planning,
    the receiver moved past ``prompt_len`` or committed a planned block, the sender's history moved (its SSM live
    state with it), a slot in the plan no longer matches the caches' tables (a suspend/resume in between may move
    pages), or either cache let go of a planned page since (its slot, even at the same number, may hold another
    request's bytes: each page is checked with its generation): plan again.
    """
    if not isinstance(plan, TransferPlan):
        raise TypeError(f"plan must be a TransferPlan, got {plan!r}")
    handle = None if stream is None else as_stream_handle(stream, "stream")
    endpoints = endpoints_of(plan)
    if endpoints is None:
        raise ValueError("this TransferPlan has no local caches (it was unpickled): hand its descriptors to the transport")
    check_alive(endpoints.src_manager)
    check_alive(endpoints.dst_manager)
    runs: dict[int, tuple[list[int], list[int]]] = {}
    for descriptor in plan.descriptors:
        if descriptor.pool != 0:  # every pool of a pool group moves the same slots
            continue
        run = runs.get(descriptor.pool_group)
        if run is None:
            run = ([], [])
            runs[descriptor.pool_group] = run
        run[0].append(descriptor.src_slot)
        run[1].append(descriptor.dst_slot)
    src, dst = internals_of(endpoints.src_manager), internals_of(endpoints.dst_manager)
    # A call of both managers (each flushes its copies): refused while either has a call in flight (a callback).
    # Entering closes what dropped handles left, so the checks, inside, find a dropped cache closed.
    with src.guard.entering("disagg.execute"):
        if dst.guard is src.guard:
            _check_still_current(plan, endpoints)
            _copy_runs(src.store, dst.store, runs, _stream_of(endpoints, handle))
        else:
            with dst.guard.entering("disagg.execute"):
                _check_still_current(plan, endpoints)
                _copy_runs(src.store, dst.store, runs, _stream_of(endpoints, handle))
    endpoints.executed = True


def _stream_of(endpoints: LocalEndpoints, handle: int | None) -> int:
    """The stream given to ``execute``, else the receiving cache's."""
    return int(endpoints.dst_state.cuda_stream) if handle is None else handle


def _copy_runs(src_store: PageStore, dst_store: PageStore, runs: dict[int, tuple[list[int], list[int]]], stream: int) -> None:
    for pool_group, (src_rows, dst_rows) in runs.items():
        dst_store.copy_from(src_store, pool_group, src_rows, dst_rows, stream)


def _check_still_current(plan: TransferPlan, endpoints: LocalEndpoints) -> None:
    """ValueError unless the plan's copies would still write the prompt's bytes over nothing newer: it has not run
    yet (the receiver may have decoded into the prompt's last block since), the receiver is still at the prompt's
    end with none of the planned pages committed (shared), the sender's history (its SSM live state) is where it was,
    every slot is the planned one and every page the planned content (``check_pages``)."""
    if endpoints.executed:
        raise ValueError("this TransferPlan was executed already: a plan runs once (plan again for another transfer)")
    src = still_active(endpoints.src_state, "src_cache")
    dst = still_active(endpoints.dst_state, "dst_cache")
    check_receiver_history(dst, plan.kv_slice.prompt_len)
    check_same_prompt(src, dst, plan.kv_slice)  # either may have committed since planning
    if src.history_length != endpoints.src_history:
        raise ValueError(
            f"src_cache (cache {src.id}) moved to history_length {src.history_length} since planning, "
            f"{endpoints.src_history} then; plan the transfer again"
        )
    dst_groups = dst.groups
    tables: dict[int, tuple[list[int], list[int]]] = {}
    for descriptor in plan.descriptors:
        lg = descriptor.layer_group
        if descriptor.block >= 0 and dst_groups[lg].committed_entry_at(descriptor.block):
            raise ValueError(
                f"block {descriptor.block} of layer group {lg} is a committed (shared) page of dst_cache (cache "
                f"{dst.id}) since planning: the plan would overwrite it"
            )
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
    check_pages(src, dst, endpoints.stamps)  # the same slots may hold other content
