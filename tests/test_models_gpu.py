"""The cuda backend: KV pages and paged attention in fp16 (the CUDA kernels), against the cpu backend's fp32 run.

Skips cleanly without a CUDA device. ``LOGIT_TOLERANCES["cuda"]`` bounds the first step's logits: fp16 keys and
values carry ~2^-11 relative rounding, which the attention output and 18-30 layers amplify to a few hundredths
of a logit (an estimate: not yet run on a device); greedy tokens of these short runs must not change.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2.models.backend import cuda_available
from kv_cache_manager_v2.models.check import LOGIT_TOLERANCES
from kv_cache_manager_v2.models.serving import Prompt
from tests.model_helpers import serve

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

PROMPTS = [
    Prompt("The capital of France is"),
    Prompt("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    Prompt("\nQuestion: Where did he live?\nAnswer:", follows=1),
]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("gpu_mib", [256, 3])  # 3 MiB: preemption, offload and onboarding on the device
def test_cuda_fp16_matches_cpu_fp32(model: str, gpu_mib: int) -> None:
    options: dict[str, object] = dict(max_new_tokens=8, chunk=16, max_batch=3, tokens_per_block=16, host_mib=64)
    cpu = serve(model, PROMPTS, backend="cpu", gpu_mib=256, **options)
    cuda = serve(model, PROMPTS, backend="cuda", gpu_mib=gpu_mib, **options)
    for on_cpu, on_cuda in zip(cpu.sequences, cuda.sequences):
        assert on_cuda.output_ids == on_cpu.output_ids
        assert float(np.abs(on_cuda.logits[0] - on_cpu.logits[0]).max()) <= LOGIT_TOLERANCES["cuda"]
    if gpu_mib == 3:
        assert cuda.preemptions >= 1 and cuda.offloaded_pages > 0 and cuda.onboarded_pages > 0
