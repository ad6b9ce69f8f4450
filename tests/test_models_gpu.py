"""The cuda backend: KV pages and paged attention in fp16 (the CUDA kernels), against the cpu backend's fp32 run.

Skips cleanly without a CUDA device. ``LOGIT_TOLERANCES["cuda"]`` bounds the first step's logits: fp16 keys and
values carry ~2^-11 relative rounding, which the attention output and 18-30 layers amplify to a few hundredths
of a logit (measured on an H100: 2.1e-2 for SmolLM2, 7.5e-3 for Gemma 3); greedy tokens of these short runs
must not change.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2.models.backend import cuda_available
from kv_cache_manager_v2.models.check import LOGIT_TOLERANCES
from kv_cache_manager_v2.models.serving import GenerationResult, Prompt
from tests.model_helpers import serve
from tests.test_models_generation import SHORT_RUN_OPTIONS, SMALL_GPU_MIB, SMALL_QUOTA_PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

PROMPTS = [
    Prompt("The capital of France is"),
    Prompt("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    Prompt("\nQuestion: Where did he live?\nAnswer:", follows=1),
]


def assert_same_generation(cuda: GenerationResult, cpu: GenerationResult) -> None:
    for on_cpu, on_cuda in zip(cpu.sequences, cuda.sequences, strict=True):
        assert on_cuda.output_ids == on_cpu.output_ids
        assert float(np.abs(on_cuda.logits[0] - on_cpu.logits[0]).max()) <= LOGIT_TOLERANCES["cuda"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_cuda_fp16_matches_cpu_fp32(model: str) -> None:
    cpu = serve(model, PROMPTS, backend="cpu", gpu_mib=256, **SHORT_RUN_OPTIONS)
    cuda = serve(model, PROMPTS, backend="cuda", gpu_mib=256, **SHORT_RUN_OPTIONS)
    assert_same_generation(cuda, cpu)
    assert cuda.sequences[2].reused_tokens > 0  # the follow-up found its first turn in the device's pages


@pytest.mark.parametrize(("model", "cpu_mib"), SMALL_GPU_MIB)
def test_cuda_small_quota_preempts_offloads_and_onboards(model: str, cpu_mib: int) -> None:
    """``test_c`` of the cpu suite on the device: fp16 pages are half as large, so half its quota holds the same
    blocks and the run must again preempt, offload to the host tier and onboard back into device pages."""
    cpu = serve(model, SMALL_QUOTA_PROMPTS, backend="cpu", gpu_mib=cpu_mib, **SHORT_RUN_OPTIONS)
    cuda = serve(model, SMALL_QUOTA_PROMPTS, backend="cuda", gpu_mib=cpu_mib / 2, **SHORT_RUN_OPTIONS)
    assert [group.total for group in cuda.pool_groups] == [group.total for group in cpu.pool_groups]
    assert_same_generation(cuda, cpu)
    assert cuda.preemptions >= 1 and cuda.offloaded_pages > 0 and cuda.onboarded_pages > 0
