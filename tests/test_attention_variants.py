"""The tensor-core kernel's launch-time variants (``kernels/attention_variants.py``): which exist, how the
environment override is read and refused, and the split-K policy. The kernels themselves run every variant in
tests/test_attention_mma_on_cpu.py (CPU) and tests/test_attention_gpu.py (GPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kv_cache_manager_v2.kernels.attention_variants import (
    DECODE_DEFAULT,
    DECODE_VARIANTS,
    PREFILL_DEFAULT,
    PREFILL_VARIANTS,
    VARIANT_ENV,
    WIDE_PREFILL_VARIANTS,
    MmaVariant,
    choose_variant,
    cta_rows,
    mma_threads,
    parse_variant,
    shared_bytes,
    split_count,
    wave_fit_splits,
    sweep_variants,
    unfit_reason,
)


@contextmanager
def environment(text: str | None) -> Iterator[None]:
    """``VARIANT_ENV`` set to ``text`` (None: unset) inside, restored after."""
    before = os.environ.pop(VARIANT_ENV, None)
    if text is not None:
        os.environ[VARIANT_ENV] = text
    try:
        yield
    finally:
        os.environ.pop(VARIANT_ENV, None)
        if before is not None:
            os.environ[VARIANT_ENV] = before


def test_defaults_and_sweep_are_compiled_variants() -> None:
    assert (DECODE_DEFAULT.stages, DECODE_DEFAULT.tile_keys) in DECODE_VARIANTS
    assert (PREFILL_DEFAULT.stages, PREFILL_DEFAULT.tile_keys) in PREFILL_VARIANTS
    for rows in (16, 64):
        variants = sweep_variants(rows)
        assert len(set(variants)) == len(variants)
        assert all(unfit_reason(variant, 128, rows) is None for variant in variants)
    assert shared_bytes(MmaVariant(stages=2, tile_keys=64), 128) == 69632  # 2 x (K + V) x 64 keys x 136 x 2 B


def test_shared_memory_limits_head_dim_256() -> None:
    assert unfit_reason(MmaVariant(stages=3, tile_keys=64), 256, 16) is None
    assert "shared memory" in str(unfit_reason(MmaVariant(stages=4, tile_keys=64), 256, 16))
    assert "shared memory" in str(unfit_reason(MmaVariant(stages=2, tile_keys=128), 256, 16))
    assert "must be one of" in str(unfit_reason(MmaVariant(stages=2, tile_keys=32), 128, 16))  # 8 keys a warp


def test_environment_override() -> None:
    with environment(None):
        assert choose_variant(128, 16) == DECODE_DEFAULT
        assert choose_variant(128, 64) == PREFILL_DEFAULT
    with environment(" stages=3, splits=4 "):
        expected = MmaVariant(stages=3, tile_keys=DECODE_DEFAULT.tile_keys, split_waves=DECODE_DEFAULT.split_waves, splits=4)
        assert choose_variant(128, 16) == expected
    with environment(MmaVariant(stages=2, tile_keys=32).env_text()):
        assert choose_variant(64, 64).tile_keys == 32
        with pytest.raises(ValueError, match=f"{VARIANT_ENV}=.*head_dim 128.*must be one of"):
            choose_variant(128, 16)
    with environment("stages=4,tile_keys=64"), pytest.raises(ValueError, match="head_dim 256.*shared memory"):
        choose_variant(256, 16)
    for bad in ("stages=three", "depth=3", "stages"):
        with pytest.raises(ValueError, match=f"{VARIANT_ENV} takes name=integer pairs"):
            parse_variant(bad, DECODE_DEFAULT)


def test_split_policy_fills_whole_waves() -> None:
    policy = MmaVariant(split_waves=1)
    # Batch 32 x 8 kv heads = 256 items on 132 SMs x 3 CTAs: 2 splits (phase 1 kept 1, leaving SMs idle).
    assert split_count(policy, 256, 396, 64, 64, 128) == 2
    assert split_count(policy, 1024, 396, 64, 64, 128) == 1  # batch 128 fills the GPU alone
    assert split_count(MmaVariant(split_waves=2), 256, 396, 64, 64, 128) == 4
    assert split_count(policy, 8, 396, 64, 64, 128) == 50  # 1 sequence: ceil(396 / 8)
    assert split_count(policy, 8, 396, 64, 40, 128) == 40  # the kernel's limit
    assert split_count(policy, 8, 396, 3, 64, 128) == 3  # chunks of at least MIN_KEYS_PER_SPLIT keys
    assert split_count(MmaVariant(splits=4), 1024, 396, 64, 64, 128) == 4  # forced, still capped by the keys
    assert split_count(MmaVariant(splits=4), 1024, 396, 2, 64, 128) == 2


@pytest.mark.parametrize(
    ("items", "key_tiles", "limit", "expected"),
    [
        (256, 128, 64, 3),  # batch 32 x 8 kv heads, 8k keys: two full waves (the H200 sweep's best forced factor)
        (1024, 128, 64, 3),  # batch 128: 8 waves of thirds beat 3 waves of wholes
        (8, 128, 64, 49),  # batch 1: one wave, 396 // 8
        (8, 128, 20, 20),  # capped
        (256, 16, 8, 1),  # 1k keys: a split's fixed cost outweighs the idle SMs
    ],
)
def test_wave_fit_policy_picks_the_measured_best(items: int, key_tiles: int, limit: int, expected: int) -> None:
    assert split_count(MmaVariant(split_waves=0), items, 396, limit, 64, key_tiles) == expected
    assert wave_fit_splits(items, 396, key_tiles, limit) == expected


def test_prefill_rows_pick_the_cta_shape() -> None:
    wide = MmaVariant(prefill_rows=128)
    assert (cta_rows(16, wide), cta_rows(64, wide), cta_rows(64, MmaVariant())) == (16, 128, 64)
    assert (mma_threads(16), mma_threads(64), mma_threads(128)) == (128, 128, 256)
    assert wide.label() == "s2 k64 w1 r128" and MmaVariant().label() == "s2 k64 w1"
    assert parse_variant(wide.env_text(), DECODE_DEFAULT) == wide
    assert {(v.stages, v.tile_keys) for v in sweep_variants(64) if v.prefill_rows == 128} == set(WIDE_PREFILL_VARIANTS)
    assert "must be one of" in str(unfit_reason(MmaVariant(tile_keys=32, prefill_rows=128), 64, 64))
    assert "prefill_rows must be one of" in str(unfit_reason(MmaVariant(prefill_rows=96), 128, 64))
    with environment("prefill_rows=128"):
        assert choose_variant(128, 64) == MmaVariant(
            stages=PREFILL_DEFAULT.stages, tile_keys=PREFILL_DEFAULT.tile_keys, prefill_rows=128
        )
    with environment("prefill_rows=32"), pytest.raises(ValueError, match=f"{VARIANT_ENV}=.*prefill_rows must be"):
        choose_variant(128, 64)
