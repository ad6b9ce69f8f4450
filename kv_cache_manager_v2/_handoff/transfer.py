"""What a prefill -> decode handoff sends (``KVSlice``) and the plan that moves it (``TransferPlan``: picklable
copy descriptors and per-layer-group summaries), and the sender's half of a plan made across processes
(``SourcePlan``). ``disagg`` makes and executes plans; these are its records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import SupportsIndex, final

from .._cache.kv_cache import CacheState
from .._manager.manager import KVCacheManager
from .._base.types import HalfOpenRange, Sealed
from .._pages.page import Page
from .._base.validation import as_index, as_int

# --------------------------------------------------------------------------------------------------- what is sent


@final
class KVSlice(Sealed):
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
        """Tokens of the whole prompt, of which this slice sends ``token_range``."""
        return self._prompt_len

    @property
    def token_range(self) -> HalfOpenRange:
        """The prompt's tokens this slice sends, ``[beg, end)``."""
        return self._token_range

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KVSlice)
            and other.prompt_len == self._prompt_len
            and other.token_range == self._token_range
        )

    def __hash__(self) -> int:
        return hash((self._prompt_len, self._token_range.beg, self._token_range.end))

    def __repr__(self) -> str:
        return f"KVSlice(prompt_len={self._prompt_len}, token_range=[{self._token_range.beg}, {self._token_range.end}))"

    def __reduce__(self) -> tuple[type[KVSlice], tuple[int, HalfOpenRange]]:
        return (KVSlice, (self._prompt_len, self._token_range))


# ------------------------------------------------------------------------------------------------ plan records


@final
@dataclass(frozen=True)
class TransferDescriptor(Sealed):
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


@final
@dataclass(frozen=True)
class GroupTransfer(Sealed):
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


# Per (layer group, block) a local plan moves (block -1: an SSM live state): the sender's page, its generation, the
# receiver's page, its generation (-1 where no page), as at planning (``plan.stamp_pages``).
PageStamps = dict[tuple[int, int], tuple[Page | None, int, Page | None, int]]


@final
class LocalEndpoints(Sealed):
    """The live objects a plan was made from, for a local ``execute`` (never pickled), and what ``execute`` checks
    they still are: the sender's history then (its SSM live state is the state there), every page moved with its
    generation (``plan.check_pages``: a slot number alone cannot tell a page from a later content of its slot) and
    whether the plan ran. It keeps each cache's state, as the manager does, never its handle: a plan an engine
    still holds must not keep a dropped handle's cache open (the manager closes it at its next call, and
    ``execute`` then refuses)."""

    def __init__(
        self,
        src_manager: KVCacheManager,
        src_state: CacheState,
        dst_manager: KVCacheManager,
        dst_state: CacheState,
        stamps: PageStamps,
    ) -> None:
        self.src_manager = src_manager
        self.src_state = src_state
        self.dst_manager = dst_manager
        self.dst_state = dst_state
        self.src_history: int = src_state.history_length
        self.stamps = stamps
        self.executed = False


def endpoints_of(plan: TransferPlan) -> LocalEndpoints | None:
    """The caches and managers a local plan was made from; None once unpickled (internal API: ``execute``)."""
    return plan._endpoints


@final
class TransferPlan(Sealed):
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
        endpoints: LocalEndpoints | None = None,
    ) -> None:
        self._kv_slice = kv_slice
        self._tokens_per_block = tokens_per_block
        self._groups = groups
        self._descriptors = descriptors
        self._endpoints = endpoints

    @property
    def kv_slice(self) -> KVSlice:
        """The slice of the prompt this plan copies."""
        return self._kv_slice

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block of both managers (a plan needs them equal)."""
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
        """How many copies the plan makes (``len(descriptors)``)."""
        return len(self._descriptors)

    @property
    def total_bytes(self) -> int:
        """Bytes every descriptor copies, added up."""
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
        """Bytes copied for each layer group, indexed by ``LayerGroupId``."""
        return [group.num_bytes for group in self._groups]

    @property
    def is_local(self) -> bool:
        """Whether ``execute`` can run this plan here (it was planned in this process, not unpickled)."""
        return self._endpoints is not None

    def descriptors_of(self, layer_group: SupportsIndex) -> list[TransferDescriptor]:
        """The descriptors copying one layer group's pages, in plan order."""
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


# ------------------------------------------------------------------------------------- the sender's half of a plan


@final
@dataclass(frozen=True)
class SourceBlock(Sealed):
    """One slot the sender offers: ``num_bytes`` at ``src_address`` (pool base + ``src_slot * num_bytes`` of the
    sender's GPU tier), block ``block`` of layer group ``layer_group`` (-1: the SSM live state)."""

    layer_group: int
    block: int
    pool_group: int
    pool: int
    src_slot: int
    num_bytes: int
    src_address: int

    def __reduce__(self) -> tuple[type[SourceBlock], tuple[int, int, int, int, int, int, int]]:
        return (
            SourceBlock,
            (self.layer_group, self.block, self.pool_group, self.pool, self.src_slot, self.num_bytes, self.src_address),
        )


@final
@dataclass(frozen=True, repr=False)
class SourcePlan(Sealed):
    """What the prefill side sends across processes (``disagg.plan_source``): the slice, the per-group summaries,
    the source slots of every needed block (``sources``: grouped by layer group, then block, then pool) and
    ``prompt_key``, the chained block key of the tokens the sent rows were computed for (``[0, token_range.end)``
    under the sender's reuse scope); the decode side checks that key against its own cache's and pairs the sources
    with its own slots (``disagg.complete_plan``) into a ``TransferPlan``. Plain data: it pickles."""

    kv_slice: KVSlice
    tokens_per_block: int
    groups: tuple[GroupTransfer, ...]
    sources: tuple[SourceBlock, ...]
    prompt_key: bytes

    def __repr__(self) -> str:
        return f"SourcePlan({self.kv_slice!r}, num_sources={len(self.sources)})"

    def __reduce__(
        self,
    ) -> tuple[type[SourcePlan], tuple[KVSlice, int, tuple[GroupTransfer, ...], tuple[SourceBlock, ...], bytes]]:
        return (SourcePlan, (self.kv_slice, self.tokens_per_block, self.groups, self.sources, self.prompt_key))
