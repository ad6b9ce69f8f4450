"""``max_admissible`` and ``can_fit_in_chunks`` ask only the chunked steps where a page count can change: the same
answers as asking every step, at a cost that does not grow with the tokens per block."""

from __future__ import annotations

import random

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager,
                                 KVCacheManagerConfig, SwaScratchReuseConfig)
from kv_cache_manager_v2._base.wording import counted
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2._model.admission_limits import (chunked_shortfall, chunked_steps,
                                                         step_shortfall)
from kv_cache_manager_v2._model.life_cycle import ceil_div
from kv_cache_manager_v2._model.planning import QuotaPlanner
from kv_cache_manager_v2.config import KVCacheDesc, LayerConfig
from tests.helpers import KIB, attention, make_config, ssm


def every_step_fits(manager: KVCacheManager, num_tokens: int, chunk: int) -> bool:
    """The definition: each chunk from the first token fits, asked one by one."""
    return manager.can_fit(0) and all(
        manager.can_fit(min(start + chunk, num_tokens), min(start + chunk, num_tokens) - start)
        for start in range(0, num_tokens, chunk)
    )


def random_manager(rng: random.Random) -> KVCacheManager:
    tpb = rng.choice([1, 2, 3, 4, 8, 16])
    layers: list[LayerConfig] = []
    for layer_id in range(rng.randint(1, 3)):
        window = rng.choice([None, rng.randint(1, 40)])
        sinks = rng.choice([None, rng.randint(1, 20)]) if window is not None else None
        layers.append(attention(layer_id, 2 * KIB, window=window, sinks=sinks))
    quota = rng.randint(4, 40) * 2 * KIB * len(layers)
    if 512 % tpb == 0 and rng.random() < 0.25:  # the default SSM reuse interval is 512 tokens
        layers.append(ssm(len(layers)))
        quota += 64 * KIB
    rewind = rng.choice([None, 0, rng.randint(1, 30)])
    scratch = None if rewind is None else SwaScratchReuseConfig(rewind)
    return KVCacheManager(make_config(layers, gpu_quota=quota, tokens_per_block=tpb, swa_scratch_reuse=scratch))


def test_answers_equal_asking_every_step() -> None:
    """Random small configs (tokens per block 1 to 16, windows, sinks, scratch rewinds, SSM): the chunked answers
    equal the step-by-step definition, and ``max_admissible`` is the longest length whose every step fits."""
    rng = random.Random(11)
    checked = refused = 0
    for _ in range(40):
        manager = random_manager(rng)
        planner, slots = internals_of(manager).planner, [usage.total for usage in manager.get_usage()]
        for _ in range(6):
            chunk = rng.choice([1, 2, 3, 5, 7, 16, 33])
            num_tokens = rng.randrange(0, 300)
            every = every_step_fits(manager, num_tokens, chunk)
            assert manager.can_fit_in_chunks(num_tokens, chunk) == every, (num_tokens, chunk)
            found = chunked_shortfall(planner, slots, num_tokens, chunk)
            assert (found is None) == every, (num_tokens, chunk)
            if found is not None:  # a step of this request that does not fit, as the refusal says
                end, computed, group, pages = found
                assert end == num_tokens or (end % chunk == 0 and computed == chunk), found
                assert step_shortfall(planner, slots, end, computed) == (group, pages), found
            checked += 1
            refused += not every
        chunk = rng.choice([1, 3, 8, 13])
        cap = manager.max_admissible(chunk, token_num_upper_bound=200)
        assert all(every_step_fits(manager, n, chunk) for n in range(1, cap + 1)), chunk
        assert cap == 200 or not every_step_fits(manager, cap + 1, chunk), chunk
        manager.shutdown()
    assert checked == 240 and 0 < refused < checked, refused


def test_steps_asked_do_not_grow_with_tokens_per_block() -> None:
    """At 2**20 tokens a block and one-token chunks, a request of 2**24 tokens was decided from every step of the
    first and last blocks (2**21 steps); the page counts change at a handful of them."""
    tpb = 1 << 20
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=3 * tpb, sinks=tpb), attention(1, 2 * KIB)]
    config = make_config(layers, gpu_quota=64 * 4 * KIB, tokens_per_block=tpb, swa_scratch_reuse=SwaScratchReuseConfig(tpb))
    manager = KVCacheManager(config)
    assert len(chunked_steps(internals_of(manager).planner, 1 << 24, 1)) <= 64
    assert manager.max_admissible() > 0
    manager.shutdown()


def test_clamp_max_seq_len_is_the_longest_length_that_fits() -> None:
    """Random small configs (windows, sinks, scratch rewinds, SSM, chunks): ``clamp_max_seq_len`` tries a few
    residues of the tokens per block, and still answers the longest length ``<= upper_bound`` whose caches fit."""
    rng = random.Random(5)
    for _ in range(30):
        manager = random_manager(rng)
        planner, slots = internals_of(manager).planner, [usage.total for usage in manager.get_usage()]
        for _ in range(4):
            batch_size, chunk, upper = rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 16, 33]), rng.randrange(0, 200)
            longest = max(
                (length for length in range(1, upper + 1) if planner.lengths_fit(length, batch_size, slots, chunk)),
                default=0,
            )
            assert planner.clamp_max_seq_len(batch_size, upper, slots, chunk) == longest, (batch_size, chunk, upper)
        manager.shutdown()


