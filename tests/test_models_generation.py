"""Real models through the manager (issue 17): SmolLM2-135M and Gemma 3 270M, paged path vs dense reference.

Every scenario serves real prompts with greedy decoding on the paged path (K/V only in the manager's pages,
written with kv_append and read by the paged attention twin through converted page tables), reruns each sequence
alone on the dense path, and requires identical token ids and logits within ``LOGIT_TOLERANCES``; then it checks
from the run's counters that the manager feature under test really happened.
"""

from __future__ import annotations

import pytest

from kv_cache_manager_v2.models.serving import Prompt
from tests.model_helpers import require_model, serve, serve_and_check

MODELS = ["smollm2", "gemma3"]
SYSTEM = (
    "You are a careful assistant for a school quiz. Read each question, think about the facts you know, and answer "
    "with one short and correct sentence.\n\n"
)


@pytest.mark.parametrize("model", MODELS)
def test_a_no_reuse_chunked_prefill_batched_decode(model: str) -> None:
    prompts = [
        Prompt("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
        Prompt("Water boils at a temperature of"),
    ]
    result, _ = serve_and_check(model, prompts, max_new_tokens=6, chunk=8, max_batch=2, tokens_per_block=16)
    assert result.reused_tokens == 0
    assert result.prefill_tokens == result.prompt_tokens == sum(len(s.prompt_ids) for s in result.sequences)
    eos = require_model(model).spec.eos_id
    assert all(len(s.output_ids) == 6 or s.output_ids[-1] == eos for s in result.sequences)
    assert result.steps > max(len(s.prompt_ids) for s in result.sequences) // 8  # prefill came in chunks


@pytest.mark.parametrize("model", MODELS)
def test_b_shared_prefix_and_follow_up_reuse_the_tree(model: str) -> None:
    prompts = [
        Prompt(SYSTEM + "Question: What is the largest planet of the solar system?\nAnswer:"),
        Prompt(SYSTEM + "Question: Which gas do plants take in from the air?\nAnswer:"),
        Prompt("\nQuestion: Is it bigger than the Earth?\nAnswer:", follows=0),
    ]
    # One sequence at a time, so each admission sees what the previous ones committed.
    result, _ = serve_and_check(model, prompts, max_new_tokens=5, chunk=64, max_batch=1, tokens_per_block=16)
    first, second, follow_up = result.sequences
    assert first.reused_tokens == 0
    assert second.reused_tokens >= 32  # at least two blocks of the shared system prompt
    assert follow_up.prompt_ids[: len(first.tokens)] == first.tokens
    assert follow_up.reused_tokens >= len(first.prompt_ids)  # the whole first turn, prompt and most of its answer
    assert result.hit_rate > 0
    assert result.prefill_tokens == result.prompt_tokens - result.reused_tokens


SMALL_QUOTA_PROMPTS = [
    Prompt("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    Prompt("The three most important inventions of the twentieth century were the airplane, the computer and"),
    Prompt("Water boils at a temperature of"),
]
SHORT_RUN_OPTIONS: dict[str, object] = dict(max_new_tokens=8, chunk=16, max_batch=3, tokens_per_block=16, host_mib=64)
SMALL_GPU_MIB = [("smollm2", 3), ("gemma3", 2)]
"""Three or four 16-token blocks per pool group of fp32 pages: the three sequences cannot all stay on the GPU."""


@pytest.mark.parametrize(("model", "gpu_mib"), SMALL_GPU_MIB)
def test_c_small_gpu_quota_offloads_onboards_and_preempts(model: str, gpu_mib: int) -> None:
    result, _ = serve_and_check(model, SMALL_QUOTA_PROMPTS, gpu_mib=gpu_mib, **SHORT_RUN_OPTIONS)
    assert result.preemptions >= 1 and result.resumes >= 1
    assert result.offloaded_pages > 0 and result.onboarded_pages > 0
    assert all(peak.peak_in_use <= peak.total <= 6 for peak in result.pool_groups)


def test_recomputed_sequences_count_their_prompt_once() -> None:
    """No host tier and room for one short sequence: preempted sequences are closed and recomputed from scratch.
    A recomputed sequence equals the dense run, and the hit rate counts each prompt once, at its first admission
    (its second admission matches its own earlier blocks: that is not reuse)."""
    prompts = [Prompt("hi there"), Prompt("Another prompt here"), Prompt("third one")]
    result, _ = serve_and_check(
        "smollm2", prompts, gpu_mib=1, host_mib=0, tokens_per_block=4, max_new_tokens=8, chunk=16, stop_at_eos=False
    )
    assert result.recomputes >= 1
    assert result.prompt_tokens == sum(len(sequence.prompt_ids) for sequence in result.sequences)
    assert result.reused_tokens == sum(sequence.reused_tokens for sequence in result.sequences) == 0


def test_d_gemma3_scratch_and_stale_release_past_the_window() -> None:
    notes = [
        f"Note {i}: the capital of {country} is {city}, a city with museums, parks and old bridges."
        for i, (country, city) in enumerate(
            [("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Italy", "Rome"),
             ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"),
             ("Czechia", "Prague"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Finland", "Helsinki"),
             ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"),
             ("Switzerland", "Bern"), ("Bulgaria", "Sofia"), ("Croatia", "Zagreb"), ("Romania", "Bucharest"),
             ("Latvia", "Riga"), ("Estonia", "Tallinn"), ("Lithuania", "Vilnius"), ("Slovakia", "Bratislava")],
            start=1,
        )
    ]
    text = "Notes about Europe.\n" + "\n".join(notes) + "\nQuestion: What is the capital of Italy?\nAnswer:"
    # One 1,024-token chunk: the blocks that leave the 512-token window by the chunk's end only need scratch slots.
    result, _ = serve_and_check(
        "gemma3", [Prompt(text)], max_new_tokens=3, chunk=1024, max_batch=1, tokens_per_block=32, scratch=True
    )
    [sequence] = result.sequences
    length = len(sequence.prompt_ids)
    assert 512 + 32 < length < 1024
    # SPEC §3 with window 512, tpb 32, no sinks: stale(h) = [0, (h + 1 - 512) // 32) in each of the 15 SWA layers'
    # group. The prefill chunk [0, length) has scratch range stale(length); the last decode step (history
    # length + 1) has released stale(length + 1 + 1)'s blocks, which hold no page.
    assert result.max_scratch_blocks == (length + 1 - 512) // 32 >= 1
    assert result.max_stale_blocks_released == (length + 2 + 1 - 512) // 32 >= 1


def test_smollm2_says_paris() -> None:
    result = serve("smollm2", [Prompt("The capital of France is")], max_new_tokens=3)
    [sequence] = result.sequences
    assert sequence.prompt_ids == [504, 3575, 282, 4649, 314]
    assert sequence.text.startswith(" Paris"), sequence.text
