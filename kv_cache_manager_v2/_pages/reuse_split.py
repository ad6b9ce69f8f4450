"""Where a prefix match lives: per cache tier, the reusable tokens, the pages a new cache's first resume onboards
and the pages it copies (``KVCacheManager.probe_reuse_by_tier``). An engine budgets the load-back of host or disk
pages before it admits a prefill (SGLang's ``match_prefix`` answers its device hit and host hit apart)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from .._base.types import CacheTier, FrozenValue
from .._model.life_cycle import LifeCycle
from .prefix_match import Match


@final
@dataclass(frozen=True)
class ReuseByTier(FrozenValue):
    """A probe's answer split by cache level (index 0 the GPU; ``tiers[level]`` its kind). ``tokens``: what
    ``probe_reuse`` answers. ``tokens_by_level``: each matched block's tokens counted at the coldest level holding a
    page the new cache reads of it (a block every layer group skips, outside every window, counts as on the GPU:
    nothing moves for it); they add up to ``tokens``. ``onboard_pages``: the pages the first ``resume`` moves to the
    GPU from each level (its ``onboarded_pages`` statistics); ``copied_pages``: the pages it copies from each level
    instead (a block reused partially, an SSM snapshot: ``copied_pages``). Windowed layer groups count only the
    window's pages, SSM groups only the snapshot where the match ends."""

    tokens: int
    tiers: tuple[CacheTier, ...]
    tokens_by_level: tuple[int, ...]
    onboard_pages: tuple[int, ...]
    copied_pages: tuple[int, ...]

    @property
    def gpu_tokens(self) -> int:
        """Tokens whose pages are all on the GPU already (SGLang's device hit)."""
        return self.tokens_by_level[0]

    def tokens_on(self, tier: CacheTier) -> int:
        """Tokens counted at the levels of kind ``tier`` (0 for a kind this manager has no level of)."""
        return sum(count for kind, count in zip(self.tiers, self.tokens_by_level) if kind == tier)

    @property
    def pages_to_move(self) -> int:
        """Pages the first resume brings from colder tiers, onboarded or copied (what the load-back costs)."""
        return sum(self.onboard_pages[1:]) + sum(self.copied_pages[1:])


def split_by_tier(
    match: Match, life_cycles: list[LifeCycle], tokens_per_block: int, tiers: tuple[CacheTier, ...]
) -> ReuseByTier:
    """``match`` split by where its pages are, counting the pages ``create_kv_cache`` adopts and ``resume`` then
    onboards or copies: each attention group's entries outside its stale range at the match's length, the
    copy-on-write source of a block reused partially, each SSM group's snapshot at the match's end. A GPU-only
    manager reads no page of a full block (nothing there can be elsewhere)."""
    length = match.length
    levels = len(tiers)
    onboard = [0] * levels
    copied = [0] * levels
    num_full = len(match.blocks)
    num_blocks = -(-length // tokens_per_block)
    # The coldest level of a page read, per block; only built with colder tiers.
    block_level = [0] * num_blocks if levels > 1 else []
    for life_cycle in life_cycles:
        lc = life_cycle.id
        if life_cycle.is_ssm:
            if length == 0:
                continue
            ending = match.snapshot_source if length % tokens_per_block else match.blocks[num_full - 1]
            assert ending is not None, "a match ending inside a block has a snapshot source"
            snapshot = ending.pages[lc]
            assert snapshot is not None, "match pruning guarantees a snapshot at the match end"
            copied[snapshot.level] += 1
            if block_level and snapshot.level > block_level[num_blocks - 1]:
                block_level[num_blocks - 1] = snapshot.level
            continue
        stale_beg, stale_end = life_cycle.stale(length)
        if num_full < num_blocks and not stale_beg <= num_full < stale_end:
            source = match.partial_source
            assert source is not None, "a match ending inside a block has a copy-on-write source"
            page = source.pages[lc]
            assert page is not None, "match pruning guarantees the partial block's page"
            copied[page.level] += 1
            if block_level and page.level > block_level[num_full]:
                block_level[num_full] = page.level
        if not block_level:
            continue
        for begin, end in ((0, min(stale_beg, num_full)), (stale_end, num_full)):
            for ordinal in range(begin, end):
                page = match.blocks[ordinal].pages[lc]
                assert page is not None, "match pruning guarantees every needed block has a page"
                level = page.level
                if level:
                    onboard[level] += 1
                    if level > block_level[ordinal]:
                        block_level[ordinal] = level
    tokens = [0] * levels
    if not block_level:
        tokens[0] = length
    for ordinal, coldest in enumerate(block_level):
        tokens[coldest] += min(tokens_per_block, length - ordinal * tokens_per_block)
    return ReuseByTier(length, tiers, tuple(tokens), tuple(onboard), tuple(copied))
