"""Differential fuzz of paged attention: the CPU builds of ``kernels/paged_attention.cu`` (CUDA cores) and
``kernels/paged_attention_mma.cu`` (tensor cores) vs the NumPy twin vs an independent dense reference
(tests/attention_fuzz.py), over seeded random shapes and their edges.

CI runs a small seeded slice; ``KV_CACHE_MANAGER_V2_FUZZ_SEEDS=N`` runs N seeds per test (a long run by hand).
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

from kv_cache_manager_v2.kernels.attention import TOLERANCES, AttentionBatch, AttentionParams, paged_attention_reference
from kv_cache_manager_v2.kernels.attention_params import MAX_POSITION, check_query
from tests.attention_fuzz import KernelBuilds, Scenario, dense_reference, random_scenario
from tests.test_attention_reference import to_float

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux"
)
SEEDS = range(int(os.environ.get("KV_CACHE_MANAGER_V2_FUZZ_SEEDS", "0")) or 6)
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> KernelBuilds:
    return KernelBuilds(tmp_path_factory.mktemp("attention_fuzz"))


def check_twin(scenario: Scenario, expected: np.ndarray, missing: np.ndarray) -> None:
    """The twin agrees with the reference to one unit in the last place, and raises where a page is missing."""
    args = (scenario.query, scenario.key_pages, scenario.value_pages, scenario.batch, scenario.params)
    if missing.any():
        with pytest.raises(ValueError):
            paged_attention_reference(*args)
        return
    twin = to_float(paged_attention_reference(*args), scenario.params.element_type)
    ulp = ULP[scenario.params.element_type]
    np.testing.assert_allclose(twin, expected, atol=ulp, rtol=ulp, err_msg=scenario.description)


def check_kernel(out: np.ndarray, expected: np.ndarray, missing: np.ndarray, scenario: Scenario) -> None:
    """Kernel vs reference within the documented tolerances; NaN exactly on the tokens that see a missing page."""
    element_type = scenario.params.element_type
    floats = to_float(out, element_type)
    assert np.isnan(floats[missing]).all(), scenario.description
    atol, rtol = TOLERANCES[element_type]
    np.testing.assert_allclose(
        floats[~missing], expected[~missing], atol=atol, rtol=rtol, err_msg=scenario.description
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_cuda_core_kernel_twin_and_reference_agree(builds: KernelBuilds, seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    for _ in range(4):
        decode = bool(rng.random() < 0.4)
        scenario = random_scenario(rng, (64, 128, 256), ("float16", "bfloat16", "float32"), decode_only=decode)
        expected, missing = dense_reference(scenario)
        check_twin(scenario, expected, missing)
        for resident in (1, int(rng.integers(2, 300))):
            out, _ = builds.run(scenario, resident, tensor_cores=False, block_order_seed=int(rng.integers(0, 1000)))
            check_kernel(out, expected, missing, scenario)


@pytest.mark.parametrize("seed", SEEDS)
def test_tensor_core_kernel_twin_and_reference_agree(builds: KernelBuilds, seed: int) -> None:
    rng = np.random.default_rng(2000 + seed)
    for _ in range(3):
        decode = bool(rng.random() < 0.4)
        scenario = random_scenario(rng, (64, 128, 256), ("float16", "bfloat16"), decode, max_history=120)
        expected, missing = dense_reference(scenario)
        check_twin(scenario, expected, missing)
        for resident in (1, int(rng.integers(2, 300))):
            out, _ = builds.run(scenario, resident, tensor_cores=True, block_order_seed=int(rng.integers(0, 1000)))
            check_kernel(out, expected, missing, scenario)


@pytest.mark.parametrize("seed", SEEDS)
def test_twin_and_reference_agree_at_head_dims_without_a_kernel(seed: int) -> None:
    rng = np.random.default_rng(3000 + seed)
    for _ in range(6):
        scenario = random_scenario(rng, (80, 96, 64), ("float16", "bfloat16", "float32"))
        expected, missing = dense_reference(scenario)
        check_twin(scenario, expected, missing)


def test_values_that_would_wrap_the_kernels_int32_arithmetic_are_refused(builds: KernelBuilds) -> None:
    # kv_page_offset 2^30 x expansion 4 = 2^32 wraps to 0 in the kernel, which then reads the table as a full one:
    # finite output from pages the table does not give those keys (the contract: NaN, as the twin's error says).
    rng = np.random.default_rng(7)
    params = AttentionParams(
        num_kv_heads=1, tokens_per_block=16, element_type="float32", expansion=4, sliding_window_size=8
    )
    pages = rng.normal(size=(30, 4 * 64)).astype(np.float32).view(np.uint8)
    query = rng.normal(size=(1, 1, 64)).astype(np.float32)
    table = np.arange(26)[None, :]
    outputs = []
    for offset in (0, 2**30):
        batch = AttentionBatch([0, 1], [100], table, None, [offset])
        outputs.append(builds.run(Scenario(params, query, pages, pages, batch, 64, f"offset {offset}"), 1, False)[0])
    np.testing.assert_array_equal(outputs[1], outputs[0])  # the wrap, in the kernel itself
    with pytest.raises(ValueError, match="kv_page_offset 1073741824 x expansion 4 overflows int32"):
        paged_attention_reference(query, pages, pages, AttentionBatch([0, 1], [100], table, None, [2**30]), params)
    with pytest.raises(ValueError, match=f"positions must be <= {MAX_POSITION}"):
        check_query(query, AttentionBatch([0, 1], [MAX_POSITION + 1], table), params)
    sinks = AttentionParams(num_kv_heads=1, tokens_per_block=16, sliding_window_size=8, num_sink_tokens=2**31 - 8)
    with pytest.raises(ValueError, match="num_sink_tokens 2147483640 overflows"):
        check_query(query.astype(np.float16), AttentionBatch([0, 1], [100], table), sinks)
