"""A cache's read side: what ``CacheState`` holds (lengths, status, committed blocks, one ``GroupState`` per layer
group) and what the engine reads of it (page tables, scratch descriptors, SSM slots). The classes above it
(``SuspendingCache``, ``ResizingCache``, ``CommittingCache``, ``CacheState``) add every call that changes state."""

from __future__ import annotations

import enum
from array import array
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

from .._model.addressing import ScratchDesc
from .attention_state import AttentionState, entries_by_block, hold_adopted
from .group_kinds import GroupStates
from .group_state import GroupState
from .lent_rows import RowLoans
from .refusal import Refusal
from .ssm_state import SsmState
from .._base.hashing import ReuseScope, Token
from .._model.life_cycle import NEVER, NO_WINDOW, ceil_div
from .._pages.page import Block, Page
from .._pages.prefix_match import Match
from .._pages.priority import PriorityCallback, ask_priority
from .services import CacheServices
from .._observe.events import IterationStats
from .._observe.stats_delta import KVCacheStatsDelta
from .._base.types import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    CudaStream,
    HalfOpenRange,
    PageIndexMode,
)
from .._base.validation import as_index, as_int

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    # What ``set_base_page_index_buf`` takes: a NumPy int32 array (NumPy declares ``__buffer__`` only for
    # Python >= 3.12) or any other writable int32 buffer; the format, shape and size are checked at run time.
    Int32Buffer = Buffer | npt.NDArray[np.int32]


class KVCacheStatus(enum.Enum):
    """ACTIVE: pages locked on the GPU, usable by kernels. SUSPENDED: pages held, free to move to colder tiers.
    CLOSED: everything released."""

    ACTIVE = 0
    SUSPENDED = 1
    CLOSED = 2


class KVCacheCommitState(enum.Enum):
    """ALLOWED: ``commit`` still adds blocks to the tree. STOPPED: ``stop_committing`` ran (or the cache closed);
    later tokens are only history. (TensorRT-LLM's ``_KVCache.CommitState``.)"""

    ALLOWED = 0
    STOPPED = 1




class ReuseTally:
    """A new cache's reuse as counted when it opened: per layer group, and the reused length and missed blocks."""

    def __init__(self, groups: list[IterationStats], missed: int, reused_length: int) -> None:
        self.groups: list[IterationStats] = groups
        self.missed: int = missed
        self.reused_length: int = reused_length

    def add_shared(self, blocks: int, history: int) -> None:
        """Count ``blocks`` that an earlier request of the same batch computes for this one as reused, not missed:
        this request computes none of them, as a prefix-cache hit saves (vLLM counts such blocks as hits too)."""
        moved = min(blocks, self.missed)
        self.missed -= moved
        self.reused_length = max(self.reused_length, history)
        for counted in self.groups:
            counted.reused_full_blocks += moved
            counted.missed_blocks -= moved

