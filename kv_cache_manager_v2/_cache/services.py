"""What every cache of a manager shares, one object per concept: the page store, the radix tree and its prefix
matcher (with the remote tier's fill between two matches), the life cycles and layout, the cache settings, and the
debug hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .._model.layout import StorageLayout
from .._model.life_cycle import LifeCycle
from .._pages.page import Page
from .._pages.page_store import PageStore
from .._base.hashing import ReuseScope, Token
from .._pages.prefix_match import Match, PrefixMatcher
from .._pages.radix_tree import RadixTree
from .refusal import Refusal, held_pages_refusal
from .._observe.ssm_snapshot_stats import SsmSnapshotCounters
from .._observe.stats_delta import KVCacheStatsDelta
from .._base.types import PoolGroupIndex

if TYPE_CHECKING:
    from .._remote.tier import RemoteTier


class CacheSettings:
    """The manager config's settings a cache acts on."""

    def __init__(
        self,
        tokens_per_block: int,
        partial_reuse: bool,
        max_util_for_resume: float,
        scratch_reuse: bool,
        max_rewind_len: int,
        ssm_reuse_interval: int,
        snapshot_every_commit: bool,
        snapshot_prefill_chunks: bool,
        admission_watermark: float = 0.0,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.partial_reuse = partial_reuse
        self.max_util_for_resume = max_util_for_resume
        self.scratch_reuse = scratch_reuse
        self.max_rewind_len = max_rewind_len
        self.ssm_reuse_interval = ssm_reuse_interval
        # commit_min_snapshot / mamba_save_last_snapshot: snapshot where every commit ends on a block boundary.
        self.snapshot_every_commit = snapshot_every_commit
        # Snapshot where a commit ends a chunk on a block boundary inside the prompt (not on decode steps).
        self.snapshot_prefill_chunks = snapshot_prefill_chunks
        # Admissions (resume, batch) lock at most this much of a GPU pool group: the watermark stays for growth.
        self.admission_watermark = admission_watermark
        self.admission_util: float = min(max_util_for_resume, 1.0 - admission_watermark)


class CacheServices:
    def __init__(
        self,
        store: PageStore,
        tree: RadixTree,
        life_cycles: list[LifeCycle],
        layout: StorageLayout,
        settings: CacheSettings,
    ) -> None:
        self.store = store
        self.tree = tree
        self.life_cycles = life_cycles
        self.layout = layout
        self.settings = settings
        self.tokens_per_block: int = settings.tokens_per_block
        self.matcher: PrefixMatcher = PrefixMatcher(tree, life_cycles, settings.tokens_per_block, settings.partial_reuse)
        # Per-request statistics that caches committed (``commit_pending_stats``), summed.
        self.committed_stats: KVCacheStatsDelta = KVCacheStatsDelta()
        # Ids of the open caches with statistics not yet committed or discarded (``CacheView.has_pending_stats``),
        # kept as they change so that ``get_dirty_stats_kv_cache_ids`` does not visit every open cache.
        self.pending_stats: set[int] = set()
        self.pool_group_of: list[PoolGroupIndex] = list(layout.life_cycle_pool_group)
        self.has_live_states: bool = any(life_cycle.is_ssm for life_cycle in life_cycles)
        # Snapshot lookups of new caches, per SSM layer group (``get_and_reset_ssm_snapshot_iteration_stats``).
        self.ssm_snapshots: SsmSnapshotCounters = SsmSnapshotCounters(
            [life_cycle.id for life_cycle in life_cycles if life_cycle.is_ssm], settings.tokens_per_block
        )
        # Debug mode (KV_CACHE_MANAGER_V2_DEBUG=1): the manager installs a full invariant check run after every
        # public call that changes state.
        self.invariant_checker: Callable[[], None] | None = None
        # The shared remote tier: probed for the blocks a new cache's prefix misses locally.
        self.remote: RemoteTier | None = None
        # The latest soft refusal of any call, and per request of the latest batch (``KVCacheManager.last_refusal``).
        self.last_refusal: Refusal | None = None
        self.last_batch_refusals: tuple[Refusal | None, ...] = ()
        # The caches under a ``KVCache.hold`` (by id): what lists their pages and their hold reasons' live list. A
        # refusal names their pages (``note_refusal``): they stay out of use until a writer outside lets go.
        self.held_caches: dict[int, tuple[Callable[[], list[Page]], list[str]]] = {}

    def note_refusal(self, refusal: Refusal) -> Refusal:
        """Keep ``refusal`` as the manager's latest, with the pages held caches keep in its pool group counted in:
        every refusal is recorded here (a cache's through ``CacheView.note_refusal``), so none can miss them.
        Returns the refusal as recorded."""
        recorded = held_pages_refusal(refusal, self.held_caches)
        self.last_refusal = recorded
        return recorded

    def match_fetching_remote(self, scope: ReuseScope | None, tokens: list[Token]) -> Match:
        """The longest prefix of ``tokens`` held locally once the remote tier (if any) fetched the blocks that extend
        the local match: what opening a cache reuses and what ``prefetch_remote`` reports, written once. A fill that
        failed in part may leave a shorter match than the local one (it hid a partial block): that one is kept."""
        match = self.matcher.match(scope, tokens)
        remote = self.remote
        if remote is not None and remote.fetch_prefix(scope, tokens, match.length, match.partial_blocks()):
            extended = self.matcher.match(scope, tokens)  # the fetched blocks extend it
            if extended.length >= match.length:
                match = extended
        return match

    def after_call(self) -> None:
        checker = self.invariant_checker
        if checker is not None:
            checker()
