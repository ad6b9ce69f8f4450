"""``simulate`` under seeded random flag combinations, as a new user varies the README's command: valid, boundary
and invalid values (0, 1, negative, huge, floats, empty strings, unknown names, files that are directories or
empty or not JSON, paths that cannot be written). The contract: exit 0 with figures that agree with each other,
1 when every request was rejected, or 2 with one line naming a flag; never a traceback, never a hang.

CI runs ``CLI_FUZZ_SEEDS`` seeds (6); ``KV_CACHE_MANAGER_V2_CLI_FUZZ_SEEDS=400`` runs a wider slice by hand (the
session that wrote it ran 600: the defects it found have tests of their own in ``test_cli_streams.py`` and
``test_cli_figures.py``).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import IMPORT_ROOT

CLI_FUZZ_SEEDS = int(os.environ.get("KV_CACHE_MANAGER_V2_CLI_FUZZ_SEEDS", "6"))
INTS = ["0", "1", "-1", "2", "7", "64", str(10**9), str(10**30), "1.5", "", "abc", "nan", "1e3", "0x10"]
FLOATS = ["0", "1", "-0.5", "0.5", "nan", "inf", "-inf", "1e308", "1e-300", "", "x"]
PAIRS = ["1,1", "0,0", "5,3", "1,2048", "-1,5", "1", "", "a,b", "1,2,3", "10,100000000", "1.5,2"]
# Values a user would try: each drawn 3 times in 4, so that most runs get past the usage checks.
VALID = {
    "--requests": ["1", "2", "3"], "--seed": ["0", "1", "-3", str(2**70)], "--gpu-mib": ["1", "8", "64", "1024"],
    "--host-mib": ["0", "1", "64"], "--disk-mib": ["0", "1", "16"], "--tokens-per-block": ["1", "16", "64", "512"],
    "--max-batch": ["1", "2", "64"], "--chunk": ["1", "16", "100", "4096"], "--ssm-interval": ["0", "1", "64", "500"],
    "--max-prompt-len": ["1", "32", "300", "5000"], "--user-len": ["1,1", "1,8", "100,200"],
    "--long-user-len": ["1,1", "200,300"], "--output-len": ["1,1", "1,4", "10,50"], "--long-output-len": ["1,1", "2,3"],
    "--shared-prefix-len": ["1,1", "1,16", "100,100"], "--long-user-fraction": ["0", "1", "0.5"],
    "--long-output-fraction": ["0", "1"], "--turns": ["1", "2", "10"], "--shared-prefixes": ["0", "1", "3"],
    "--shared-prefix-fraction": ["0", "1", "0.3"], "--arrival-rate": ["0.01", "1", "inf"],
    "--layers": ["1", "2", "7"], "--kv-heads": ["1", "2"], "--head-dim": ["1", "8", "64"], "--window": ["0", "1", "100"],
    "--full-every": ["0", "1", "2"], "--attention-every": ["1", "2", "3"], "--trace-limit": ["1", "3"],
    "--trace-speed": ["0.5", "100", "1e6"],
}
BOOLS = ["--scratch", "--no-scratch", "--mamba-save-last-snapshot", "--batch-admission", "--no-check",
         "--compare-no-reuse", "--closed-loop", "--bookkeeping"]


def flag_values(tmp: Path) -> dict[str, list[str]]:
    """Every value flag's candidates, the files they name made in ``tmp``."""
    (tmp / "empty.jsonl").write_text("")
    (tmp / "not_utf8.jsonl").write_bytes(b'{"timestamp": 1, "input_length": \xff\n')
    (tmp / "not_json.jsonl").write_text("hello\n")
    (tmp / "backwards.jsonl").write_text(
        '{"timestamp": 500, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
        '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}\n'
    )
    (tmp / "two.jsonl").write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
        '{"timestamp": 60, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}\n'
    )
    (tmp / "gzipped.jsonl").write_bytes(gzip.compress((tmp / "two.jsonl").read_bytes()))
    (tmp / "epoch.jsonl").write_text(  # a production log's Unix-epoch milliseconds
        '{"timestamp": 1732000000037, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1732000000097, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}\n'
    )
    (tmp / "no_hash_ids.jsonl").write_text('{"timestamp": 0, "input_length": 600, "output_length": 4}\n')
    trace = os.path.join(IMPORT_ROOT, "..", "traces", "mooncake_synthetic_trace.jsonl")
    traces = [str(tmp / name) for name in ("empty.jsonl", "not_utf8.jsonl", "not_json.jsonl", "backwards.jsonl",
                                           "gzipped.jsonl", "no_hash_ids.jsonl")]
    return {
        "--preset": ["llama", "gemma", "hybrid-ssm", "", "LLAMA"],
        **{flag: INTS for flag in VALID if flag not in ("--user-len", "--long-user-len", "--output-len",
                                                        "--long-output-len", "--shared-prefix-len")},
        **{flag: PAIRS for flag in ("--user-len", "--long-user-len", "--output-len", "--long-output-len",
                                    "--shared-prefix-len")},
        **{flag: FLOATS for flag in ("--long-user-fraction", "--long-output-fraction", "--shared-prefix-fraction",
                                     "--arrival-rate", "--trace-speed", "--kv-events-wait")},
        "--disk-dir": [str(tmp), str(tmp / "empty.jsonl"), "/proc/no_such_dir", ""],
        "--backend": ["cpu", "cuda", ""],
        "--json": [str(tmp / "run.json"), str(tmp), str(tmp / "no_dir" / "run.json"), "-", ""],
        "--plot": [str(tmp / "run.png"), str(tmp), str(tmp / "run.jpg"), ""],
        "--output-dir": [str(tmp / "out"), str(tmp / "empty.jsonl"), "/proc/no_such_dir", ""],
        "--sweep": ["gpu-mib=64,128", "seed=0,1", "foo=1", "gpu-mib=", "chunk=0,1", "turns=1,x"],
        "--trace": [*([trace] if os.path.isfile(trace) else []), str(tmp / "two.jsonl"), str(tmp / "epoch.jsonl"),
                    *traces, str(tmp), ""],
        "--sweep-gpu-mib": ["64,128", "0", "", "a"],
        "--kv-events-topic": ["t", ""],
    }


