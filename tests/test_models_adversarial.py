"""Real tokens through the manager's hardest paths at once, every output checked against a run without any cache.

bamba-tiny (ships with the package, so this always runs): several requests interleaved pass by pass, each pass
possibly followed by ``suspend`` (and ``offload``, then ``prefetch``) before the next ``resume``, on a small GPU
tier above a host tier that stores pages through a padding cold-page codec; prompts continue earlier
conversations and declare ``snapshot_at`` positions inside blocks, so with partial reuse some requests resume from
a snapshot taken inside a block. Gemma 3 (model package): sliding windows with sink tokens that end inside a block,
SWA scratch reuse, a GPU tier that forces preemption, chat turns. SmolLM2 made Gemma-like (windows with sinks on
two layers of three, in both paths): speculative decoding as the README describes it, drafts that the target model
rejects written into the pages and then overwritten, the room they took given back by the next ``resize``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Generator

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    BatchDesc,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    _introspection,
)
from kv_cache_manager_v2.models.backend import ArrayBackend
from kv_cache_manager_v2.models.bamba import Bamba, load_bamba
from kv_cache_manager_v2.models.check import check_against_dense as check_paged_against_dense
from kv_cache_manager_v2.models.gguf_model import Model
from kv_cache_manager_v2.models.hybrid_paged import Generation, HybridEngine, check_against_dense, hybrid_layers
from kv_cache_manager_v2.models.serving import GeneratedSequence, GenerationOptions, GenerationResult, Prompt, paged_kv
from kv_cache_manager_v2.models.transformer import Transformer
from tests.model_helpers import require_model, serve_model_and_check

KIB = 1024
TPB = 4


def hybrid_engine(model: Bamba) -> HybridEngine:
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=hybrid_layers(model.spec, TPB),
        cache_tiers=[GpuCacheTierConfig(200 * KIB), HostCacheTierConfig(300 * KIB)],
        backend="cpu",
        ssm_reuse_interval=0,
        mamba_save_last_snapshot=True,
        enable_partial_reuse=True,
        typical_step=BatchDesc([KVCacheDesc(128, 127)]),
    )
    probe = KVCacheManager(config)
    plain = {
        group: sum(probe.get_storage_statistics(0)[probe.get_pool_group_index(group)].slot_sizes)
        for group in range(len(probe.layer_grouping))
    }
    probe.shutdown()
    codec = _introspection.create_test_padding_cold_page_codec({group: size + 48 for group, size in plain.items()})
    return HybridEngine(model, KVCacheManager(config, cold_page_codec=codec))


def stepped(
    engine: HybridEngine, prompt: list[int], new_tokens: int, chunk: int, snapshot_at: tuple[int, ...],
    rng: random.Random, counts: dict[str, int],
) -> Generator[None, None, Generation]:
    """One request, a pass per ``next``: prefill chunks end at the cache's snapshot points and (as
    ``HybridEngine`` does) at the prompt's last full block; after a pass the cache may be suspended (maybe
    offloaded), and it is prefetched and resumed when the request is stepped again. Yields while a resume or a
    resize is refused."""
    manager = engine.manager
    cache = manager.create_kv_cache(None, prompt[:-1], snapshot_at=snapshot_at)
    while not cache.resume():
        yield
    reused = cache.num_committed_tokens
    tokens = list(prompt)
    rows: list[npt.NDArray[np.float32]] = []
    generated: list[int] = []
    last_block_end = len(prompt) // TPB * TPB
    try:
        while True:
            decoding = cache.history_length >= len(prompt)
            if decoding:
                if not generated:
                    generated.append(int(np.argmax(rows[-1][-1])))
                if len(generated) >= new_tokens:
                    break
                tokens.append(generated[-1])
                end = len(tokens)
            else:
                stops = [*cache.snapshot_points, last_block_end, cache.history_length + chunk, len(prompt)]
                end = min(stop for stop in stops if stop > cache.history_length)
            begin = cache.history_length
            while not cache.resize(end):
                yield
            states = engine.slots.read(cache) if begin > 0 else engine.model.initial_states()
            engine.attention.begin(cache)
            ids = np.asarray(tokens[begin:end], dtype=np.int64)
            out = engine.model.forward(ids, np.arange(begin, end, dtype=np.int64), states, engine.attention.attend)
            engine.slots.write(cache, states)
            cache.commit(tokens[cache.num_committed_tokens : end])
            rows.append(out)
            if decoding:
                generated.append(int(np.argmax(out[-1])))
            if rng.random() < 0.4:
                cache.suspend()
                counts["suspends"] += 1
                if rng.random() < 0.5:
                    counts["offloaded"] += cache.offload()
                yield
                counts["prefetched"] += cache.prefetch(evict=rng.random() < 0.5)
                while not cache.resume():
                    yield
            else:
                yield
        cache.stop_committing()
    finally:
        cache.close()
    return Generation(list(prompt), reused, np.concatenate(rows), generated)


def test_bamba_interleaved_suspended_requests_resume_from_snapshots_inside_blocks() -> None:
    model = load_bamba()
    engine = hybrid_engine(model)
    rng = random.Random(3)
    vocab = model.spec.vocab_size
    system = [rng.randrange(vocab) for _ in range(30)]
    counts = {"suspends": 0, "offloaded": 0, "prefetched": 0}
    finished: list[Generation] = []
    live: list[Generator[None, None, Generation]] = []
    for index in range(12):
        conversations = [run.prompt + run.tokens[:-1] for run in finished]
        base = rng.choice([system, *conversations]) if conversations else system
        opening = base[: rng.randint(len(base) // 2, len(base))]
        prompt = opening + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        inside = tuple(point for point in (rng.randint(1, len(prompt)),) if point % TPB)  # a point inside a block
        live.append(stepped(engine, prompt, rng.randint(2, 5), rng.choice([3, 7, 16]), inside, rng, counts))
        while len(live) > (2 if index < 11 else 0):  # up to three requests in flight
            request = rng.choice(live)
            try:
                next(request)
            except StopIteration as done:
                live.remove(request)
                finished.append(done.value)
    engine.manager.shutdown()
    for run in finished:
        check_against_dense(model, run)
    reuses = [run.reused for run in finished]
    assert sum(1 for reused in reuses if reused % TPB) >= 1, reuses  # resumed from a snapshot inside a block
    assert sum(1 for reused in reuses if reused) >= 6, reuses
    assert counts["suspends"] >= 10 and counts["offloaded"] > 0 and counts["prefetched"] > 0, counts


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


def lookup_drafts(tokens: list[int], count: int) -> list[int]:
    """Prompt-lookup drafting: the tokens that followed the previous occurrence of the last token."""
    for start in range(len(tokens) - 2, -1, -1):
        if tokens[start] == tokens[-1]:
            return tokens[start + 1 : start + 1 + count]
    return []


def test_smollm2_windowed_speculative_drafts_equal_greedy() -> None:
    """Each decode step drafts up to 3 tokens, ``resize``s to hold them, verifies them in one pass and commits the
    accepted prefix; the next step's ``resize`` gives the rejected drafts' room back and overwrites their rows.
    Two caches take turns, and the second prompt repeats the first's opening, so it reuses cached blocks."""
    smollm2 = require_model("smollm2")
    windows = tuple(None if layer % 3 == 2 else 6 for layer in range(smollm2.spec.num_layers))
    model = dataclasses.replace(smollm2, spec=dataclasses.replace(smollm2.spec, windows=windows, num_sink_tokens=2))
    options = GenerationOptions(max_new_tokens=16, tokens_per_block=4, gpu_mib=32, host_mib=0, stop_at_eos=False)
    transformer = Transformer(model, ArrayBackend("cpu"))
    paged = paged_kv(model.spec, transformer.backend, options)
    manager = paged.manager
    texts = ["one two three one two three one two three one", "one two three one two, and then four five six"]
    sequences = [GeneratedSequence(index, Prompt(text)) for index, text in enumerate(texts)]
    caches: list[KVCache] = []
    accepted = rejected = 0
    while any(len(sequence.output_ids) < options.max_new_tokens for sequence in sequences):
        for index, sequence in enumerate(sequences):
            if index == len(caches):  # admitted after the earlier ones' first step: it reuses what they committed
                sequence.prompt_ids = model.tokenizer.encode(sequence.prompt.text)
                caches.append(manager.create_kv_cache(None, sequence.prompt_ids[:-1]))
                assert caches[-1].resume()
                sequence.reused_tokens = caches[-1].num_committed_tokens
            cache = caches[index]
            left = options.max_new_tokens - len(sequence.output_ids)
            if left == 0:
                continue
            tokens = sequence.tokens
            drafts = lookup_drafts(tokens, min(3, left - 1)) if sequence.output_ids else []
            # Down too, after a step that rejected drafts: their room goes back.
            assert cache.resize(len(tokens) + len(drafts)), cache.last_refusal
            paged.begin([cache])
            begin = cache.history_length
            ids = np.asarray(tokens[begin:] + drafts, dtype=np.int64)
            rows = np.arange(len(ids) - len(drafts) - 1, len(ids), dtype=np.int64)
            logits = transformer.forward(ids, np.arange(begin, cache.capacity, dtype=np.int64), rows, paged.attend)
            for draft, row in enumerate(logits):  # row i verifies drafts[i]; the first rejected one ends the step
                sequence.logits.append(row)
                sequence.output_ids.append(int(np.argmax(row)))
                if draft == len(drafts) or drafts[draft] != sequence.output_ids[-1]:
                    break
            kept = len(sequence.tokens) - 1  # the tokens whose K/V this pass wrote and the target model accepted
            accepted += kept - len(tokens)
            rejected += len(tokens) + len(drafts) - kept
            cache.commit(sequence.tokens[cache.num_committed_tokens : kept])
    for cache in caches:
        cache.close()
    paged.close()
    result = GenerationResult("smollm2 windowed", options, sequences)
    check = check_paged_against_dense(transformer, result)
    assert all(verdict.equal for verdict in check.sequences), [verdict.output_ids for verdict in check.sequences]
    assert check.within_tolerance("cpu"), check.max_logit_delta
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert sequences[1].reused_tokens > 0
