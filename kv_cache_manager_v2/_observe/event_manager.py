"""KV cache events in TensorRT-LLM's shape, for KV-aware routers: ``KVCacheEventManager`` and ``KVCacheEvent``.

A manager built with an event manager reports every block page stored in the radix tree, removed from it, or
updated (moved to another tier), per layer group: the three kinds of ``KVEvent.kind``, under the same names. The engine calls ``flush_iteration_events`` once per iteration; a reader
(possibly another thread) takes flushed events with ``get_latest_events``. Events keep everything a router or a
wire format needs: the block key and its parent's, the tokens (multimodal digests as ``mm_keys``), the tier
level and its kind of memory, the layer group with its kind and window, and the reuse scope.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Final, Literal, Mapping, Sequence, SupportsFloat, SupportsIndex, Union, final

from mypy_extensions import mypyc_attr

from .events import REMOVED, STORED, KVEvent
from .._base.hashing import MultimodalDigest, ReuseScope
from .._base.interrupts import DeferredInterrupts, drop_frames
from .._model.life_cycle import LifeCycle
from .._base.types import CacheTier, FrozenValue
from .._base.validation import as_int, as_non_negative_int, as_optional_int, is_real_number

HASH_ALGO: Final = "sha256"
# Kinds of layer group, as a router distinguishes them.
# A layer group's kind as events carry it (``KVCacheEvent.layer_group_kind``): a Literal, so a consumer's
# comparisons are checked; exported as ``LayerGroupKind`` with ``LAYER_GROUP_FULL_ATTENTION`` / ``_SLIDING_WINDOW``
# / ``_SSM``.
LayerGroupKind = Literal["full_attention", "sliding_window", "ssm"]
FULL_ATTENTION: Final = "full_attention"
SLIDING_WINDOW: Final = "sliding_window"
SSM: Final = "ssm"
LAYER_GROUP_KINDS: Final[tuple[LayerGroupKind, ...]] = (FULL_ATTENTION, SLIDING_WINDOW, SSM)

# A token id in an event: a vocabulary id, or the hex of a multimodal digest.
EventTokenId = Union[int, str]
# A multimodal item in a block: (digest, position of the item's first token in the block, uuid).
MmKey = tuple[bytes, int, Union[str, None]]


@final
@dataclass(frozen=True)
class UniqueToken(FrozenValue):
    """One token of a stored block; ``token_extra_id`` tells apart equal ids of different multimodal items."""

    token_id: EventTokenId
    token_extra_id: int = 0


@final
@dataclass(frozen=True)
class KVCacheCreatedData(FrozenValue):
    """The manager was built: slots per cache level (summed over pool groups)."""

    num_blocks_per_cache_level: list[int]


@final
@dataclass(frozen=True)
class KVCacheStoredBlockData(FrozenValue):
    """One block whose page of a layer group entered the radix tree.

    ``medium``: the kind of memory of ``cache_level`` (``CacheTier`` name); ``lora_id`` and ``cache_salt``: the
    reuse scope the block belongs to (the salt as text, hex for bytes).
    """

    block_hash: bytes
    tokens: list[UniqueToken]
    cache_level: int
    priority: int
    mm_keys: list[MmKey] = field(default_factory=list)
    cache_salt: str | None = None
    medium: str = CacheTier.GPU_MEM.name
    lora_id: int | None = None


@final
@dataclass(frozen=True)
class KVCacheStoredData(FrozenValue):
    """Blocks stored as a chain: the first one's parent is ``parent_hash`` (None: a scope root's child)."""

    parent_hash: bytes | None
    blocks: list[KVCacheStoredBlockData]


@final
@dataclass(frozen=True)
class KVCacheRemovedData(FrozenValue):
    """Blocks whose page of the event's layer group left the radix tree."""

    block_hashes: list[bytes]


@final
@dataclass(frozen=True)
class KVCacheEventDiff(FrozenValue):
    old_value: int
    new_value: int


@final
@dataclass(frozen=True)
class KVCacheUpdatedData(FrozenValue):
    """A block's page changed tier (``cache_level``) or priority."""

    block_hash: bytes
    cache_level: KVCacheEventDiff | None
    priority: KVCacheEventDiff | None


EventData = Union[KVCacheCreatedData, KVCacheStoredData, KVCacheRemovedData, KVCacheUpdatedData]


@final
@dataclass(frozen=True)
class KVCacheEvent(FrozenValue):
    """One event; ``window_size`` is the layer group's sliding window (0: none), ``layer_group_kind`` one of
    ``full_attention``, ``sliding_window``, ``ssm`` (None for events about the whole manager)."""

    event_id: int
    data: EventData
    window_size: int
    hash_algo: str | None = None
    attention_dp_rank: int | None = None
    layer_group_id: int | None = None
    layer_group_kind: LayerGroupKind | None = None