def random_flags(rng: random.Random, values: dict[str, list[str]]) -> list[str]:
    args: list[str] = []
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.25:
            args.append(rng.choice(BOOLS))
            continue
        flag = rng.choice(sorted(values))
        args += [flag, rng.choice(VALID[flag] if flag in VALID and rng.random() < 0.75 else values[flag])]
    if "--trace" in args:
        return args if "--trace-limit" in args else [*args, "--trace-limit", "3"]
    return ["--requests", rng.choice(VALID["--requests"]), *args]


def check_figures(report: dict[str, object], args: list[str]) -> list[str]:
    """Figures that must agree, recomputed from the JSON report: what differs."""
    r: dict[str, object] = report
    wrong: list[str] = []

    def agree(name: str, got: object, expected: float) -> None:
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-6 * max(1.0, abs(expected)):
            wrong.append(f"{name}: {got} != {expected}")

    prompt, reused = int(str(r["prompt_tokens"])), int(str(r["reused_tokens"]))
    agree("hit_rate", r["hit_rate"], reused / prompt if prompt else 0.0)
    agree("computed_tokens", r["computed_tokens"], float(str(r["prefill_tokens"])) + float(str(r["decode_tokens"])))
    agree("finished + rejected", float(str(r["finished"])) + float(str(r["rejected"])), float(str(r["requests"])))
    by_tier = r["reused_tokens_by_tier"]
    assert isinstance(by_tier, dict)
    agree("reused_tokens_by_tier", sum(by_tier.values()), reused)
    seconds = float(str(r["manager_seconds"]))
    agree("manager split", float(str(r["manager_bookkeeping_seconds"])) + float(str(r["manager_copy_seconds"])), seconds)
    busy = int(str(r["steps"])) - int(str(r["idle_steps"]))
    agree("µs/step", r["manager_us_per_step"], seconds * 1e6 / busy if busy else 0.0)
    ideal = r["ideal_hit_rate"]
    if isinstance(ideal, float) and float(str(r["hit_rate"])) > ideal + 1e-12:
        wrong.append(f"hit rate {r['hit_rate']} above the ideal {ideal}")
    groups = r["layer_groups"]
    assert isinstance(groups, list)
    for group in groups:
        agree(f"layer group {group['layer_group']} pages by tier", sum(group["reused_pages_by_tier"].values()),
              group["reused_pages"])
    pools = r["pool_groups"]
    assert isinstance(pools, list)
    for pool in pools:
        if not pool["peak_in_use"] <= pool["peak_occupied"] <= pool["gpu_slots"]:
            wrong.append(f"pool group peaks {pool}")
    movement = r["movement"]
    assert isinstance(movement, dict)
    slot_bytes = [pool["slot_bytes"] for pool in pools]
    for kind in ("offloaded", "onboarded"):
        pages, moved = movement[f"{kind}_pages"], movement[f"{kind}_bytes"]
        if not min(slot_bytes) * pages <= moved <= max(slot_bytes) * pages:
            wrong.append(f"{kind}: {moved} bytes for {pages} pages of {slot_bytes} bytes")
    timeline = r["timeline"]
    assert isinstance(timeline, dict)
    agree("timeline samples (one per busy step)", len(timeline["step"]), busy)
    checked = "--no-check" not in args and "--bookkeeping" not in args
    if int(str(r["finished"])) > 0 and checked != (int(str(r["checked_tokens"])) > 0):
        wrong.append(f"checked_tokens {r['checked_tokens']} with content checks {'on' if checked else 'off'}")
    return wrong


def run_simulate(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    command = [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, env=environment, cwd=cwd, timeout=120,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung past 120 s: {shlex.join(args)}")


@pytest.mark.parametrize("seed", range(CLI_FUZZ_SEEDS))
def test_random_flags_end_in_figures_that_agree_or_a_one_line_usage_error(seed: int, tmp_path: Path) -> None:
    args = random_flags(random.Random(seed), flag_values(tmp_path))
    # Truth checks need the report: --json FILE unless the run already writes one or prints it.
    report_path = tmp_path / "report.json"
    if "--json" not in args and "--sweep" not in args and "--sweep-gpu-mib" not in args:
        args += ["--json", str(report_path)]
    result = run_simulate(args, tmp_path)
    where = f"simulate {shlex.join(args)}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, where
    assert result.returncode in (0, 1, 2), where
    if result.returncode == 2:
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, where
        named = set(re.findall(r"--[a-z][a-z-]*", result.stderr))
        assert named & {arg for arg in args if arg.startswith("--")}, where  # names a flag the user gave
        return
    if report_path.exists():
        report = json.loads(report_path.read_text())
        assert check_figures(report, args) == [], where
