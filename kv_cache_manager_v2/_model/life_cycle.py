"""Life cycles: one class per kind of layer behaviour (full attention, windowed attention, SSM).

Layers that behave identically share a life cycle (= layer group). Each kind owns its formulas: which blocks are
stale (out of the window, sinks kept), which blocks of a prefill chunk are scratch, and how many GPU pages a cache needs.
"""

from __future__ import annotations

from typing import Final, Sequence, final

from .._base.types import HalfOpenRange, LayerGroupId, LayerId, Sealed
from .._base.wording import counted
from ..config import AttentionLayerConfig, LayerConfig

NO_WINDOW: Final = -1
# A history no cache reaches: "the stale range never changes again".
NEVER: Final = 1 << 62
# The registry's grouping key of SSM layers: no attention layer has a negative sink count.
SSM_GROUP: Final = (NO_WINDOW, -1)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stale_range(history: int, tokens_per_block: int, window: int, num_sink_blocks: int) -> tuple[int, int]:
    """Blocks ``[start, end)`` that hold no GPU page at ``history``; ``window == NO_WINDOW``: none.

    The step always has a query at position ``history``, so the live window is ``[history + 1 - W, history]``.
    Example (tpb 32, W 128, 1 sink block): history 1000 -> start 1, end (1001 - 128) // 32 = 27 -> [1, 27).
    """
    start = min(ceil_div(history, tokens_per_block), num_sink_blocks)
    if window == NO_WINDOW:
        return start, start
    return start, max(start, (history + 1 - window) // tokens_per_block)


def outside(stale: tuple[int, int], num_blocks: int) -> list[range]:
    """The block ordinals below ``num_blocks`` outside a ``stale`` range, in order (sinks, then window): per-block
    loops walk these, as a long window's block table is empty between them (a Python loop: ~1 us a block)."""
    beg = max(0, min(stale[0], num_blocks))
    end = min(max(stale[1], beg), num_blocks)
    return [range(0, beg), range(end, num_blocks)]


def scratch_range(
    history: int, capacity: int, max_rewind_len: int, tokens_per_block: int, window: int, num_sink_blocks: int
) -> tuple[int, int]:
    """Blocks of the chunk ``[history, capacity)`` that are out of window once the chunk ends.

    = stale(max(0, capacity - max_rewind_len)) ∩ [ceil(history/tpb), ceil(capacity/tpb)).
    Headline example (tpb 32, W 128, no sinks): history 0, capacity 1024 -> stale(1024) = [0, 28) -> [0, 28).
    """
    if window == NO_WINDOW:
        return 0, 0
    s_beg, s_end = stale_range(max(0, capacity - max_rewind_len), tokens_per_block, window, num_sink_blocks)
    beg = max(s_beg, ceil_div(history, tokens_per_block))
    end = min(s_end, ceil_div(capacity, tokens_per_block))
    return (beg, end) if beg < end else (beg, beg)


class LifeCycle(Sealed):
    """Behaviour shared by a set of layers; subclasses fix the kind. Read-only once the registry has built it: a
    ``custom_priority_callback`` is handed the manager's own object, so an assignment to it raises
    ``AttributeError`` instead of changing the manager's layer groups or block size behind its back."""

    def __init__(
        self, life_cycle_id: LayerGroupId, tokens_per_block: int, layer_ids: tuple[LayerId, ...] = ()
    ) -> None:
        self._id = life_cycle_id
        self._tokens_per_block = tokens_per_block
        self._layer_ids = layer_ids

    @property
    def id(self) -> LayerGroupId:
        """The layer group's number, in order of first appearance in ``config.layers``."""
        return self._id

    @property
    def tokens_per_block(self) -> int:
        """The manager's block size: the stale range and page counts are in its blocks."""
        return self._tokens_per_block

    @property
    def layer_ids(self) -> tuple[LayerId, ...]:
        """The layers of this group, in ``config.layers`` order (a tuple, fixed when the registry made it)."""
        return self._layer_ids

    @property
    def is_ssm(self) -> bool:
        """Whether these are SSM layers (one state per cache, no per-block pages)."""
        return False

    @property
    def window(self) -> int:
        """Sliding window in tokens, or ``NO_WINDOW``."""
        return NO_WINDOW

    @property
    def num_sink_blocks(self) -> int:
        """Leading blocks holding sink tokens, never stale (0 without sinks)."""
        return 0

    @property
    def window_size(self) -> int | None:
        """Sliding window in tokens, None without one (the name a priority callback reads, as in TensorRT-LLM)."""
        return None if self.window == NO_WINDOW else self.window

    def get_stale_range(self, history_length: int, tokens_per_block: int) -> HalfOpenRange:
        """Blocks holding no GPU page at ``history_length`` for blocks of ``tokens_per_block`` tokens: what a
        ``custom_priority_callback`` uses to rank a block by whether it is still in the window."""
        return HalfOpenRange(*stale_range(history_length, tokens_per_block, self.window, self.num_sink_blocks))

    def stale(self, history: int) -> tuple[int, int]:
        """``get_stale_range(history, tokens_per_block)`` as a pair, for the manager's blocks."""
        return stale_range(history, self._tokens_per_block, self.window, self.num_sink_blocks)

    def stale_steady_below(self, history: int) -> int:
        """A history ``h > history`` such that ``stale`` is the same for every history in ``[history, h)``: a lower
        bound of the next change, so a cache stepping inside it can skip the stale-range work (``resize`` and
        ``commit``'s fast path). The range moves when the sinks fill (``ceil(history / tpb)`` grows, while below
        ``num_sink_blocks``) and when the window's first block ``(history + 1 - W) // tpb`` grows.
        Example (tpb 32, W 128, no sinks): history 1000 -> 1023 (stale(1000..1022) = [0, 27), stale(1023) = [0, 28)).
        """
        tpb = self._tokens_per_block
        filled = ceil_div(history, tpb)
        below = filled * tpb + 1 if filled < self.num_sink_blocks else NEVER
        window = self.window
        if window != NO_WINDOW:
            below = min(below, ((history + 1 - window) // tpb + 1) * tpb + window - 1)
        return below

    def scratch(self, history: int, capacity: int, max_rewind_len: int) -> tuple[int, int]:
        """Blocks of the prefill chunk ``[history, capacity)`` that may live in shared scratch slots."""
        return scratch_range(
            history, capacity, max_rewind_len, self._tokens_per_block, self.window, self.num_sink_blocks
        )

    def pages_needed(self, capacity: int, history: int) -> int:
        """GPU pages one cache holds for this life cycle at these lengths (no scratch, no sharing)."""
        blocks = ceil_div(capacity, self._tokens_per_block)
        beg, end = self.stale(history)
        return blocks - (end - beg)

    def planned_pages(self, capacity: int, history: int, shared_blocks: int, ssm_slots: int) -> int:
        """Pages the quota planner counts for one cache of these lengths, scratch aside, leaving out the
        ``shared_blocks`` (a shared system prompt) another cache of the batch already holds that still have a page
        here (full attention: all of them; a window: its sinks and the blocks still in the window)."""
        pages = self.pages_needed(capacity, history)
        shared = min(shared_blocks, ceil_div(capacity, self._tokens_per_block))
        stale_begin, stale_end = self.stale(history)
        stale_shared = max(0, min(stale_end, shared) - stale_begin)
        return pages - min(shared - stale_shared, pages)

    def read_runs(self, history: int) -> tuple[tuple[int, int], ...] | None:
        """The runs ``[begin, end)`` of block ordinals, within the first ``history`` tokens, whose pages of this
        life cycle a step at ``history`` reads; None when no block can serve that history. The one rule behind a
        prefix match (``servable``), the remote tier's fetch and a handoff's blocks (``reads_block``).

        Attention reads the sinks and the window, every block without a window. Example (tpb 32, W 64, no sinks):
        history 256 -> [0, 0) and [6, 8).
        """
        sink_end, live_begin = self.stale(history)
        return (0, sink_end), (live_begin, ceil_div(history, self._tokens_per_block))

    def reads_block(self, ordinal: int, history: int) -> bool:
        """Whether a step at ``history`` reads this life cycle's page of block ``ordinal`` (see ``read_runs``)."""
        runs = self.read_runs(history)
        if runs is None:
            return False
        for begin, end in runs:
            if begin <= ordinal < end:
                return True
        return False

    def servable(self, length: int, page_counts: list[int]) -> bool:
        """Whether a prefix match of ``length`` tokens can be served, given ``page_counts[k]`` = how many of the
        first ``k`` matched blocks still have a page of this life cycle: every block ``read_runs`` names has one."""
        runs = self.read_runs(length)
        if runs is None:
            return False
        for begin, end in runs:
            if page_counts[end] - page_counts[begin] != end - begin:
                return False
        return True

    def describe(self) -> str:
        """A short description of the kind (e.g. ``sliding window 128``)."""
        raise NotImplementedError


@final
class FullAttentionLifeCycle(LifeCycle):
    def describe(self) -> str:
        return "full attention"


@final
class WindowedAttentionLifeCycle(LifeCycle):
    def __init__(
        self, life_cycle_id: LayerGroupId, tokens_per_block: int, window: int, num_sink_blocks: int,
        layer_ids: tuple[LayerId, ...] = (),
    ) -> None:
        super().__init__(life_cycle_id, tokens_per_block, layer_ids)
        self._window = window
        self._num_sink_blocks = num_sink_blocks

    @property
    def window(self) -> int:
        return self._window

    @property
    def num_sink_blocks(self) -> int:
        return self._num_sink_blocks

    def describe(self) -> str:
        sinks = f", {counted(self._num_sink_blocks, 'sink block')}" if self._num_sink_blocks else ""
        return f"sliding window {self._window}{sinks}"


@final
class SsmLifeCycle(LifeCycle):
    """SSM layers: one live state per cache (plus snapshots owned by tree blocks), never per token."""

    @property
    def is_ssm(self) -> bool:
        return True

    def stale(self, history: int) -> tuple[int, int]:
        return 0, 0

    def get_stale_range(self, history_length: int, tokens_per_block: int) -> HalfOpenRange:
        return HalfOpenRange(0, 0)

    def pages_needed(self, capacity: int, history: int) -> int:
        return 1

    def planned_pages(self, capacity: int, history: int, shared_blocks: int, ssm_slots: int) -> int:
        """``ssm_slots`` states per cache (the live one, and room for snapshots in a typical step)."""
        return ssm_slots

    def read_runs(self, history: int) -> tuple[tuple[int, int], ...] | None:
        """Only the snapshot on the block ending at ``history`` (the state after exactly those tokens); a history
        inside a block matches no snapshot, and an empty one needs none."""
        if history == 0:
            return ()
        if history % self._tokens_per_block != 0:
            return None
        last = history // self._tokens_per_block
        return ((last - 1, last),)

    def describe(self) -> str:
        return "ssm"


class LifeCycleRegistry:
    """Maps layers to life cycles, numbered in order of first appearance in ``config.layers``."""

    def __init__(self, layers: Sequence[LayerConfig], tokens_per_block: int) -> None:
        # Layers grouped by behaviour first, so that each life cycle is made whole (its layer ids never change):
        # attention by (window, sink blocks), every SSM layer in one group (``SSM_GROUP``).
        members: dict[tuple[int, int], list[LayerId]] = {}
        for layer in layers:
            key = SSM_GROUP
            if isinstance(layer, AttentionLayerConfig):
                window = NO_WINDOW if layer.sliding_window_size is None else layer.sliding_window_size
                key = (window, ceil_div(layer.num_sink_tokens or 0, tokens_per_block))
            members.setdefault(key, []).append(LayerId(layer.layer_id))
        self.life_cycles: list[LifeCycle] = []
        self._by_layer: dict[int, LifeCycle] = {}
        for (window, sink_blocks), ids in members.items():  # in order of first appearance
            new_id = LayerGroupId(len(self.life_cycles))
            layer_ids = tuple(ids)
            life_cycle: LifeCycle
            if (window, sink_blocks) == SSM_GROUP:
                life_cycle = SsmLifeCycle(new_id, tokens_per_block, layer_ids)
            elif window == NO_WINDOW:
                life_cycle = FullAttentionLifeCycle(new_id, tokens_per_block, layer_ids)
            else:
                life_cycle = WindowedAttentionLifeCycle(new_id, tokens_per_block, window, sink_blocks, layer_ids)
            self.life_cycles.append(life_cycle)
            for layer_id in layer_ids:
                self._by_layer[layer_id] = life_cycle

    def of_layer(self, layer_id: int) -> LifeCycle:
        life_cycle = self._by_layer.get(layer_id)
        if life_cycle is None:
            raise ValueError(f"unknown layer_id {layer_id}")
        return life_cycle

    def __len__(self) -> int:
        return len(self.life_cycles)