AttentionDpGatherFn = Callable[[list[KVCacheEvent]], list[list[KVCacheEvent]]]


def _window_sizes(window_sizes: object, name: str) -> dict[int, int]:
    """Layer group id -> sliding window (0: none), both non-negative integers, checked whole before any is set (the
    constructor's ``window_size_by_layer_group`` and ``set_layer_group_window_sizes`` alike)."""
    if not isinstance(window_sizes, Mapping):
        raise TypeError(f"{name} must be a mapping of layer group id to window size, got {window_sizes!r}")
    checked: dict[int, int] = {}
    for group, size in window_sizes.items():
        layer_group = as_non_negative_int(group, f"{name} (layer group id)")
        checked[layer_group] = as_non_negative_int(size, f"{name}[{layer_group}]")
    return checked


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheEventManager:
    """Collects a manager's events; ``flush_iteration_events`` makes the events of an iteration visible to
    ``get_latest_events``, which may be called from another thread.

    ``max_kv_event_entries`` bounds the flushed events kept and those waiting for a flush (the oldest go first).
    With attention data parallelism, ``attention_dp_gather`` gathers every rank's events at flush; rank 0 (or a
    manager without a rank) keeps them all, the other ranks none. A gather that raises takes nothing: the events
    stay pending and go out with the next flush that succeeds.

    Subclasses may override the ``add_*_event`` hooks. A hook that raises while the manager records (in the
    middle of a commit, an eviction, a tier move) does not interrupt the manager: the call completes, every later
    event of it still reaches its hook (none is replayed or skipped), and the first such error is raised by the
    next ``flush_iteration_events``, after that flush delivered its events. The manager's state stays consistent;
    what the failing hook did with its own event is up to it.
    """

    def __init__(
        self,
        max_kv_event_entries: SupportsIndex,
        *,
        window_size: SupportsIndex = 0,
        attention_dp_rank: SupportsIndex | None = None,
        attention_dp_gather: AttentionDpGatherFn | None = None,
        hash_algo: str = HASH_ALGO,
        window_size_by_layer_group: dict[int, int] | None = None,
        mm_token_id_offset: SupportsIndex | None = None,
    ) -> None:
        entries = as_int(max_kv_event_entries, "max_kv_event_entries")
        if entries <= 0:
            raise ValueError(f"max_kv_event_entries must be > 0, got {entries}")
        if attention_dp_gather is not None and not callable(attention_dp_gather):
            raise TypeError(f"attention_dp_gather must be callable, got {attention_dp_gather!r}")
        self._window_size = as_non_negative_int(window_size, "window_size")
        # Checked as it came: compiled, narrowing it to int first would have unboxed True to 1.
        rank = as_optional_int(attention_dp_rank, "attention_dp_rank")
        if rank is not None and rank < 0:
            raise ValueError(f"attention_dp_rank must be >= 0 or None, got {rank}")
        self._rank = rank
        self._gather = attention_dp_gather
        if not isinstance(hash_algo, str):
            raise TypeError(f"hash_algo must be a str, got {hash_algo!r}")
        self._hash_algo = hash_algo
        self._windows: dict[int, int] = (
            {} if window_size_by_layer_group is None else _window_sizes(window_size_by_layer_group, "window_size_by_layer_group")
        )
        self._kinds: dict[int, LayerGroupKind] = {}
        self.mm_token_id_offset: int | None = as_optional_int(mm_token_id_offset, "mm_token_id_offset")
        # Events recorded since the last flush: a flush delivers only the newest ``entries`` anyway (``_ready``'s
        # bound, also for a gather's concatenation), so no more wait (never flushed, a gather failing for good).
        self._pending: deque[KVCacheEvent] = deque(maxlen=entries)
        self._ready: deque[KVCacheEvent] = deque(maxlen=entries)
        self._ready_signal = threading.Condition()
        # Managers recording into these events, and whether the last one shut down: then no flush will come, so
        # nobody waits (with no manager ever built on it, the user flushes and readers wait as they ask).
        self._feeders = 0
        self._feed_ended = False
        self._next_id = 0
        self._hook_error: Exception | None = None

    # ------------------------------------------------------------------------------------------- recording
    def set_layer_group_window_sizes(self, window_sizes: dict[int, int]) -> None:
        """Sliding window (0: none) of each layer group, stamped on that group's events."""
        self._windows.update(_window_sizes(window_sizes, "window_sizes"))

    def set_layer_group_kinds(self, kinds: Mapping[int, LayerGroupKind]) -> None:
        """Kind of each layer group (``full_attention``, ``sliding_window``, ``ssm``), stamped on its events; an
        unknown kind is refused before any is set."""
        if not isinstance(kinds, Mapping):
            raise TypeError(f"kinds must be a mapping of layer group id to kind, got {kinds!r}")
        checked = {as_int(group, "kinds (layer group)"): kind for group, kind in kinds.items()}
        for kind in checked.values():
            if kind not in LAYER_GROUP_KINDS:
                raise ValueError(f"kinds: unknown layer group kind {kind!r}, expected one of {LAYER_GROUP_KINDS}")
        self._kinds.update(checked)

    def add_created_event(self, num_blocks_per_cache_level: Sequence[int], layer_group_ids: Sequence[int] | None = None) -> None:
        """The manager was built (one event per layer group when ``layer_group_ids`` is given)."""
        data = KVCacheCreatedData([as_int(count, "num_blocks_per_cache_level") for count in num_blocks_per_cache_level])
        if layer_group_ids is None:
            self._add(data, None)
        else:
            for group in layer_group_ids:
                self._add(data, as_int(group, "layer_group_ids"))

    def add_stored_event(
        self, parent_hash: bytes | None, blocks: Sequence[KVCacheStoredBlockData], layer_group_id: int | None = None
    ) -> None:
        """Blocks (a chain after ``parent_hash``) whose page of a layer group entered the radix tree."""
        self._add(KVCacheStoredData(parent_hash, list(blocks)), layer_group_id)

    def add_removed_event(self, block_hashes: bytes | Sequence[bytes], layer_group_id: int | None = None) -> None:
        """Blocks whose page of a layer group left the radix tree (dropped)."""
        hashes = [block_hashes] if isinstance(block_hashes, bytes) else list(block_hashes)
        self._add(KVCacheRemovedData(hashes), layer_group_id)

    def add_updated_event(
        self,
        block_hash: bytes,
        *,
        cache_level: KVCacheEventDiff | None = None,
        priority: KVCacheEventDiff | None = None,
        layer_group_id: int | None = None,
    ) -> None:
        """A block's page of a layer group moved to another tier or got another priority."""
        self._add(KVCacheUpdatedData(block_hash, cache_level, priority), layer_group_id)

    def _add(self, data: EventData, layer_group_id: int | None) -> None:
        window = self._window_size if layer_group_id is None else self._windows.get(layer_group_id, self._window_size)
        kind = None if layer_group_id is None else self._kinds.get(layer_group_id)
        self._pending.append(
            KVCacheEvent(self._next_id, data, window, self._hash_algo, self._rank, layer_group_id, kind)
        )
        self._next_id += 1

    # ------------------------------------------------------------------------------------------- delivery
    def flush_iteration_events(self) -> None:
        """Make the events recorded since the last flush visible to ``get_latest_events`` (the scheduler
        thread calls it once per iteration). Raises what ``attention_dp_gather`` raised (nothing taken, the events
        wait for the next flush), or after delivering, the first error a hook raised since the last flush."""
        taken = list(self._pending)
        pending = taken
        if self._gather is not None:
            gathered = self._gather(list(taken))
            pending = [event for rank_events in gathered for event in rank_events] if self._rank in (None, 0) else []
        if taken:  # by id: a hook recording during the gather may have pushed taken ones out of the bound
            last_taken = taken[-1].event_id
            while self._pending and self._pending[0].event_id <= last_taken:
                self._pending.popleft()
        with self._ready_signal:
            self._ready.extend(pending)
            if pending:
                self._ready_signal.notify_all()
        error, self._hook_error = self._hook_error, None
        if error is not None:
            raise error

    def check_feed(self, window_sizes: Mapping[int, int], kinds: Mapping[int, LayerGroupKind]) -> None:
        """Refuse (``ValueError``) a manager about to feed these events whose layer groups another live feeder stamps
        with another window or kind: both number their groups from 0, so one would relabel the other's events (a
        router would read an SSM group's blocks as attention blocks). Its construction calls this first."""
        if self._feeders == 0:
            return
        for group, kind in kinds.items():
            known_kind, known_window = self._kinds.get(group), self._windows.get(group)
            window = window_sizes.get(group, 0)
            if (known_kind is not None and known_kind != kind) or (known_window is not None and known_window != window):
                raise ValueError(
                    f"this event manager already has a live manager whose layer group {group} is {known_kind} "
                    f"(window {known_window}); this one's is {kind} (window {window}): give each model's managers "
                    f"their own KVCacheEventManager"
                )

    def begin_feed(self) -> None:
        """A manager now records into these events (its construction calls this): readers may wait again."""
        with self._ready_signal:
            self._feeders += 1
            self._feed_ended = False

    def end_feed(self) -> None:
        """A manager recording into these events shut down (its ``shutdown`` calls this). Once the last one has,
        no flush will come, so a reader waiting (even without limit, on a thread an engine joins at exit) returns
        now, and later reads take what is there without waiting."""
        with self._ready_signal:
            self._feeders = max(0, self._feeders - 1)
            if self._feeders == 0:
                self._feed_ended = True
                self._ready_signal.notify_all()

    def get_latest_events(self, timeout_ms: SupportsFloat | None = None) -> list[KVCacheEvent]:
        """The flushed events not yet taken, oldest first; when there is none, waits up to ``timeout_ms`` for a
        flush that brings one (None or <= 0: no wait; ``math.inf``: no limit). A reader woken by a flush whose
        events another reader took waits on for the rest of its time; none waits once the feeding managers shut down
        (``end_feed``). (``SupportsFloat``, not ``float``: compiled,
        a ``float`` parameter would take ``True`` as 1.0 before the check could refuse it.)"""
        wait_s = _wait_seconds(timeout_ms)
        with self._ready_signal:
            if wait_s != 0.0:
                self._ready_signal.wait_for(self._has_ready_or_ended, wait_s)
            events = list(self._ready)
            self._ready.clear()
        return events

    def _has_ready_or_ended(self) -> bool:
        return len(self._ready) > 0 or self._feed_ended


