"""Prefill and decode of a real model in two processes, the KV moved over NIXL (issue 18).

The prefill side is a spawned child running ``models.disaggregated.prefill_process``; the decode side is this
process (``Decoder``). Each scenario first serves the prompts with the single-process engine (``serving.Server``),
hands the same prompt ids off, decodes, and requires identical greedy tokens; the bytes moved per layer group are
computed independently from the model's shape.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from kv_cache_manager_v2.models.disagg_demo import CAPITALS
from kv_cache_manager_v2.models.disaggregated import Decoder, Handoff, prefill_process
from kv_cache_manager_v2.models.gguf_model import Model
from kv_cache_manager_v2.models.serving import GenerationOptions, Prompt, Server
from kv_cache_manager_v2.__main__ import main
from tests.model_helpers import require_model
from tests.nixl_helpers import child_side, require_nixl

SYSTEM = (
    "You are a careful assistant for a school quiz. Read each question, think about the facts you know, and answer "
    "with one short and correct sentence.\n\n"
)


def block_bytes(model: Model, layers: list[int], tokens_per_block: int) -> int:
    """K and V of one block of ``layers`` on the cpu backend (fp32 pages)."""
    spec = model.spec
    return len(layers) * 2 * tokens_per_block * spec.num_kv_heads * spec.head_dim * np.dtype(np.float32).itemsize


def run_disaggregated(
    model_name: str, prompts: list[Prompt], options: GenerationOptions, prefill_gpu_mib: int
) -> tuple[list[Handoff], list[list[int]]]:
    """The single-process run's tokens, then the same prompt ids through a prefill child and this process (the
    child loads its model while this process serves the reference run)."""
    model = require_model(model_name)
    require_nixl()
    prefill_options = GenerationOptions(
        max_new_tokens=options.max_new_tokens, tokens_per_block=options.tokens_per_block, gpu_mib=prefill_gpu_mib,
        host_mib=0, chunk=options.chunk,
    )
    with child_side(prefill_process, model_name, prefill_options) as side:
        reference = Server(model, options).run(prompts)
        decoder = Decoder(model, options, side.connection)
        handoffs = [decoder.hand_off(s.index, s.prompt_ids) for s in reference.sequences]
        decoder.decode(handoffs)
        decoder.paged.manager.check_invariants()
        decoder.close()
        assert side.wait_exit() == 0
    return handoffs, [s.output_ids for s in reference.sequences]


def test_smollm2_decode_side_reuses_the_shared_system_prompt() -> None:
    prompts = [
        Prompt(SYSTEM + "Question: What is the largest planet of the solar system?\nAnswer:"),
        Prompt(SYSTEM + "Question: Which gas do plants take in from the air?\nAnswer:"),
    ]
    tpb = 16
    options = GenerationOptions(max_new_tokens=8, tokens_per_block=tpb, gpu_mib=32, host_mib=32)
    handoffs, reference = run_disaggregated("smollm2", prompts, options, prefill_gpu_mib=96)
    assert [h.output_ids for h in handoffs] == reference
    model = require_model("smollm2")
    per_block = block_bytes(model, list(range(model.spec.num_layers)), tpb)
    first, second = handoffs
    common = len(os.path.commonprefix([first.prompt_ids, second.prompt_ids]))
    assert first.reused_tokens == 0 and second.reused_tokens // tpb == common // tpb >= 2
    for handoff in handoffs:
        blocks = -(-len(handoff.prompt_ids) // tpb)
        held = handoff.reused_tokens // tpb
        assert handoff.plan.bytes_per_layer_group == [(blocks - held) * per_block]
        assert handoff.naive_bytes_per_layer_group == [blocks * per_block]
        assert handoff.seconds > 0


def test_gemma3_prompt_longer_than_the_window_moves_only_in_window_sliding_blocks() -> None:
    notes = "\n".join(
        f"Note {i}: the capital of {country} is {city}, a city with museums, parks and old bridges."
        for i, (country, city) in enumerate(CAPITALS, start=1)
    )
    prompts = [Prompt("Notes about Europe.\n" + notes + "\nQuestion: What is the capital of Italy?\nAnswer:")]
    tpb = 16
    options = GenerationOptions(max_new_tokens=3, tokens_per_block=tpb, gpu_mib=48, host_mib=0)
    handoffs, reference = run_disaggregated("gemma3", prompts, options, prefill_gpu_mib=96)
    assert [h.output_ids for h in handoffs] == reference
    model = require_model("gemma3")
    window = 512
    sliding = [layer for layer, size in enumerate(model.spec.windows) if size == window]
    full = [layer for layer, size in enumerate(model.spec.windows) if size is None]
    assert len(sliding) + len(full) == model.spec.num_layers and sliding and full
    [handoff] = handoffs
    length = len(handoff.prompt_ids)
    blocks = -(-length // tpb)
    stale = (length + 1 - window) // tpb  # SPEC §3: blocks [0, stale) are out of the window at history = length
    assert length > window + tpb and stale >= 2
    plan = handoff.plan
    kinds = [group.kind for group in plan.groups]
    sliding_group, full_group = kinds.index(f"sliding window {window}"), kinds.index("full attention")
    assert plan.blocks_per_layer_group[sliding_group] == blocks - stale
    assert plan.blocks_per_layer_group[full_group] == blocks
    assert plan.bytes_per_layer_group[sliding_group] == (blocks - stale) * block_bytes(model, sliding, tpb)
    assert plan.bytes_per_layer_group[full_group] == blocks * block_bytes(model, full, tpb)
    assert handoff.naive_bytes_per_layer_group[sliding_group] == blocks * block_bytes(model, sliding, tpb)


def test_disagg_demo_prints_completions_bytes_and_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    require_model("smollm2")
    require_nixl()
    status = main(
        ["disagg-demo", "--model", "smollm2", "--prompt", SYSTEM + "Question: Is the Sun a star?\nAnswer:",
         SYSTEM + "Question: Is the Moon a planet?\nAnswer:", "--max-new-tokens", "3", "--plain"]
    )
    text = capsys.readouterr().out
    assert status == 0
    assert text.count("(equal to the single-process run: yes)") == 2
    assert "every completion equals the single-process run     yes" in text
    match = re.search(r"\n0\s+full attention\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)%", text)
    assert match is not None, text
    moved, naive = (int(match.group(i).replace(",", "")) for i in (1, 2))
    assert 0 < moved < naive  # the second prompt's system prompt was already on the decode side
    assert re.search(r"transfer rate\s+\d+\.\d\d GB/s", text), text


def test_disagg_demo_bad_options_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    require_model("smollm2")
    require_nixl()
    with pytest.raises(SystemExit) as exit_info:
        main(["disagg-demo", "--model", "smollm2", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # Each named --gpu-mib / --host-mib, flags disagg-demo does not have.
        (["--prefill-gpu-mib", "0"], "error: --prefill-gpu-mib must be >= 1, got 0\n"),
        (["--decode-gpu-mib", "0"], "error: --decode-gpu-mib must be >= 1, got 0\n"),
        (["--decode-host-mib", "-1"], "error: --decode-host-mib must be >= 0, got -1\n"),
    ],
)
def test_disagg_demo_quota_errors_name_the_side_s_flag(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    require_model("smollm2")
    require_nixl()
    with pytest.raises(SystemExit) as exit_info:
        main(["disagg-demo", "--model", "smollm2", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # The prefill process died with a traceback and the decode side said only "the peer closed the control
        # connection" (an empty prompt), or the decode side ended in a traceback (quotas).
        (["--prompt", ""], "error: prompt 0 is empty"),
        (["--prefill-gpu-mib", "1", "--tokens-per-block", "64"], "error: --prefill-gpu-mib 1 / --tokens-per-block 64: "
         "no manager can be built from these"),
        (["--decode-host-mib", "100000000000"], "--decode-host-mib 100000000000 / --tokens-per-block 16: no manager"),
    ],
)
def test_disagg_demo_checks_prompts_and_quotas_before_starting_the_prefill_process(
    flags: list[str], expected: str, capfd: pytest.CaptureFixture[str]
) -> None:
    require_model("smollm2")
    require_nixl()
    assert main(["disagg-demo", "--model", "smollm2", *flags]) == 2
    err = capfd.readouterr().err  # capfd: a prefill process's traceback would go to the shared stderr
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err
