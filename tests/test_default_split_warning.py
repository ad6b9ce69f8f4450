"""A GPU tier too small for the default split of its pool groups (no ``typical_step`` declared) warns once at
construction, naming the tier's setting, the pool group left short and the smallest quota whose default split
admits one request of the default step's length: before, nothing was said, and every such request was refused
with a sentence about the split."""

from __future__ import annotations

import logging
import re

import pytest

from kv_cache_manager_v2 import BatchDesc, KVCacheDesc, KVCacheManager
from tests.fuzz.checks import COUNTED
from tests.helpers import KIB, MIB, attention, gemma_like_layers, make_config

LOGGER = "kv_cache_manager_v2"
SPLIT = "its default split (no typical_step declared)"
TPB = 32


def split_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if SPLIT in record.getMessage()]


def test_a_small_gemma_like_tier_warns_once_with_the_quota_that_admits_one_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: no warning, and ``can_fit_in_chunks(4096, 32)`` False (the SWA pool group got 1 slot of 2 MiB)."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=2 * MIB, tokens_per_block=TPB))
    warnings = split_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("GpuCacheTierConfig.quota 2097152: "), warnings
    assert "leaves GPU pool group 0 1 slot," in warnings[0] and "request of 4096 tokens" in warnings[0], warnings
    longest = re.search(r"the longest that fits is (\d+) tokens", warnings[0])
    assert longest is not None and int(longest.group(1)) == manager.max_admissible(TPB), warnings
    assert not manager.can_fit_in_chunks(4096, TPB)
    manager.shutdown()
    found = re.search(r"the smallest quota whose default split admits one is (\d+) bytes", warnings[0])
    assert found is not None, warnings
    smallest = int(found.group(1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        enough = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=smallest, tokens_per_block=TPB))
        short = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=smallest - 1, tokens_per_block=TPB))
    assert enough.can_fit_in_chunks(4096, TPB) and not short.can_fit_in_chunks(4096, TPB)
    assert len(split_warnings(caplog)) == 1  # the short one's
    enough.shutdown()
    short.shutdown()


@pytest.mark.parametrize("quota, slots", [(2 * MIB, 1), (3840 * KIB, 2)])
def test_the_warning_counts_in_english(caplog: pytest.LogCaptureFixture, quota: int, slots: int) -> None:
    """The slots the split leaves (1 and 2 here, as the statistics read them) and every other count in the
    warning carry their noun singular for one. Before: "leaves GPU pool group 0 1 slots"."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=quota, tokens_per_block=TPB))
    warnings = split_warnings(caplog)
    assert len(warnings) == 1 and manager.get_storage_statistics()[0].total == slots, warnings
    counts = {(int(match.group(1)), match.group(2)): bool(match.group(3)) for match in COUNTED.finditer(warnings[0])}
    assert (slots, "slot") in counts, warnings
    assert all(plural == (count != 1) for (count, _), plural in counts.items()), warnings
    manager.shutdown()


def test_no_warning_where_the_engine_chose_the_split_or_nothing_is_split(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        declared = KVCacheManager(make_config(
            gemma_like_layers(), gpu_quota=2 * MIB, tokens_per_block=TPB, typical_step=BatchDesc([KVCacheDesc(64, 32)])
        ))
        ratio = KVCacheManager(make_config(
            gemma_like_layers(), gpu_quota=2 * MIB, tokens_per_block=TPB, initial_pool_ratio=[0.5, 0.5]
        ))
        one_group = KVCacheManager(make_config([attention(0, 4 * KIB)], gpu_quota=64 * KIB, tokens_per_block=TPB))
        roomy = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=64 * MIB, tokens_per_block=TPB))
    assert split_warnings(caplog) == []
    for manager in (declared, ratio, one_group, roomy):
        manager.shutdown()
