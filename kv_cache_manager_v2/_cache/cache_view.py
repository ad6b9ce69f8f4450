"""A cache's read side: what ``CacheState`` holds (lengths, status, committed blocks, one ``GroupState`` per layer
group) and what the engine reads of it (page tables, scratch descriptors, SSM slots). ``CacheState`` (``_kv_cache.py``)
adds every call that changes state."""

from __future__ import annotations

import enum
from array import array
from typing import TYPE_CHECKING, SupportsIndex

from .._model.addressing import ScratchDesc
from .group_state import GroupState, new_group_state
from .._base.hashing import ReuseScope, Token
from .._model.life_cycle import NEVER, ceil_div
from .._pages.page import Page
from .._pages.prefix_match import Match
from .._pages.priority import PriorityCallback, ask_priority
from .._pages.page import Block
from .services import CacheServices
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
        self._tail: list[Token] = tokens[len(self._blocks) * tpb : length]
        self._scratch_enabled = settings.scratch_reuse
        num_blocks = ceil_div(length, tpb)
        store = services.store
        # The pages of each layer group (internal: read by the manager's other modules, never by users).
        self.groups: list[GroupState] = [
            new_group_state(life_cycle, services.pool_group_of[life_cycle.id], store, services.layout, num_blocks)
            for life_cycle in services.life_cycles
        ]
        self._root.users += 1
        for block in self._blocks:
            block.users += 1
        for group in self.groups:
            group.adopt(self._blocks, match.partial_source, length)
        self._prompt_blocks = ceil_div(len(tokens), tpb)
        self._prompt_length = len(tokens)
        self._tpb = tpb
        # Histories below this leave every group's stale range as it is at ``_history`` (the decode fast paths).
        self._steady_below = 0
        self._note_history()
        # Blocks this request reused, missed and allocated, when the engine asked for them (enable_request_stats).
        self.request_stats: KVCacheStatsDelta | None = None

    def count_reuse(self) -> None:
        """Add this cache's reused and missed blocks to the iteration statistics (once it is surely created)."""
        stats = self._services.store.stats
        missed = max(0, self._prompt_blocks - ceil_div(self._capacity, self._services.tokens_per_block))
        for group in self.groups:
            group.count_reuse(stats[group.id], missed)
        self._services.ssm_snapshots.record_lookup(self._prompt_length, self._capacity)
        request = self.request_stats
        if request is not None:
            reused = ceil_div(self._capacity, self._services.tokens_per_block)
            request.reused_blocks += reused
            request.alloc_total_blocks += reused
            request.missed_blocks += missed

    # ------------------------------------------------------------------------------------------- properties
    @property
    def status(self) -> KVCacheStatus:
        """ACTIVE (pages locked on the GPU), SUSPENDED or CLOSED."""
        return self._status

    @property
    def is_active(self) -> bool:
        """Whether the status is ACTIVE."""
        return self._status == KVCacheStatus.ACTIVE

    @property
    def num_committed_tokens(self) -> int:
        """Finalised tokens, the reused prefix included; their full blocks are in the radix tree, reusable."""
        return self._committed

    @property
    def committed_tokens(self) -> list[Token]:
        """The committed tokens (reused prefix included), oldest first."""
        result: list[Token] = []
        for block in self._blocks:
            result.extend(block.tokens)
        result.extend(self._tail)
        return result

    @property
    def reuse_scope(self) -> ReuseScope:
        """The scope this cache matches and publishes blocks in."""
        scope = self._root.scope
        return ReuseScope() if scope is None else scope

    @property
    def num_blocks(self) -> int:
        """Blocks that ``capacity`` spans: the length of each layer group's page table."""
        return ceil_div(self._capacity, self._services.tokens_per_block)

    @property
    def beam_width(self) -> int:
        """Always 1: beam search is not supported."""
        return 1

    @property
    def is_committing_stopped(self) -> bool:
        """Whether ``stop_committing`` was called."""
        return self._committing_stopped

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether this cache puts out-of-window blocks of a prefill chunk in shared scratch slots."""
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
            raise ValueError(f"cannot turn scratch reuse off: cache {self.id} holds scratch blocks")
        self._scratch_enabled = value

    @property
    def has_scratch_slots(self) -> bool:
        """Whether any layer group holds shared scratch blocks now (then only PER_LAYER indices are valid)."""
        for group in self.groups:
            begin, end = group.scratch_range
            if end > begin:
                return True
        return False

    def get_scratch_desc(self, layer_group_id: SupportsIndex) -> ScratchDesc | None:
        """Scratch blocks of a layer group and their slots; None when the group has no scratch blocks now."""
        lc = self._check_layer_group(layer_group_id)
        group = self.groups[lc]
        begin, end = group.scratch_range
        if end <= begin:
            return None
        slots = tuple(page.slot for page in group.scratch_pages) if self.is_active else ()
        return ScratchDesc(HalfOpenRange(begin, end), slots)

    def get_ssm_block_base_index(self, layer_group_id: SupportsIndex, beam: SupportsIndex = DEFAULT_BEAM_INDEX) -> int:
        """GPU slot of this cache's live state of an SSM layer group (``BAD_PAGE_INDEX`` while suspended)."""
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam, "beam")
        group = self.groups[lc]
        if not group.has_live_state:
            raise ValueError(f"layer group {lc} is not an SSM layer group")
        live = group.live_state
        if live is None or not self.is_active:
            return BAD_PAGE_INDEX
        return live.slot

    def get_num_front_blocks_removed(self, layer_group_id: SupportsIndex) -> int:
        """Leading non-sink blocks without a page (stale), for window-local tables' ``kv_page_offset``."""
        begin, end = self.stale_range(self._check_layer_group(layer_group_id))
        return end - begin

    def stale_range(self, lc: int) -> tuple[int, int]:
        """The block ordinals of layer group ``lc`` that the current history leaves stale (window passed)."""
        return self._services.life_cycles[lc].stale(self._history)

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER always; SHARED only while this cache has no scratch blocks."""
        if not isinstance(mode, PageIndexMode):
            raise TypeError(f"mode must be a PageIndexMode, got {mode!r}")
        return mode == PageIndexMode.PER_LAYER or not self.has_scratch_slots

    # ------------------------------------------------------------------------------------------- page tables
    def get_base_page_indices(
        self, layer_group_id: SupportsIndex, beam_id: SupportsIndex = DEFAULT_BEAM_INDEX
    ) -> array[int]:
        """Slot id of each block's GPU page (block ordinal order), ``BAD_PAGE_INDEX`` where there is none."""
        self._check_open()
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam_id, "beam_id")
        return array("i", self.groups[lc].indices)

    def set_base_page_index_buf(
        self, beam_idx: SupportsIndex, layer_group_id: SupportsIndex, buf: Int32Buffer | None
    ) -> None:
        """Register a writable 1-D int32 buffer the manager keeps equal to the base page indices.

        It stays registered until replaced (``None`` unregisters) or the cache closes, and is rewritten on every
        change: while the cache is suspended or after it closes every entry is ``BAD_PAGE_INDEX`` (-1), as are
        the entries past the last block.
        """
        self._check_open()
        self._check_beam(beam_idx, "beam_idx")
        lc = self._check_layer_group(layer_group_id)
        if buf is None:
            self.groups[lc].user_buffer = None
            return
        try:
            view = memoryview(buf)  # type: ignore[arg-type]  # NumPy < Python 3.12 types no __buffer__
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
            raise ValueError(f"buf holds {len(view)} entries, fewer than the {self.num_blocks} blocks of cache {self.id}")
        self.groups[lc].user_buffer = view
        self.groups[lc].write_buffer(0, len(view))

    def held_pages(self) -> list[Page]:
        """Every page this cache holds a count on: block entries, copy-on-write and SSM sources, scratch slots and
        live SSM states (a freshly created cache has neither of the last two)."""
        result: list[Page] = []
        for group in self.groups:
            group.collect_entries(result)
        for group in self.groups:
            if group.cow_source is not None:
                result.append(group.cow_source)
        for group in self.groups:
            if group.snapshot_source is not None:
                result.append(group.snapshot_source)
        for group in self.groups:
            result.extend(group.scratch_pages)
        for group in self.groups:
            if group.live_state is not None:
                result.append(group.live_state)
        return result

    def live_entries(self) -> list[Page]:
        """Entries that are locked while active (everything outside the stale range, live SSM states)."""
        result: list[Page] = []
        for group in self.groups:
            group.collect_live_entries(self._history, result)
        for group in self.groups:
            if group.live_state is not None:
                result.append(group.live_state)
        return result

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
        value = as_int(beam, name)
        if value != DEFAULT_BEAM_INDEX:
            raise ValueError(f"{name} {value} out of range: beam width is 1")

    def __repr__(self) -> str:
        return (
            f"CacheState(id={self.id}, status={self._status.name}, capacity={self._capacity}, "
            f"history_length={self._history}, num_committed_tokens={self._committed})"
        )
