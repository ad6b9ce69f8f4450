"""Real tokens through the manager's hardest paths at once, every output checked against a run without any cache.

Gemma 3 (model package): sliding windows with sink tokens that end inside a block, SWA scratch reuse, a GPU tier
that forces preemption, chat turns.
"""

from __future__ import annotations

import dataclasses

from kv_cache_manager_v2.models.gguf_model import Model
from kv_cache_manager_v2.models.serving import Prompt
from tests.model_helpers import require_model, serve_model_and_check


GEMMA_CHAT = [
    Prompt("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the fire."),
    Prompt("The quick brown fox jumps over the lazy dog and then"),
    Prompt("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    Prompt(" Why did it jump?", follows=0),
    Prompt(" And the cat?", follows=3),
]


def test_gemma3_sink_tokens_with_scratch_and_preemption() -> None:
    """Sliding windows of 5 tokens with 3 sink tokens (their blocks of 2 tokens end inside a block): the sink
    blocks keep their pages while the blocks after them go stale (window-local tables skip those), prefill chunks
    of 8 leave blocks behind the window in scratch slots, the small GPU tier preempts a request to the host tier,
    and follow-up turns reuse the conversation."""
    model = require_model("gemma3")

    def variant(sink_tokens: int) -> Model:
        windows = tuple(None if size is None else 5 for size in model.spec.windows)
        spec = dataclasses.replace(model.spec, windows=windows, num_sink_tokens=sink_tokens)
        return dataclasses.replace(model, spec=spec)

    options: dict[str, object] = dict(
        max_new_tokens=6, tokens_per_block=2, gpu_mib=1.25, host_mib=8, chunk=8, max_batch=3, scratch=True,
        stop_at_eos=False,
    )
    result, _ = serve_model_and_check(variant(3), GEMMA_CHAT, **options)
    assert result.preemptions >= 1 and result.resumes >= 1
    assert result.max_scratch_blocks > 0 and result.max_stale_blocks_released > 0
    assert result.reused_tokens > 0
    without, _ = serve_model_and_check(variant(0), GEMMA_CHAT, **options)
    assert [s.output_ids for s in result.sequences] != [s.output_ids for s in without.sequences]  # sinks matter