def _wait_seconds(timeout_ms: object) -> float | None:
    """``get_latest_events``' wait in seconds: 0.0 for none, None for no limit (also past what a lock can wait)."""
    if timeout_ms is None:
        return 0.0
    if not is_real_number(timeout_ms):
        raise TypeError(f"timeout_ms must be a number of milliseconds or None, got {timeout_ms!r}")
    try:
        milliseconds = float(timeout_ms)  # type: ignore[arg-type]
    except (OverflowError, ValueError):  # Fraction(10**400) (ms: no limit would do) or Decimal('sNaN')
        raise ValueError(f"timeout_ms must be a number of milliseconds or None, got {timeout_ms!r}") from None
    if math.isnan(milliseconds):
        raise ValueError(f"timeout_ms must be a number of milliseconds or None, got {timeout_ms!r}")
    if milliseconds <= 0:
        return 0.0
    seconds = milliseconds / 1000.0
    return None if seconds >= threading.TIMEOUT_MAX else seconds


def layer_group_kind(life_cycle: LifeCycle) -> LayerGroupKind:
    if life_cycle.is_ssm:
        return SSM
    return FULL_ATTENTION if life_cycle.window_size is None else SLIDING_WINDOW


def note_hook_error(event_manager: KVCacheEventManager, error: Exception) -> None:
    """A hook of ``event_manager`` raised while the manager recorded: its next flush raises the first such error
    (internal API: ``EventBridge``; not a name on the public class)."""
    if event_manager._hook_error is None:
        event_manager._hook_error = error
        drop_frames(error)  # kept until a flush that may never come: its frames would keep the manager alive