def test_clamp_max_seq_len_does_not_walk_the_tokens_of_a_block() -> None:
    """It bisected every residue of the tokens per block: about 4 minutes at 2**20 tokens a block."""
    tpb = 1 << 20
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=3 * tpb + 5, sinks=tpb), attention(1, 2 * KIB)]
    manager = KVCacheManager(make_config(layers, gpu_quota=64 * 4 * KIB, tokens_per_block=tpb))
    longest = manager.clamp_max_seq_len_for_mem(1, 1 << 40)
    planner, slots = internals_of(manager).planner, [usage.total for usage in manager.get_usage()]
    assert planner.lengths_fit(longest, 1, slots, 1) and not planner.lengths_fit(longest + 1, 1, slots, 1)
    manager.shutdown()


def named_step(planner: QuotaPlanner, slots: list[int], num_tokens: int, chunk: int) -> tuple[int, int] | None:
    """The step a refusal names, by asking every step: the first that does not fit (a whole one, else the shorter
    last one)."""
    whole = num_tokens // chunk
    for step in range(whole):
        if step_shortfall(planner, slots, (step + 1) * chunk, chunk) is not None:
            return (step + 1) * chunk, chunk
    last = num_tokens - whole * chunk
    if (last > 0 or whole == 0) and step_shortfall(planner, slots, num_tokens, last) is not None:
        return num_tokens, last
    return None


@pytest.mark.parametrize("seed", range(4))
def test_answers_refusals_and_caps_equal_the_brute_force(seed: int) -> None:
    """The yes/no asks only the last period's steps and the last one, a refusal bisects for the step it names and
    ``max_admissible`` is computed from the first whole step that does not fit: on random configs (several windows,
    sinks, SSM, scratch rewinds, 1 to 16 tokens a block), chunks of 1, larger than the windows, requests shorter
    than the chunk, the answer, the step the refusal names and the cap equal asking every step."""
    rng = random.Random(100 + seed)
    refused = 0
    for _ in range(10):
        manager = random_manager(rng)
        planner, slots = internals_of(manager).planner, [usage.total for usage in manager.get_usage()]
        for chunk in (1, rng.randint(2, 9), rng.randint(41, 90)):
            short = [step_shortfall(planner, slots, (step + 1) * chunk, chunk) is not None for step in range(400)]
            for num_tokens in (rng.randrange(0, 400), rng.randrange(0, chunk + 1), rng.randrange(0, 60)):
                whole, last = divmod(num_tokens, chunk)
                every = not any(short[:whole]) and (
                    (last == 0 and whole > 0) or step_shortfall(planner, slots, num_tokens, last) is None)
                assert manager.can_fit_in_chunks(num_tokens, chunk) == every, (num_tokens, chunk)
                named = named_step(planner, slots, num_tokens, chunk)
                assert (named is None) == every, (num_tokens, chunk, named)
                if named is not None:
                    refusal = manager.last_refusal
                    assert refusal is not None and refusal.call == "KVCacheManager.can_fit_in_chunks"
                    end, computed = named
                    expected = f"the step ending at token {end} computing {counted(computed, 'token')} needs"
                    assert expected in refusal.detail, (num_tokens, chunk, named, refusal.detail)
                    refused += 1
            bound = rng.randrange(0, 400)
            cap = 0
            for length in range(1, bound + 1):
                whole, last = divmod(length, chunk)
                if any(short[:whole]) or (last and step_shortfall(planner, slots, length, last) is not None):
                    break
                cap = length
            assert manager.max_admissible(chunk, bound) == cap, (chunk, bound)
        manager.shutdown()
    assert refused > 10, refused


@pytest.mark.skipif(kv_cache_manager_v2.COMPILED, reason="compiled code calls no patched method")
@pytest.mark.parametrize("chunk", [1, 512, 8_192])
def test_a_long_window_asks_a_few_page_counts(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 131,072-token window (64 sink tokens) and full attention, 32 tokens a block, a tier holding about
    390,000 tokens: before, the chunked steps of 524,288 tokens in one-token chunks were 16,400 (every one asked
    for a yes or a refusal) and ``max_admissible(1)`` bisected over lengths asking them, 475,564 page counts
    (5.5 s); now 4, 6 and 81. A settled step that falls short is named by its twin in the last period, as
    before."""
    tpb = 32
    kv = [BufferConfig("key", 64), BufferConfig("value", 64)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=tpb, backend="cpu", cache_tiers=[GpuCacheTierConfig(2 << 20)],
        layers=[AttentionLayerConfig(0, kv, sliding_window_size=131_072, num_sink_tokens=64),
                AttentionLayerConfig(1, kv)]))
    planner = internals_of(manager).planner
    for total in (chunk + 1, 100_000, 524_288):
        assert len(chunked_steps(planner, total, chunk)) <= 1 + 3 * len(planner.block_index_offsets()), total
    asked = [0]
    original = QuotaPlanner.cache_pages

    def counting(self: QuotaPlanner, desc: KVCacheDesc, ssm_slots: int, shared_blocks: int,
                 scratch_rewind: int | None = -1) -> list[int]:
        asked[0] += 1
        return original(self, desc, ssm_slots, shared_blocks, scratch_rewind)

    monkeypatch.setattr(QuotaPlanner, "cache_pages", counting)
    cap = manager.max_admissible(chunk)
    assert 380_000 < cap < 400_000 and asked[0] <= 200, (cap, asked[0])
    asked[0] = 0
    assert manager.can_fit_in_chunks(cap, chunk) and asked[0] <= 10, asked[0]
    asked[0] = 0
    assert not manager.can_fit_in_chunks(524_288, chunk) and asked[0] <= 200, asked[0]
    refusal = manager.last_refusal  # the first step that falls short is named: the one just past the cap
    assert refusal is not None and refusal.detail.startswith("the step ending at token "), refusal
    end = int(refusal.detail.split()[5])
    assert cap < end <= cap + chunk, (cap, refusal.detail)
    manager.shutdown()
