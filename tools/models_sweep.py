"""Seeded random serving runs of a real model, each sequence checked against the dense reference.

Each run draws prompts (a shared prefix with different endings, unrelated ones, follow-up turns; lengths mixed)
and options (block size, prefill chunks of 1, a block less one, a block plus one or longer, batch size, new
tokens, small GPU quotas that force offloading, preemption and recompute, host tier or none, SWA scratch reuse)
and requires every greedy token of the paged run to equal the dense run's. A run the options cannot serve
(``GenerationError``: the quota is too small for a sequence) is counted, not failed.

Gemma 3's 512-token window needs long prompts to matter, so ``--window N`` (or a random small one per run)
replaces it by N in both paths: the same weights under a shorter mask, which the paged path and the dense
reference both apply, so windows not aligned to blocks, stale blocks and scratch are exercised by short prompts.
``--sinks N`` also gives those layers N sink tokens (``-1``: a random count up to 8 per run), kept in sink blocks
while the blocks after them go stale.

    python tools/models_sweep.py --model gemma3 --seed 1 --runs 20      # exit 1 on the first difference

Several seconds a run on a CPU; set ``OPENBLAS_NUM_THREADS=1`` on a busy machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

from kv_cache_manager_v2.models.check import check_against_dense
from kv_cache_manager_v2.models.gguf_model import Model, load_model
from kv_cache_manager_v2.models.serving import GenerationError, GenerationOptions, Prompt, Server

WORDS = "the cat sat on a mat while red birds sang over quiet hills near old stone bridges and rivers".split()


def with_window(model: Model, window: int, sinks: int = 0) -> Model:
    """``model`` whose sliding-window layers see ``window`` tokens and ``sinks`` sink tokens (global layers
    unchanged)."""
    windows = tuple(None if size is None else window for size in model.spec.windows)
    spec = dataclasses.replace(model.spec, windows=windows, num_sink_tokens=sinks)
    return dataclasses.replace(model, spec=spec)


def draw_prompts(rng: random.Random) -> list[Prompt]:
    def text(count: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(count))

    shared = text(rng.randint(5, 40))
    prompts: list[Prompt] = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.random()
        if prompts and kind < 0.25:
            prompts.append(Prompt(" " + text(rng.randint(1, 8)), follows=rng.randrange(len(prompts))))
        elif kind < 0.7:
            prompts.append(Prompt(f"{shared} {text(rng.randint(0, 10))}"))
        else:
            prompts.append(Prompt(text(rng.randint(1, 30))))
    return prompts


def draw_options(rng: random.Random, windowed: bool) -> GenerationOptions:
    tokens_per_block = rng.choice([1, 2, 3, 4, 5, 8, 16])
    return GenerationOptions(
        max_new_tokens=rng.randint(1, 8),
        tokens_per_block=tokens_per_block,
        gpu_mib=rng.choice([2, 3, 8] if windowed else [1, 1.5, 2, 3, 8]),  # Gemma's two pool groups need more
        host_mib=rng.choice([0, 1, 64]),
        chunk=rng.choice([1, max(1, tokens_per_block - 1), tokens_per_block + 1, 7, 64]),
        max_batch=rng.randint(1, 6),
        scratch=windowed and rng.random() < 0.5,
        stop_at_eos=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--window", type=int, default=0, help="gemma3: this window in every run (0: random small)")
    parser.add_argument("--sinks", type=int, default=0, help="gemma3: sink tokens per window (-1: random, 0-8)")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    windowed = any(size is not None for size in model.spec.windows)
    rng = random.Random(args.seed)
    served = refused = 0
    for run in range(args.runs):
        window = (args.window or rng.choice([4, 7, 12, 20, 33])) if windowed else None
        prompts, options = draw_prompts(rng), draw_options(rng, windowed)
        sinks = (rng.randint(0, 8) if args.sinks < 0 else args.sinks) if windowed else 0
        server = Server(model if window is None else with_window(model, window, sinks), options)
        start = time.perf_counter()
        try:
            result = server.run(prompts)
        except GenerationError as error:
            refused += 1
            print(f"run {run}: refused ({error})")
            continue
        check = check_against_dense(server.transformer, result)
        served += 1
        print(f"run {run}: window {window}, sinks {sinks}, {vars(options)}: {len(prompts)} prompts, "
              f"{result.preemptions} preemptions, {result.recomputes} recomputes, reused {result.reused_tokens}, "
              f"max |delta logit| {check.max_logit_delta:.1e}, {time.perf_counter() - start:.1f} s")
        for verdict, sequence in zip(check.sequences, result.sequences):
            if not verdict.equal:
                print(f"DIFFERENCE, seed {args.seed} run {run}, sequence {sequence.index}: paged "
                      f"{sequence.output_ids} != dense {verdict.output_ids}; prompts {prompts}")
                return 1
        if not check.within_tolerance(options.backend):
            print(f"LOGIT DELTA {check.max_logit_delta} past the tolerance, seed {args.seed} run {run}")
            return 1
    print(f"{served} runs equal to the dense reference, {refused} refused by their quotas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