class CacheView:
    """The state of one request's cache and its read-only API; see ``CacheState``."""

    def __init__(
        self,
        services: CacheServices,
        match: Match,
        tokens: list[Token],
        cache_id: int,
        priority_callback: PriorityCallback | None,
    ) -> None:
        self._services = services
        self.id = cache_id
        self._status = KVCacheStatus.SUSPENDED
        self._priority_callback = priority_callback
        self._cuda_stream = CudaStream(0)
        settings = services.settings
        tpb = settings.tokens_per_block
        length = match.length
        self._capacity = length
        self._history = length
        self._committed = length
        self._committing_stopped = False
        self._root: Block = services.tree.root(None) if match.root is None else match.root
        self._blocks: list[Block] = list(match.blocks)
        # The match's depths before pruning (internal: ``KVCache._get_num_reusable_tokens_before_*`` read them).
        self.walked_length: int = match.walked_length
        self.attention_length: int = match.attention_length
        self._tail: list[Token] = tokens[len(self._blocks) * tpb : length]
        self._scratch_enabled = settings.scratch_reuse
        num_blocks = ceil_div(length, tpb)
        states = GroupStates(services.life_cycles, services.pool_group_of, services.store, services.layout, num_blocks)
        # The pages of each layer group, by id and by kind (internal: read by the manager's other modules, never by
        # users). Each kind's steps run on its own list, in layer-group order.
        self.groups: list[GroupState] = states.all
        self.attention: list[AttentionState] = states.attention
        self.ssm: list[SsmState] = states.ssm
        self._root.users += 1
        for block in self._blocks:
            block.users += 1
        for group in self.groups:
            group.adopt(self._blocks, match)
        hold_adopted(services.store, self.attention, self._history)
        self._prompt_blocks = ceil_div(len(tokens), tpb)
        self._prompt_length = len(tokens)
        # The input tokens past the reused prefix (a copy: the caller's list stays theirs): what the engine computes
        # there, which a handoff compares before sending or receiving rows not committed yet (``known_tokens``),
        # until the commit reaching ``_input_end`` releases it (``CommittingCache``): the commits then hold them.
        self._input_begin = length
        self._input_rest: list[Token] = tokens[length:]
        self._input_end = length + len(self._input_rest) if self._input_rest else NEVER
        # Tokens of the blocks another request of the same batch computes for this cache (``share_prefix``), from
        # position ``_shared_begin`` to ``_shared_end``: a commit must put these tokens there (commit_checks.py).
        self._shared_begin = 0
        self._shared_end = 0
        self._shared_tokens: list[Token] = []
        # Rows this cache computes for later requests of its batch, and rows they compute for it (``lent_rows.py``).
        self._loans = RowLoans()
        # Positions where the caller asked for an SSM snapshot (``declare_snapshots``), and them in order.
        self._snapshot_points: frozenset[int] = frozenset()
        self._sorted_snapshot_points: tuple[int, ...] = ()
        # The declared prefix ends, snapped down to block boundaries (and as given with partial reuse): the chunk
        # stops of SWA scratch reuse in a model without SSM layers.
        self._declared_points: tuple[int, ...] = ()
        # The last length where a commit may snapshot inside a block (declared points, prefill chunk ends): commits
        # up to it skip the decode fast path. -1 without partial reuse or SSM groups (no snapshot inside a block).
        self._mid_block_snapshot_end = -1
        if services.has_live_states and settings.partial_reuse:
            self._mid_block_snapshot_end = self._prompt_length if settings.snapshot_prefill_chunks else 0
        self._tpb = tpb
        # Histories below this leave every group's stale range as it is at ``_history`` (the decode fast paths).
        self._steady_below = 0
        self._note_history()
        # Blocks this request reused, missed and allocated, when the engine asked for them (enable_request_stats).
        self.request_stats: KVCacheStatsDelta | None = None
        # A reuse lookup (input tokens) counted at creation that commit/discard_pending_stats has not settled yet.
        self.lookup_pending: bool = False
        # Why this cache's latest resize/resume/admission answered False; kept until the next refusal.
        self.last_refusal: Refusal | None = None

    def note_refusal(self, refusal: Refusal) -> None:
        """Keep ``refusal`` as this cache's and the manager's latest, as ``CacheServices.note_refusal`` completes it
        (on the refusal path only; assigned here, in the class that declares the attribute, so type checkers see one
        declaration)."""
        self.last_refusal = self._services.note_refusal(refusal)

    def note_held(self, reasons: list[str]) -> None:
        """Keep this cache among the held ones while ``reasons`` (its live ``CacheHold`` reasons) is not empty, so
        that a refusal can name the pages held out of use; forget it once empty or closed (the collector closes a
        cache dropped with its hold unreleased)."""
        if reasons and self._status != KVCacheStatus.CLOSED:
            self._services.held_caches[self.id] = (self.held_pages, reasons)
        else:
            self._services.held_caches.pop(self.id, None)

    def declare_snapshots(self, positions: tuple[int, ...]) -> None:
        """Take an SSM snapshot where a commit ends a computed chunk at one of ``positions`` (internal: checked by the
        caller). A snapshot belongs to a whole block, so each position is snapped down to its block boundary; with
        partial reuse in a hybrid model a position inside a block is kept too (its snapshot goes on a partial block).
        With the last-snapshot flags the prompt's last full block is a point too."""
        tpb = self._tpb
        points = {position - position % tpb for position in positions if position >= tpb}
        if self._services.settings.snapshot_every_commit and self._prompt_length >= tpb:
            # The last-snapshot flags promise the prompt's end as a reuse point: a chunk must end at its last full
            # block for the commit there to snapshot it (the engine stops its chunks at ``snapshot_points``).
            points.add(self._prompt_length - self._prompt_length % tpb)
        if self._mid_block_snapshot_end >= 0:
            points.update(position for position in positions if position > 0)
            self._mid_block_snapshot_end = max([self._mid_block_snapshot_end, *points])
        self._snapshot_points = frozenset(points)
        self._sorted_snapshot_points = tuple(sorted(points))
        declared = {position - position % tpb for position in positions if position >= tpb}
        if self._services.settings.partial_reuse:
            declared.update(position for position in positions if position > 0)
        self._declared_points = tuple(sorted(declared))

    @property
    def snapshot_points(self) -> tuple[int, ...]:
        """See ``KVCache.snapshot_points``."""
        if self._services.has_live_states:
            return self._sorted_snapshot_points  # sorted once: an engine reads it every prefill step
        if self._scratch_enabled and any(group.life_cycle.window != NO_WINDOW for group in self.attention):
            # Scratch keeps no page for what a chunk leaves behind a window: a chunk ending at a declared prefix
            # end keeps the window before it, so later requests reuse up to there.
            return self._declared_points
        return ()  # nothing is snapshotted or discarded: a chunk need not stop anywhere

    def count_reuse(self, tally: ReuseTally | None = None, preempted: bool = False, lookup: bool = True) -> None:
        """Add this cache's reused and missed blocks to the statistics once it is surely created: now, or as ``tally``
        counted them when it opened (a batch admits after allocating); a readmission's (``preempted``) apart from new
        requests'; none at all for a cache that is no lookup (``lookup`` False: a save of rows the engine has)."""
        if not lookup:
            return
        if tally is None:
            tally = self.reuse_tally()
        stats = self._services.store.stats
        reused_length = tally.reused_length
        missed = tally.missed
        for counted in tally.groups:
            total = stats[counted.layer_group_id]
            if preempted:
                total.preempted_reused_blocks += counted.reused_full_blocks + counted.reused_partial_blocks
                total.preempted_missed_blocks += counted.missed_blocks
            else:
                total.reused_full_blocks += counted.reused_full_blocks
                total.reused_partial_blocks += counted.reused_partial_blocks
                total.missed_blocks += counted.missed_blocks
        self._services.ssm_snapshots.record_lookup(self._prompt_length, reused_length, preempted)
        self.lookup_pending = self._prompt_length > 0
        request = self.request_stats
        if request is not None:
            reused = ceil_div(reused_length, self._services.tokens_per_block)
            request.reused_blocks += reused
            request.alloc_total_blocks += reused
            request.missed_blocks += missed
        if self.has_pending_stats:
            self._services.pending_stats.add(self.id)

    def reuse_tally(self) -> ReuseTally:
        """What this just-opened cache reuses and misses, kept for ``count_reuse`` after a batch admission (which
        allocates first: counted then, new pages would read as reused)."""
        missed = max(0, self._prompt_blocks - ceil_div(self._capacity, self._services.tokens_per_block))
        groups = []
        for group in self.groups:
            counted = IterationStats(group.id)
            group.count_reuse(counted, missed)
            groups.append(counted)
        return ReuseTally(groups, missed, self._capacity)

    @property
    def has_pending_stats(self) -> bool:
        """Whether this cache counted statistics (a reuse lookup, request blocks) not yet committed or discarded
        (``KVCacheManager.get_dirty_stats_kv_cache_ids``)."""
        request = self.request_stats
        return self.lookup_pending or (request is not None and request != KVCacheStatsDelta())

    # ------------------------------------------------------------------------------------------- properties
    @property
    def status(self) -> KVCacheStatus:
        """See ``KVCache.status``."""
        return self._status

    @property
    def is_active(self) -> bool:
        """See ``KVCache.is_active``."""
        return self._status == KVCacheStatus.ACTIVE

    @property
    def num_committed_tokens(self) -> int:
        """See ``KVCache.num_committed_tokens``."""
        return self._committed

    @property
    def committed_tokens(self) -> list[Token]:
        """See ``KVCache.committed_tokens``."""
        result: list[Token] = []
        for block in self._blocks:
            result.extend(block.tokens)
        result.extend(self._tail)
        return result

    def known_tokens(self) -> list[Token]:
        """The tokens this cache's rows hold as far as the manager can tell: the committed ones, then the input tokens
        ``create_kv_cache`` was given past them (kept until the commits cover them), unless a commit parted from that
        input (whose rest is then no longer this cache's prompt). Rows past these are unknown."""
        committed = self.committed_tokens
        rest = self._input_rest
        begin = self._input_begin
        done = len(committed) - begin
        overlap = min(done, len(rest))
        if committed[begin : begin + overlap] != rest[:overlap]:
            return committed
        return committed + rest[done:]

    @property
    def reuse_scope(self) -> ReuseScope:
        """See ``KVCache.reuse_scope``."""
        scope = self._root.scope
        return ReuseScope() if scope is None else scope

    @property
    def num_blocks(self) -> int:
        """See ``KVCache.num_blocks``."""
        return ceil_div(self._capacity, self._services.tokens_per_block)

    @property
    def beam_width(self) -> int:
        """See ``KVCache.beam_width``."""
        return 1

    @property
    def is_committing_stopped(self) -> bool:
        """See ``KVCache.is_committing_stopped``."""
        return self._committing_stopped

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """See ``KVCache.enable_swa_scratch_reuse``."""
        return self._scratch_enabled

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, value: bool) -> None:
        self._check_open()
        if not isinstance(value, bool):
            raise TypeError(f"enable_swa_scratch_reuse must be a bool, got {value!r}")
        if value and not self._services.settings.scratch_reuse:
            raise ValueError(
                "enable_swa_scratch_reuse can be turned on per cache only when "
                "KVCacheManagerConfig.enable_swa_scratch_reuse is on (the GPU split and the index modes depend on it)"
            )
        if not value and self.has_scratch_slots:
            raise ValueError(
                f"cannot turn scratch reuse off: cache {self.id} holds scratch blocks (scratch blocks are needed "
                "until the chunk using them is committed)"
            )
        self._scratch_enabled = value

    @property
    def has_scratch_slots(self) -> bool:
        """See ``KVCache.has_scratch_slots``."""
        for group in self.attention:
            begin, end = group.scratch_range
            if end > begin:
                return True
        return False

    def get_scratch_desc(self, layer_group_id: SupportsIndex) -> ScratchDesc | None:
        """See ``KVCache.get_scratch_desc``."""
        self._check_open()
        group = self.attention_group(self._check_layer_group(layer_group_id))
        if group is None:
            return None
        begin, end = group.scratch_range
        if end <= begin:
            return None
        slots = tuple(page.slot for page in group.scratch_pages) if self.is_active else ()
        return ScratchDesc(HalfOpenRange(begin, end), slots)

    def get_ssm_block_base_index(self, layer_group_id: SupportsIndex, beam: SupportsIndex = DEFAULT_BEAM_INDEX) -> int:
        """See ``KVCache.get_ssm_block_base_index``."""
        self._check_open()
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam, "beam")
        group = self.ssm_group(lc)
        if group is None:
            raise ValueError(f"layer_group_id {lc} is not an SSM layer group")
        live = group.live
        if live is None or not self.is_active:
            return BAD_PAGE_INDEX
        return live.slot

    def get_num_front_blocks_removed(self, layer_group_id: SupportsIndex) -> int:
        """See ``KVCache.get_num_front_blocks_removed``."""
        self._check_open()
        begin, end = self.stale_range(self._check_layer_group(layer_group_id))
        return end - begin

    def stale_range(self, lc: int) -> tuple[int, int]:
        """The block ordinals of layer group ``lc`` that the current history leaves stale (window passed)."""
        return self._services.life_cycles[lc].stale(self._history)

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """See ``KVCache.supports_index_mode``."""
        if not isinstance(mode, PageIndexMode):
            raise TypeError(f"mode must be a PageIndexMode, got {mode!r}")
        return mode == PageIndexMode.PER_LAYER or not self.has_scratch_slots

    # ------------------------------------------------------------------------------------------- page tables
    def get_base_page_indices(
        self, layer_group_id: SupportsIndex, beam_id: SupportsIndex = DEFAULT_BEAM_INDEX
    ) -> array[int]:
        """See ``KVCache.get_base_page_indices``."""
        self._check_open()
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam_id, "beam_id")
        return self.groups[lc].page_indices(self.num_blocks)

    def set_base_page_index_buf(
        self, beam_idx: SupportsIndex, layer_group_id: SupportsIndex, buf: Int32Buffer | None
    ) -> None:
        """See ``KVCache.set_base_page_index_buf``."""
        self._check_open()
        self._check_beam(beam_idx, "beam_idx")
        lc = self._check_layer_group(layer_group_id)
        if buf is None:
            self.groups[lc].user_buffer = None
            return
        try:
            view = memoryview(cast(Any, buf))  # a NumPy array has no typed __buffer__ before Python 3.12
        except TypeError:
            raise TypeError(f"buf must support the buffer protocol, got {type(buf).__name__}") from None
        if view.readonly:
            raise ValueError("buf must be writable")
        if view.ndim != 1 or view.itemsize != 4 or view.format.lstrip("@=<") not in ("i", "l"):
            raise ValueError(f"buf must be a 1-D int32 buffer, got format {view.format!r} with ndim {view.ndim}")
        if not view.c_contiguous:
            raise ValueError(f"buf must be contiguous (the manager writes it in place), got strides {view.strides}")
        view = view.cast("B").cast("i")
        if len(view) < self.num_blocks:
            raise ValueError(f"len(buf) is {len(view)}, fewer than num_blocks {self.num_blocks} of cache {self.id}")
        self.groups[lc].user_buffer = view
        self.groups[lc].write_buffer(0, len(view))

    def held_pages(self) -> list[Page]:
        """Every page this cache holds a count on: block entries, copy-on-write and SSM sources, scratch slots and
        live SSM states (a freshly created cache has neither of the last two)."""
        result = entries_by_block(self.attention, self._history, stale_too=True)
        for group in self.attention:
            if group.cow_source is not None:
                result.append(group.cow_source)
        for ssm in self.ssm:
            if ssm.source is not None:
                result.append(ssm.source)
        for group in self.attention:
            result.extend(group.scratch_pages)
        for ssm in self.ssm:
            if ssm.live is not None:
                result.append(ssm.live)
        return result

    def live_entries(self) -> list[Page]:
        """Entries that are locked while active (everything outside the stale range, live SSM states), in block
        order (``entries_by_block``)."""
        result = entries_by_block(self.attention, self._history)
        for ssm in self.ssm:
            if ssm.live is not None:
                result.append(ssm.live)
        return result

    def attention_group(self, lc: int) -> AttentionState | None:
        """Layer group ``lc``'s state if it is an attention group."""
        for group in self.attention:
            if group.id == lc:
                return group
        return None

    def ssm_group(self, lc: int) -> SsmState | None:
        """Layer group ``lc``'s state if it is the SSM group."""
        for group in self.ssm:
            if group.id == lc:
                return group
        return None

    def _note_history(self) -> None:
        """``_history`` moved by a full step: how far it may now move with every stale range unchanged."""
        history = self._history
        below = NEVER
        for group in self.groups:
            below = min(below, group.life_cycle.stale_steady_below(history))
        self._steady_below = below

    def _priority(self, ordinal: int, lc: int) -> int:
        return ask_priority(self._priority_callback, ordinal, self._services.life_cycles[lc])

    def _check_open(self) -> None:
        if self._status == KVCacheStatus.CLOSED:
            raise ValueError(f"cache {self.id} is closed")

    def _check_active(self, operation: str) -> None:
        self._check_open()
        if self._status != KVCacheStatus.ACTIVE:
            raise ValueError(f"{operation} needs an active cache; cache {self.id} is suspended (call resume first)")

    def _check_layer_group(self, layer_group_id: SupportsIndex) -> int:
        return as_index(layer_group_id, "layer_group_id", len(self._services.life_cycles))

    @staticmethod
    def _check_beam(beam: SupportsIndex, name: str) -> None:
        if type(beam) is int and beam == DEFAULT_BEAM_INDEX:
            return
        value = as_int(beam, name)
        if value != DEFAULT_BEAM_INDEX:
            raise ValueError(f"{name} {value} out of range: beam width is 1")

    def __repr__(self) -> str:
        return (
            f"CacheState(id={self.id}, status={self._status.name}, capacity={self._capacity}, "
            f"history_length={self._history}, num_committed_tokens={self._committed})"
        )
