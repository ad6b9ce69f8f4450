"""``CacheHandle``: the body of ``KVCache``, the handle an engine holds for one request's cache.

The manager keeps the cache's state (``CacheState``) among its open caches but never the handle, so an engine
that drops a handle without ``close()`` loses no memory: the handle's ``__del__`` queues the state, and the
manager closes it at the entry of its next public call (never inside the call during which the cycle collector
happened to run the finalizer; see ``CallGuard``). (Weak references to compiled classes are not available; a
handle the manager does not hold needs none.) A handle is not a value: copying or pickling it raises.
``CacheHold`` (``KVCache.hold``) pins an active cache's pages for a writer outside the manager.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable, ClassVar, Generic, SupportsIndex, TypeVar, overload, final

from .._model.addressing import ScratchDesc
from .call_guard import CallGuard
from .._base.hashing import ReuseScope, Token
from .cache_view import KVCacheCommitState
from .kv_cache import CacheState, KVCacheStatus
from .refusal import Refusal
from .._observe.stats_delta import KVCacheStatsDelta
from .._base.types import BAD_PAGE_INDEX, DEFAULT_BEAM_INDEX, CudaStream, Handle, PageIndexMode
from .._base.validation import as_bool, as_int

if TYPE_CHECKING:
    from .cache_view import Int32Buffer

# _SETTER_NOTE: the handle's setters reach the state's through ``setattr``. Compiled, a direct assignment from one
# native property setter to another drops an exception the inner setter raises (the process then crashes);
# ``setattr`` goes through the attribute protocol, which propagates it.

# Why copy/deepcopy/pickle refuse: a second handle's drop would close the first one's cache, and a pickle would
# carry the whole manager with its pools.
HandleT = TypeVar("HandleT", bound="CacheHandle")  # a hold's cache keeps its public type (KVCache)


def state_of(cache: CacheHandle) -> CacheState:
    """The state behind a cache handle (internal API: for the package's other modules, e.g. ``disagg``, and
    white-box tests; not a user API)."""
    return cache._state


class CacheHandle(Handle):
    """The body of ``KVCache`` (the public subclass beside the manager adds the link to it and the per-step
    members: ``resize``, ``commit``, ``capacity`` and ``history_length``): each method guards the call and
    delegates to the cache's state."""

    Status: ClassVar[type[KVCacheStatus]] = KVCacheStatus
    CommitState: ClassVar[type[KVCacheCommitState]] = KVCacheCommitState

    def __init__(self, state: CacheState, guard: CallGuard, tokens_per_block: int, text_only: bool) -> None:
        self._state = state
        self._text_only = text_only
        self._guard: CallGuard = guard
        self._tokens_per_block: int = tokens_per_block
        self._holds: list[str] = []  # the reasons of the live CacheHolds (see CacheHold)

    def __del__(self) -> None:
        # Only queue: the collector may run this in the middle of any manager call, on any thread.
        state = self._state
        if state.status != KVCacheStatus.CLOSED:
            self._guard.dropped.append(state)

    # ------------------------------------------------------------------------------------------- properties
    @property
    def id(self) -> int:
        """The id given to ``create_kv_cache`` or chosen by the manager; unique among open caches."""
        return self._state.id

    @property
    def last_refusal(self) -> Refusal | None:
        """Why this cache's latest ``resize``/``resume`` (or its batch admission) answered False; None before any
        refusal. Kept until the next refusal, so read it right after a False."""
        return self._state.last_refusal

    @property
    def status(self) -> KVCacheStatus:
        """ACTIVE (pages locked on the GPU), SUSPENDED or CLOSED."""
        return self._state.status

    @property
    def is_active(self) -> bool:
        """Whether the status is ACTIVE."""
        return self._state.is_active

    @property
    def resumable_alone(self) -> bool:
        """Whether, suspended as it is now, this cache's ``resume`` fits under ``max_util_for_resume`` (less the
        admission watermark) on an otherwise empty GPU tier. ``resize`` is not bounded by that limit, so a running
        cache can outgrow it: suspending one answering False strands it (every later ``resume`` is refused,
        ``fits_empty_manager=False``), so a scheduler preempts another request instead."""
        return self._state.resumable_alone()

    @property
    def num_committed_tokens(self) -> int:
        """Finalised tokens, the reused prefix included; their full blocks are in the radix tree, reusable."""
        return self._state.num_committed_tokens

    @property
    def committed_tokens(self) -> list[Token]:
        """The committed tokens (reused prefix included), oldest first."""
        return self._state.committed_tokens

    @property
    def reuse_scope(self) -> ReuseScope:
        """The scope this cache matches and publishes blocks in."""
        return self._state.reuse_scope

    @property
    def snapshot_points(self) -> tuple[int, ...]:
        """The positions where this cache snapshots its SSM states (``snapshot_at`` snapped down to block
        boundaries, sorted; with partial reuse the positions inside a block too, snapshotted on a partial block;
        with ``commit_min_snapshot`` / ``mamba_save_last_snapshot`` the end of the input tokens' last full block):
        a prefill chunk should end at each one, since only a commit ending a computed chunk there takes it. Without
        SSM layers, while this cache has SWA scratch reuse on, the ``snapshot_at`` positions snapped down to block
        boundaries (with partial reuse the positions too): scratch keeps no page for what a chunk leaves behind a
        window, so a prefix is reusable where a chunk ended. Else empty
        (nothing is snapshotted or discarded, so no chunk needs to stop)."""
        return self._state.snapshot_points

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block (the manager's)."""
        return self._tokens_per_block

    @property
    def text_only(self) -> bool:
        """Whether this cache refuses multimodal (``bytes``) tokens in ``commit``."""
        return self._text_only

    @property
    def num_blocks(self) -> int:
        """Blocks that ``capacity`` spans: the length of each layer group's page table."""
        return self._state.num_blocks

    @property
    def beam_width(self) -> int:
        """Always 1: beam search is not supported."""
        return self._state.beam_width

    @property
    def cuda_stream(self) -> CudaStream:
        """The stream the manager orders this cache's copies on: the last one given to ``resume`` or set here
        (``resume()`` without a stream uses it); setting it on an active cache is ``resume(stream)``."""
        return self._state.cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: SupportsIndex) -> None:
        with self._changing("KVCache.cuda_stream"):
            setattr(self._state, "cuda_stream", value)  # see _SETTER_NOTE

    @property
    def is_committing_stopped(self) -> bool:
        """Whether later tokens are only history: ``stop_committing`` was called or the cache closed."""
        return self._commit_state == KVCacheCommitState.STOPPED

    # The two properties below are public API under TensorRT-LLM's spelling: engines written against it read
    # ``_commit_state`` and ``_reuse_scope`` on a cache, so the leading underscore is part of their names here.
    @property
    def _commit_state(self) -> KVCacheCommitState:
        """``CommitState.ALLOWED`` until ``stop_committing`` or ``close``, then ``STOPPED`` (read-only; TensorRT-LLM's
        name)."""
        stopped = self._state.is_committing_stopped or self._state.status == KVCacheStatus.CLOSED
        return KVCacheCommitState.STOPPED if stopped else KVCacheCommitState.ALLOWED

    @property
    def _reuse_scope(self) -> ReuseScope:
        """``reuse_scope`` under TensorRT-LLM's older attribute name (read-only)."""
        return self._state.reuse_scope

    # Diagnostics under TensorRT-LLM's names (leading underscore included): where the reuse of this cache's input
    # tokens was cut, measured by the match that opened it.
    def _get_num_reusable_tokens_before_pruning(self) -> int:
        """How far the input tokens ran along the radix tree when this cache opened: full blocks, then (with partial
        reuse) the tokens shared with the closest child; the fork point, whatever pages or snapshots remain."""
        return self._state.walked_length

    def _get_num_reusable_tokens_before_hybrid_pruning(self) -> int:
        """The longest prefix the attention layer groups alone could have served when this cache opened;
        ``num_committed_tokens`` is shorter when no SSM snapshot ends there (hybrid models)."""
        return self._state.attention_length

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether this cache puts out-of-window blocks of a prefill chunk in shared scratch slots."""
        return self._state.enable_swa_scratch_reuse

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, value: bool) -> None:
        with self._changing("KVCache.enable_swa_scratch_reuse"):
            setattr(self._state, "enable_swa_scratch_reuse", value)  # see _SETTER_NOTE

    @property
    def has_scratch_slots(self) -> bool:
        """Whether any layer group holds shared scratch blocks now (then only PER_LAYER indices are valid)."""
        return self._state.has_scratch_slots

    # ------------------------------------------------------------------------------------------- addressing
    def get_scratch_desc(self, layer_group_id: SupportsIndex) -> ScratchDesc | None:
        """Scratch blocks of a layer group and their slots; None when the group has no scratch blocks now
        (``ValueError`` on a closed cache, as for every page-table read)."""
        return self._state.get_scratch_desc(layer_group_id)

    def get_ssm_block_base_index(self, layer_group_id: SupportsIndex, beam: SupportsIndex = DEFAULT_BEAM_INDEX) -> int:
        """GPU slot of this cache's live state of an SSM layer group (``BAD_PAGE_INDEX`` while suspended): a base
        page index, so ``KVCacheManager.get_page_index_converter(layer, role)([slot])`` gives its row of that
        layer's state buffer (e.g. ``ssm_state``). Resume copies a reused snapshot into it; the slot may change
        at every resume. A cache that reused nothing finds there what an earlier cache left (nothing is zeroed):
        at history 0 the engine starts from the model's initial state (a Mamba kernel's ``has_initial_state``
        False)."""
        return self._state.get_ssm_block_base_index(layer_group_id, beam)

    def get_num_front_blocks_removed(self, layer_group_id: SupportsIndex) -> int:
        """Leading non-sink blocks without a page (stale), for window-local tables' ``kv_page_offset``."""
        return self._state.get_num_front_blocks_removed(layer_group_id)

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER always; SHARED only while this cache has no scratch blocks."""
        return self._state.supports_index_mode(mode)

    def get_base_page_indices(
        self, layer_group_id: SupportsIndex, beam_id: SupportsIndex = DEFAULT_BEAM_INDEX
    ) -> array[int]:
        """Slot id of each block's GPU page (block ordinal order), ``BAD_PAGE_INDEX`` where there is none; all of
        an SSM group's are ``BAD_PAGE_INDEX``: its one live state is at ``get_ssm_block_base_index``."""
        return self._state.get_base_page_indices(layer_group_id, beam_id)

    def get_aggregated_page_indices(
        self, layer_group_id: SupportsIndex, beam_id: SupportsIndex = DEFAULT_BEAM_INDEX, valid_only: bool = False
    ) -> list[int]:
        """The slot ``i`` of each block for ``KVCacheManager.get_aggregated_pages`` ranges (the base page indices);
        ``valid_only`` leaves out blocks without a GPU page."""
        indices = self._state.get_base_page_indices(layer_group_id, beam_id)
        if as_bool(valid_only, "valid_only"):
            return [index for index in indices if index != BAD_PAGE_INDEX]
        return list(indices)

    def set_base_page_index_buf(
        self, beam_idx: SupportsIndex, layer_group_id: SupportsIndex, buf: Int32Buffer | None
    ) -> None:
        """Register a writable 1-D int32 buffer the manager keeps equal to the base page indices.

        It stays registered until replaced (``None`` unregisters) or the cache closes, and is rewritten on every
        change: while the cache is suspended or after it closes every entry is ``BAD_PAGE_INDEX`` (-1), as are
        the entries past the last block.
        """
        with self._guard.entering("KVCache.set_base_page_index_buf"):
            self._state.set_base_page_index_buf(beam_idx, layer_group_id, buf)

    # ------------------------------------------------------------------------------------------- lifecycle
    def hold(self: HandleT, reason: str) -> CacheHold[HandleT]:
        """Keep this active cache's pages where they are while something outside the manager may still write
        into them or read them (a transfer that cannot be cancelled, a connector's copy out): until the returned hold is released, ``resize``,
        ``commit``, ``suspend``, ``close`` and every other call that could free, move or share a page raise
        ``RuntimeError``, changing nothing. Holds stack; ``reason`` appears in the refusals."""
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"reason must be a non-empty str, got {reason!r}")
        with self._guard.entering("KVCache.hold"):
            if not self._state.is_active:
                raise ValueError(f"only an active cache can be held; KVCache {self.id} is {self.status.name}")
            return CacheHold(self, HoldReason(self._holds, reason, self._state.note_held), self._guard)

    @property
    def held_for(self) -> tuple[str, ...]:
        """The reasons of the holds not yet released (empty when the cache accepts every call)."""
        return tuple(self._holds)

    def _changing(self, call: str) -> CallGuard:
        """``CallGuard.entering`` for a call that may change pages, refused while the cache is held (asked once
        entered: the entry lifts the holds dropped unreleased)."""
        guard = self._guard.entering(call)
        if self._holds:
            error = held_error(self._state.id, call, self._holds)
            guard.leave()
            raise error
        return guard

    def resume(self, cuda_stream: SupportsIndex | None = None) -> bool:
        """Bring every needed page to the GPU and lock it (one batched migration); False, changing nothing, when
        GPU memory is short or utilisation would exceed ``max_util_for_resume``; ``last_refusal`` then says which
        pool group was short, by how many pages, and whether waiting for other caches can help."""
        with self._changing("KVCache.resume"):
            return self._state.resume(cuda_stream)

    def suspend(self) -> None:
        """Unlock every page (they stay held: they may move to colder tiers but are never lost)."""
        with self._changing("KVCache.suspend"):
            self._state.suspend()

    @overload
    def prefetch(self, *, evict: bool = False) -> int: ...

    @overload
    def prefetch(self, target: SupportsIndex, *, evict: bool = False) -> bool: ...

    def prefetch(self, target: SupportsIndex | None = None, *, evict: bool = False) -> int | bool:
        """Start bringing this suspended cache's pages from colder tiers to the GPU ahead of ``resume`` (which then
        finds them there). By default into free GPU slots only: nothing is evicted for them. ``evict=True`` makes
        room as ``resume`` would (reusable and other suspended caches' pages leave by the priority-LRU; pages an
        active cache uses never do), up to what ``resume`` could lock under ``admission_watermark`` /
        ``max_util_for_resume``. Returns the pages it started moving; ``ValueError`` for an active or closed cache.

        With a cache level ``target`` (TensorRT-LLM's form): the pages colder than ``target`` move up to it (free
        slots only, unless ``evict`` with ``target`` 0), and the answer is whether none is left colder; when some
        is, ``last_refusal`` says which pool group, how many pages and why (no free slot there, or the admission
        limit an evicting prefetch stays within)."""
        checked = as_bool(evict, "evict")
        level = None if target is None else as_int(target, "target")
        with self._changing("KVCache.prefetch"):
            if level is None:
                return self._state.prefetch(checked)
            return self._state.prefetch_to(level, checked)

    def offload(self) -> int:
        """Move this suspended cache's GPU pages to the warmest colder tier with a free slot now (a hint: nothing
        is evicted for them, no page is lost, pages another active cache uses stay). Returns the pages moved;
        ``ValueError`` for an active or closed cache."""
        with self._changing("KVCache.offload"):
            return self._state.offload()

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """This request's blocks (allocated in all, new, reused, missed) since the last commit or discard of them,
        added to ``KVCacheManager.get_committed_stats``; all zero unless created with ``enable_request_stats``."""
        with self._guard.entering("KVCache.commit_pending_stats"):
            return self._state.commit_pending_stats()

    def discard_pending_stats(self) -> None:
        """Forget this request's block counts since the last commit or discard (e.g. a preempted attempt). The
        iteration statistics keep what the cache's creation counted (its SSM snapshot lookup too): they record
        what happened, in the iteration it happened."""
        with self._guard.entering("KVCache.discard_pending_stats"):
            self._state.discard_pending_stats()

    def stop_committing(self, save_last_ssm_snapshot: bool = False) -> None:
        """No more commits: the trailing partial block joins the tree when the cache closes (the cache may
        still write past it until then; in a hybrid model whose commits end on a snapshot point, a copy of it
        joins at once, with the SSM states: its one snapshot), and held stale pages that can no longer be
        committed are freed.
        ``save_last_ssm_snapshot``: first snapshot the SSM states at the committed length, inside a block too, so a
        later request starting with exactly these tokens reuses all of them (the committed tokens must reach
        ``capacity``)."""
        with self._changing("KVCache.stop_committing"):
            self._state.stop_committing(save_last_ssm_snapshot)

    def close(self) -> None:
        """Release everything; committed pages stay in the tree as reusable content, the trailing partial block
        included. Idempotent."""
        with self._changing("KVCache.close"):
            self._state.close()

    def __repr__(self) -> str:
        state = self._state
        return (
            f"KVCache(id={state.id}, status={state.status.name}, capacity={state.capacity}, "
            f"history_length={state.history_length}, num_committed_tokens={state.num_committed_tokens})"
        )


