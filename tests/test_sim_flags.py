"""``simulate`` flags a run would ignore, or take past any use, are one-line usage errors before any work: a flag
acting on a layer kind the model lacks (as the seeded workload's flags with ``--trace``), and a prefill chunk
longer than any prompt a run can hold (as the tier quotas and ``--max-batch``). Checked in-process: the CLI's
process behaviour (one line, status 2) is ``test_cli.py``'s."""

from __future__ import annotations

import argparse

import pytest

from kv_cache_manager_v2.__main__ import build_parser
from kv_cache_manager_v2.sim.flags import check_options, check_sweep
from kv_cache_manager_v2.sim.options import MAX_CHUNK, SimulatorOptions
from kv_cache_manager_v2.sim.presets import PRESET_NAMES


def parse(flags: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", "--backend", "cpu", *flags])


def checked(flags: list[str]) -> SimulatorOptions:
    """The options of a command that passes every check, sweep points included."""
    args = parse(flags)
    options = check_options(args)
    if args.sweep is not None:
        check_sweep(args, options)
    return options


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--preset", "llama", "--ssm-interval", "64"],
         "--preset llama has no SSM layers for --ssm-interval 64 to act on: drop it"),
        (["--mamba-save-last-snapshot"],
         "the default preset (gemma) has no SSM layers for --mamba-save-last-snapshot to act on: drop it"),
        (["--preset", "hybrid-ssm", "--scratch"],
         "--preset hybrid-ssm has no sliding-window layers for --scratch to act on: drop it"),
        (["--layers", "4", "--scratch", "--ssm-interval", "0"],
         "the custom model (4 layers, 8 KV heads x 128) has no SSM layers for --ssm-interval 0 and no sliding-window "
         "layers for --scratch to act on: drop them"),
        (["--preset", "llama", "--sweep", "ssm-interval=64,128"],
         "--sweep ssm-interval=64,128: --preset llama has no SSM layers for --ssm-interval to act on (every point "
         "would be the same run)"),
        ([f"--chunk={10**20}"],
         f"--chunk must be <= {MAX_CHUNK:,} tokens (the longest prompt a run holds), got {10**20:,}"),
        (["--sweep", f"chunk=512,{MAX_CHUNK + 1}"],
         f"--sweep chunk={MAX_CHUNK + 1}: --chunk must be <= {MAX_CHUNK:,} tokens (the longest prompt a run holds), "
         f"got {MAX_CHUNK + 1:,}"),
    ],
    ids=["ssm-interval", "last-snapshot", "scratch", "custom-model-both", "sweep", "chunk", "chunk-sweep"],
)
def test_a_flag_that_would_do_nothing_or_run_past_any_use_is_a_usage_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, each of these ran: the first five as the run without the flag, --chunk 10**20 as --chunk 2**24."""
    with pytest.raises(SystemExit) as exited:
        checked(flags)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize(
    "flags",
    [
        ["--preset", "hybrid-ssm", "--ssm-interval", "64", "--mamba-save-last-snapshot"],
        ["--preset", "hybrid-ssm", "--mamba-save-last-snapshot", "--sweep", "ssm-interval=0,256"],
        ["--scratch", "--chunk", "2048"],
        ["--layers", "14", "--attention-every", "7", "--window", "64", "--scratch", "--ssm-interval", "64"],
        ["--preset", "llama", "--no-scratch", "--no-mamba-save-last-snapshot"],  # what the model runs anyway
        ["--chunk", str(MAX_CHUNK)],
    ],
)
def test_the_flags_pass_where_they_act(flags: list[str]) -> None:
    checked(flags)


def test_every_preset_takes_the_default_flags() -> None:
    """The defaults are never refused: a layer flag counts only when it differs from its default."""
    for preset in PRESET_NAMES:
        assert checked(["--preset", preset]).preset == preset


def test_the_options_refuse_a_chunk_past_the_longest_prompt() -> None:
    """For a caller without the flags (a tool, a test) as for the CLI, which words the same error as its flag."""
    assert SimulatorOptions(chunk=MAX_CHUNK).chunk == MAX_CHUNK
    with pytest.raises(ValueError, match=f"^chunk must be <= {MAX_CHUNK:,} tokens .*, got {MAX_CHUNK + 1:,}$"):
        SimulatorOptions(chunk=MAX_CHUNK + 1)
