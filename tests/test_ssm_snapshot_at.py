"""Hybrid reuse without tuning (issue #38): declared snapshot points (``snapshot_at``) and the default snapshot at
the end of each prefill chunk, proved by content (the FakeEngine checks the SSM state a reused prefix starts from)."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32
SYSTEM = [(i * 7919 + 11) % 50_000 for i in range(300)]  # a 300-token system prompt shared by every request


def hybrid() -> list[LayerConfig]:
    return [ssm(0), attention(1, 2 * KIB), ssm(2), attention(3, 2 * KIB)]


def question(seed: int, length: int = 90) -> list[int]:
    return [(seed * 1_000_003 + i * 104_729) % 50_000 for i in range(length)]


def prefill(cache: _KVCache, engine: FakeEngine, tokens: list[int], stops: tuple[int, ...] = ()) -> None:
    """Compute and commit ``tokens`` past the reused prefix, one chunk per stop (then the rest)."""
    assert cache.resume()
    engine.check(cache, tokens)  # the reused prefix, SSM states included, holds exactly these tokens' content
    for end in [stop for stop in stops if stop > cache.history_length] + [len(tokens)]:
        assert cache.resize(end, cache.history_length)
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens : end])


def test_a_shared_system_prompt_is_reused_from_a_declared_snapshot() -> None:
    manager = KVCacheManager(make_config(hybrid()))  # default config: snapshot interval 512
    engine = FakeEngine(manager)
    first_tokens = SYSTEM + question(1)
    first = manager.create_kv_cache(None, first_tokens, snapshot_at=[300])
    assert first.snapshot_points == (288,)  # no mid-block snapshot: snapped down to the block boundary
    prefill(first, engine, first_tokens, stops=first.snapshot_points)
    first.close()
    second_tokens = SYSTEM + question(2)
    second = manager.create_kv_cache(None, second_tokens)
    assert second.num_committed_tokens == 288
    prefill(second, engine, second_tokens)  # checks the SSM live state copied from the snapshot
    engine.check(second, second_tokens)
    second.close()


def test_without_a_declared_point_a_one_chunk_prompt_reuses_nothing() -> None:
    manager = KVCacheManager(make_config(hybrid()))
    engine = FakeEngine(manager)
    tokens = SYSTEM + question(1)
    cache = manager.create_kv_cache(None, tokens)
    prefill(cache, engine, tokens)
    cache.close()
    assert manager.probe_reuse(None, SYSTEM + question(2)) == 0


def test_batch_requests_declare_snapshot_points() -> None:
    manager = KVCacheManager(make_config(hybrid()))
    engine = FakeEngine(manager)
    tokens = SYSTEM + question(3)
    request = KVCacheRequest(tokens, capacity=288, snapshot_at=[300, 5, 320])
    assert request.snapshot_at == (300, 5, 320)
    [cache] = manager.create_kv_cache_batch([request])
    assert cache is not None and cache.snapshot_points == (288, 320)
    engine.step(cache, tokens)
    cache.commit(tokens[:288])
    prefill(cache, engine, tokens)
    cache.close()
    follower = SYSTEM + question(4)
    assert manager.probe_reuse(None, follower) == 288
    reused = manager.create_kv_cache(None, follower)
    prefill(reused, engine, follower)
    reused.close()


def test_prefill_chunk_ends_are_snapshotted_by_default_and_decode_steps_are_not() -> None:
    manager = KVCacheManager(make_config(hybrid()))
    engine = FakeEngine(manager)
    tokens = question(5, 400)
    cache = manager.create_kv_cache(None, tokens)
    prefill(cache, engine, tokens, stops=(128, 256, 300))  # 300 ends inside a block: no snapshot there
    assert manager.probe_reuse(None, tokens + [1]) == 256
    assert manager.probe_reuse(None, tokens[:200]) == 128
    generated = question(6, 64)
    for token in generated:  # decode: one token a step, blocks complete at 416 and 448 past the prompt
        assert cache.resize(cache.capacity + 1, cache.history_length)
        engine.step(cache, tokens + generated)
        cache.commit([token])
    assert manager.probe_reuse(None, tokens + generated) == 256
    cache.close()
    off = KVCacheManager(make_config(hybrid(), snapshot_prefill_chunks=False))
    other = off.create_kv_cache(None, tokens)
    prefill(other, FakeEngine(off), tokens, stops=(128, 256))
    assert off.probe_reuse(None, tokens) == 0  # only the 512-token interval is left


@pytest.mark.parametrize("flag", ["mamba_save_last_snapshot", "commit_min_snapshot"])
def test_the_last_snapshot_flags_stop_a_chunk_at_the_prompts_last_full_block(flag: str) -> None:
    """The config's promise ("the end of a prompt is reusable whatever its length") for an engine that ends its prefill
    chunks where ``snapshot_points`` says, as the docs ask: the prompt's last full block is one of them, so the next
    turn of the conversation resumes from there instead of from the last chunk end before it."""
    manager = KVCacheManager(
        make_config(hybrid(), mamba_save_last_snapshot=flag == "mamba_save_last_snapshot",
                    commit_min_snapshot=flag == "commit_min_snapshot")
    )
    engine = FakeEngine(manager)
    tokens = question(7, 150)  # one chunk: no chunk ends on a block boundary by itself
    cache = manager.create_kv_cache(None, tokens)
    assert cache.snapshot_points == (128,)
    prefill(cache, engine, tokens, stops=cache.snapshot_points)
    cache.close()
    follow_up = tokens + question(8, 100)
    assert manager.probe_reuse(None, follow_up) == 128
    again = manager.create_kv_cache(None, follow_up, snapshot_at=[200])
    assert again.snapshot_points == (192, 224)  # a declared point is kept beside it
    prefill(again, engine, follow_up, stops=again.snapshot_points)  # checks the SSM state resumed from 128
    again.close()
    assert KVCacheManager(make_config(hybrid())).create_kv_cache(None, tokens).snapshot_points == ()


@pytest.mark.parametrize(
    ("snapshot_at", "error", "message"),
    [([-1], ValueError, r"snapshot_at\[0\] must be >= 0"), ([32, 1.5], TypeError, r"snapshot_at\[1\]"), (300, TypeError, "snapshot_at")],
)
def test_bad_snapshot_points_are_refused_naming_the_argument(snapshot_at: object, error: type[Exception], message: str) -> None:
    manager = KVCacheManager(make_config(hybrid()))
    with pytest.raises(error, match=message):
        manager.create_kv_cache(None, SYSTEM, snapshot_at=snapshot_at)  # type: ignore[arg-type]
    assert manager.num_live_caches == 0
    with pytest.raises(error, match=message):
        KVCacheRequest(SYSTEM, snapshot_at=snapshot_at)  # type: ignore[arg-type]
    request = KVCacheRequest(SYSTEM)
    request.snapshot_at = snapshot_at  # type: ignore[assignment]
    with pytest.raises(error, match=message.replace("snapshot_at", r"requests\[0\]\.snapshot_at", 1)):
        manager.create_kv_cache_batch([request])
    assert manager.num_live_caches == 0


def test_points_past_the_input_fire_as_the_engine_computes_past_it() -> None:
    """A position past ``input_tokens`` is kept, not refused: the engine computes past its input (all of it when it
    passes none, as an admission that gives up its reuse does), and the chunk it ends there is snapshotted. A point
    the request never reaches simply takes no snapshot."""
    manager = KVCacheManager(make_config(hybrid()))
    engine = FakeEngine(manager)
    tokens = SYSTEM + question(5)
    first = manager.create_kv_cache(None, None, snapshot_at=[300, 10_000])
    assert first.history_length == 0 and first.snapshot_points == (288, 9984)
    prefill(first, engine, tokens, stops=(288,))  # the engine's chunks end at the points it reaches
    first.close()
    follower = SYSTEM + question(6)
    assert manager.probe_reuse(None, follower) == 288
    reused = manager.create_kv_cache(None, follower)
    prefill(reused, engine, follower)  # checks the SSM state restored from the snapshot at 288
    reused.close()