@final
class CacheHold(Handle, Generic[HandleT]):
    """One reason an active cache is held; ``release`` (idempotent) lifts it. Made by ``KVCache.hold``.

    A transfer the manager does not control (a NIXL READ that NIXL will not release, an engine's own RDMA or copy
    engine) writes into a cache's GPU slots by address. Were the cache closed, suspended, shrunk or committed
    meanwhile, those slots could go to another request (or be shared with one through the radix tree) and the late
    write would land in that request's KV. So while a cache is held, every call that could free, move or share its
    pages raises ``RuntimeError`` and changes nothing; reads, page indices and statistics stay available. The hold
    references the handle, so dropping the last other reference cannot close the cache behind the writer's back.
    A hold dropped unreleased (nobody can release it any more) is lifted at the entry of the next call.
    """

    def __init__(self, cache: HandleT, held: HoldReason, guard: CallGuard) -> None:
        self.cache: HandleT = cache  # keeps the handle (and so its pages) alive while held
        self.reason: str = held.reason
        self._held: HoldReason = held
        self._guard: CallGuard = guard
        self._released = False
        held.take()

    @property
    def released(self) -> bool:
        """Whether ``release`` ran."""
        return self._released

    def release(self) -> None:
        """Lift this hold; the cache accepts every call again once no other hold remains."""
        if not self._released:
            self._released = True
            self._held.close()

    def __del__(self) -> None:
        # Dropped unreleased: nobody can release it any more. Only queued (the collector may run this in the middle
        # of any call, on any thread): lifted at the entry of the next call, as a dropped cache is closed.
        if not self._released:
            self._guard.dropped.append(self._held)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"CacheHold(cache={self.cache.id}, reason={self.reason!r}, {state})"


class HoldReason:
    """One hold's reason among its cache's (the handle's list, which page-changing calls test) and what refusals
    read (``CacheView.note_held``): ``take`` adds it, ``close`` removes it (``CacheHold.release``, or the guard's
    queue when the hold was dropped unreleased)."""

    def __init__(self, reasons: list[str], reason: str, note_held: Callable[[list[str]], None]) -> None:
        self.reasons: list[str] = reasons
        self.reason: str = reason
        self.note_held: Callable[[list[str]], None] = note_held

    def take(self) -> None:
        self.reasons.append(self.reason)
        self.note_held(self.reasons)

    def close(self) -> None:
        self.reasons.remove(self.reason)
        self.note_held(self.reasons)


def held_error(cache_id: int, call: str, reasons: list[str]) -> RuntimeError:
    """The refusal of a page-changing call on a held cache."""
    return RuntimeError(
        f"{call} on KVCache {cache_id}, which is held ({'; '.join(reasons)}): its pages must stay where they are "
        f"until every hold is released (nothing changed)"
    )
