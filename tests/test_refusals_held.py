"""Pages of caches under ``KVCache.hold`` are counted in every refusal, whatever call built it: every refusal is
recorded through ``CacheServices.note_refusal``, which adds them (``Refusal.held_pages`` and a sentence naming the
holds). Before it, only the refusals of ``resize``/``resume``/batch admission counted them."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, SMALL_SLOTS, attention, make_config, small_manager

TPB = 32
READING = "a decode side may be reading"
PACKAGE = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"


def test_fit_queries_count_held_pages_and_say_their_release_would_not_help() -> None:
    """Before: ``can_fit``/``can_fit_in_chunks`` refused with ``held_pages`` 0 and no word of the hold while 7 of the
    10 GPU pages were held (``assert 0 == 7``)."""
    manager = small_manager()
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(7 * TPB)
    hold = hog.hold(READING)
    too_long = (SMALL_SLOTS + 1) * TPB
    queries: list[tuple[str, Callable[[], bool]]] = [
        ("KVCacheManager.can_fit", lambda: manager.can_fit(too_long)),
        ("KVCacheManager.can_fit_in_chunks", lambda: manager.can_fit_in_chunks(too_long, TPB)),
    ]
    for call, answer in queries:
        assert not answer()
        refusal = manager.last_refusal
        assert refusal is not None and refusal.call == call and not refusal.fits_empty_manager
        assert refusal.held_pages == 7, refusal
        assert f"7 of pool group 0's GPU pages are in held caches (KVCache.hold), used until each hold is released: {READING}" in refusal.detail
        assert "releasing them would not make this fit" in refusal.detail  # the tier itself is too small
    hold.release()
    assert not manager.can_fit(too_long)
    assert manager.last_refusal is not None and manager.last_refusal.held_pages == 0
    assert "held caches" not in manager.last_refusal.detail
    hog.close()
    manager.shutdown()


def test_a_prefetch_refusal_counts_held_pages() -> None:
    """Before: ``prefetch(0)`` refused (no free GPU slot) with ``held_pages`` 0 though a held cache kept every one of
    them (``assert 0 == 8``)."""
    slot_bytes = 16 * KIB
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * slot_bytes), HostCacheTierConfig(40 * slot_bytes)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(4 * TPB)
    engine.step(waiting, list(range(4 * TPB)))
    waiting.suspend()
    assert waiting.offload() == 4
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(8 * TPB)  # every GPU slot
    hold = running.hold(READING)
    assert waiting.prefetch(0) is False
    refusal = waiting.last_refusal
    assert refusal is not None and refusal.call == "KVCache.prefetch" and refusal.fits_empty_manager
    assert refusal.held_pages == 8, refusal
    assert READING in refusal.detail and "releasing them would not" not in refusal.detail
    hold.release()
    running.close()
    assert waiting.prefetch(0) is True
    waiting.close()
    manager.shutdown()


def test_every_refusal_is_recorded_through_one_place() -> None:
    """``last_refusal`` is assigned only by ``CacheServices.note_refusal`` (and ``CacheView.note_refusal`` from its
    answer), so no call can record a refusal without the held pages: a new call that assigns it fails here."""
    assigning: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                if any(isinstance(target, ast.Attribute) and target.attr == "last_refusal" for target in targets):
                    assigning.append(f"{path.relative_to(PACKAGE)}:{function.name}")
    assert sorted(assigning) == [
        "_cache/cache_view.py:__init__", "_cache/cache_view.py:note_refusal",
        "_cache/services.py:__init__", "_cache/services.py:note_refusal",
    ], assigning
