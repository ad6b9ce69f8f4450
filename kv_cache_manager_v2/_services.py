"""What every cache of a manager shares: page store, radix tree, life cycles, layout and settings."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Final

from ._hashing import ReuseScope, Token
from ._layout import StorageLayout
from ._life_cycle import LifeCycle, ceil_div
from ._page_store import PageStore
from ._radix_tree import Block, RadixTree
from ._types import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, LayerGroupId, Priority
from ._validation import as_int

OBSERVED_CACHES: Final = 256

if TYPE_CHECKING:
    from ._kv_cache import KVCache
    from ._remote_tier import RemoteTier

PriorityCallback = Callable[[int, LayerGroupId], Priority]


class Match:
    """Result of a prefix lookup: full tree blocks, then maybe one block reused partially (copy-on-write)."""

    def __init__(self, root: Block | None) -> None:
        self.root = root
        self.blocks: list[Block] = []
        self.partial_source: Block | None = None
        self.length = 0


class CacheServices:
    def __init__(
        self,
        store: PageStore,
        tree: RadixTree,
        life_cycles: list[LifeCycle],
        layout: StorageLayout,
        tokens_per_block: int,
        partial_reuse: bool,
        max_util_for_resume: float,
        scratch_reuse: bool,
        max_rewind_len: int,
        ssm_reuse_interval: int,
    ) -> None:
        self.store = store
        self.tree = tree
        self.life_cycles = life_cycles
        self.layout = layout
        self.tokens_per_block = tokens_per_block
        self.partial_reuse = partial_reuse
        self.max_util_for_resume = max_util_for_resume
        self.scratch_reuse = scratch_reuse
        self.max_rewind_len = max_rewind_len
        self.ssm_reuse_interval = ssm_reuse_interval
        self.ssm_life_cycles: list[int] = [lc.id for lc in life_cycles if lc.is_ssm]
        self.windowed_life_cycles: list[LifeCycle] = [lc for lc in life_cycles if lc.window >= 0]
        self.pool_group_of: list[int] = [int(group) for group in layout.life_cycle_pool_group]
        self.live_caches: dict[int, KVCache] = {}
        # Debug mode (KV_CACHE_MANAGER_V2_DEBUG=1): the manager installs a full invariant check run after every
        # public call that changes state.
        self.invariant_checker: Callable[[CacheServices], None] | None = None
        # (capacity, history) of recently closed caches, for rebalancing (SPEC §8).
        self.observed_lengths: deque[tuple[int, int]] = deque(maxlen=OBSERVED_CACHES)
        self.next_cache_id = 0
        # The shared remote tier: probed for the blocks a new cache's prefix misses locally.
        self.remote: RemoteTier | None = None

    def after_call(self) -> None:
        checker = self.invariant_checker
        if checker is not None:
            checker(self)

    def priority(self, callback: PriorityCallback | None, ordinal: int, life_cycle: int) -> int:
        if callback is None:
            return DEFAULT_PRIORITY
        value = as_int(callback(ordinal, LayerGroupId(life_cycle)), "custom_priority_callback result")
        if not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise ValueError(f"custom_priority_callback returned {value}, outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        return value

    def match(self, scope: ReuseScope | None, tokens: list[Token]) -> Match:
        """Longest servable prefix of ``tokens`` (SPEC §4): walk full blocks, try a partial last block, prune."""
        tpb = self.tokens_per_block
        root = self.tree.find_root(scope)
        match = Match(root)
        if root is None:
            return match
        node = root
        for ordinal in range(len(tokens) // tpb):
            child = self.tree.child(node, tokens[ordinal * tpb : (ordinal + 1) * tpb])
            if child is None or len(child.tokens) != tpb:
                break
            match.blocks.append(child)
            node = child
        full = len(match.blocks)
        partial_length = 0
        if self.partial_reuse:
            rest = tokens[full * tpb : (full + 1) * tpb]
            if rest:
                source, partial_length = self.tree.longest_partial_child(node, rest)
                if source is not None and partial_length > 0:
                    match.partial_source = source
        candidates = [full * tpb + partial_length] if partial_length > 0 else []
        candidates.extend(k * tpb for k in range(full, -1, -1))
        chain = list(match.blocks)
        if match.partial_source is not None:
            chain.append(match.partial_source)
        counts = [self._page_counts(chain, life_cycle.id) for life_cycle in self.life_cycles]
        for length in candidates:
            if all(lc.servable(length, counts[lc.id]) for lc in self.life_cycles):
                match.length = length
                break
        kept = ceil_div(match.length, tpb)
        if match.length % tpb == 0 or kept <= full:
            match.partial_source = None
        del match.blocks[min(kept, full) :]
        return match

    @staticmethod
    def _page_counts(chain: list[Block], life_cycle: int) -> list[int]:
        counts = [0]
        total = 0
        for block in chain:
            if block.pages[life_cycle] is not None:
                total += 1
            counts.append(total)
        return counts