class EventBridge:
    """Turns the page store's per-page events into ``KVCacheEventManager`` calls for one manager."""

    def __init__(self, target: KVCacheEventManager, tiers: list[CacheTier], interrupts: DeferredInterrupts) -> None:
        self._target = target
        self._interrupts = interrupts
        self._mediums = [tier.name for tier in tiers]

    def record(self, event: KVEvent, previous_level: int) -> None:
        """Hand ``event`` to its hook; a hook's error is kept for the next flush, never raised into the manager's
        call (which is in the middle of changing its state); an interrupt comes out at the call's end."""
        try:
            self._forward(event, previous_level)
        except Exception as error:
            note_hook_error(self._target, error)
        except BaseException as error:
            self._interrupts.defer(error)

    def _forward(self, event: KVEvent, previous_level: int) -> None:
        target = self._target
        if event.kind == STORED:
            block = KVCacheStoredBlockData(
                event.block_hash,
                [_unique_token(token) for token in event.tokens],
                event.level,
                event.priority,
                _mm_keys(event),
                _salt_text(event.scope),
                self._mediums[event.level],
                None if event.scope is None else event.scope.lora_id,
            )
            target.add_stored_event(event.parent_hash, [block], event.layer_group_id)
        elif event.kind == REMOVED:
            target.add_removed_event(event.block_hash, event.layer_group_id)
        else:
            target.add_updated_event(
                event.block_hash,
                cache_level=KVCacheEventDiff(previous_level, event.level),
                layer_group_id=event.layer_group_id,
            )


def _unique_token(token: int | bytes) -> UniqueToken:
    if isinstance(token, bytes):
        return UniqueToken(token.hex(), 1)
    return UniqueToken(token)


def _mm_keys(event: KVEvent) -> list[MmKey]:
    keys: list[MmKey] = []
    for position, token in enumerate(event.tokens):
        if isinstance(token, bytes):
            uuid = token.uuid if isinstance(token, MultimodalDigest) else None
            keys.append((bytes(token), position, uuid))
    return keys


def _salt_text(scope: ReuseScope | None) -> str | None:
    if scope is None or scope.salt is None:
        return None
    salt = scope.salt
    if isinstance(salt, bytes):
        return salt.hex()
    return str(salt)
