"""Refusals by ``max_util_for_resume`` name the way out an engine can take: a pool group that admits one request at
a time (a small tier's SSM group) and the settings that run more; a matched prefix that alone passes the limit and
the admission without it that fits."""

from __future__ import annotations

import re

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config, small_manager, ssm

TPB = 32


def test_a_resume_refused_because_a_small_ssm_group_admits_one_request_at_a_time_says_how_to_run_more() -> None:
    """On a small GPU tier the default split leaves a hybrid's SSM group 2 slots, of which ``max_util_for_resume``
    lets an admission lock 1: every request after the first waits, one request at a time. Found integrating a hybrid
    engine from the docs: the sentence said only 'active caches must release that many (suspend or close them)',
    which an engine that admits in order reads as 'wait'. It now says the group admits one such request at a time
    and names the settings that change it (max_util_for_resume, typical_step)."""
    manager = KVCacheManager(make_config([attention(0), ssm(1), ssm(2)], gpu_quota=160 * KIB))
    ssm_pool_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    assert manager.get_storage_statistics()[ssm_pool_group].total == 2
    first = manager.create_kv_cache(input_tokens=list(range(40)))
    assert first.resume()
    second = manager.create_kv_cache(input_tokens=list(range(100, 140)))
    assert not second.resume()
    refusal = second.last_refusal
    assert refusal is not None and refusal.pool_group == ssm_pool_group and refusal.fits_empty_manager
    assert "admits one such request at a time" in refusal.detail, refusal.detail
    assert "max_util_for_resume" in refusal.detail and "typical_step" in refusal.detail, refusal.detail
    first.close()
    assert second.resume()
    second.close()
    manager.shutdown()


def test_a_new_cache_whose_matched_prefix_alone_passes_max_util_is_told_to_come_again_without_it() -> None:
    """A running cache may grow past ``max_util_for_resume`` (resize is not bounded by it), so its committed prefix
    can be more pages than a later request's first resume may lock: that request never fits with its match, and
    fits created without input tokens. Found integrating a hybrid engine from the docs: the sentence named only
    'raise max_util_for_resume or give the GPU tier more memory', not the way ContinuousBatcher takes."""
    manager = small_manager()  # 10 slots of one pool group: a resume may lock 9
    prompt = list(range(10 * TPB))
    first = manager.create_kv_cache(input_tokens=prompt)
    assert first.resume() and first.resize(len(prompt))
    first.commit(prompt)
    first.close()
    again = manager.create_kv_cache(input_tokens=prompt)
    assert again.num_committed_tokens == len(prompt) and not again.resume()
    refusal = again.last_refusal
    assert refusal is not None and not refusal.fits_empty_manager
    assert "create the request again without input tokens" in refusal.detail, refusal.detail
    again.close()
    fresh = manager.create_kv_cache()  # what the sentence says: no match, nothing locked by the resume
    assert fresh.resume() and fresh.resize(len(prompt))
    fresh.close()
    manager.shutdown()


def test_a_refusal_by_the_admission_limit_does_not_relabel_the_watermark_as_max_util_for_resume() -> None:
    """``max_util_for_resume`` 1.0 and ``admission_watermark`` 0.2: an admission may lock 0.8 of the 10 GPU pages.
    A resume needing 3 while 9 are locked passes both limits (so it is not the watermark's refusal alone), and its
    sentence states the 0.8 it was judged by as the admission limit. Before: "more than max_util_for_resume=0.8",
    a setting the engine had set to 1.0."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * 16 * KIB), HostCacheTierConfig(10 * 16 * KIB)]
    config = make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0, admission_watermark=0.2)
    manager = KVCacheManager(config)
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(3 * TPB)
    waiting.suspend()
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(9 * TPB)  # the waiting cache's pages go to the host
    assert not waiting.resume()
    refusal = waiting.last_refusal
    assert refusal is not None and refusal.fits_empty_manager and not refusal.by_watermark, refusal
    assert refusal.pages_over_limit == 3 + 9 - 8, refusal
    stated = re.search(r"max_util_for_resume=([\d.]+)", refusal.detail)
    assert stated is None or float(stated.group(1)) == config.max_util_for_resume, refusal.detail
    limit = re.search(r"more than the admission limit, ([\d.]+) of pool group 0's 10 pages \((\d+);", refusal.detail)
    assert limit is not None and (float(limit.group(1)), int(limit.group(2))) == (config.admission_util, 8), refusal
    for cache in (running, waiting):
        cache.close()
    manager.shutdown()
