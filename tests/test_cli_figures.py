"""The simulator's figures agree with each other and say what they mean; its workload, model, output, sweep and
baseline flags work and are checked before any work (issue #22, points 4-7).

CLI runs go through ``tests/test_cli.py``'s subprocess helper (the package this session imported, cpu backend).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._storage.memory import COPY_CLOCK
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.plot import run_figure
from kv_cache_manager_v2.sim.report import result_json, summary_tables, sweep_table
from kv_cache_manager_v2.sim.result import Distribution
from kv_cache_manager_v2.sim.scheduler import Workload
from kv_cache_manager_v2.sim.simulator import simulate as simulate_in_process
from kv_cache_manager_v2.sim.workload import TraceRequest
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config
from tests.test_cli import assert_one_line_error, run_json, simulate


def load(path: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads(path.read_text())
    return report


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, (pattern, text[-3000:])
    return int(match.group(1).replace(",", ""))


# ------------------------------------------------------------------------------------ figures that agree
def test_progress_table_and_json_agree_on_steps_and_computed_tokens(tmp_path: Path) -> None:
    """One clock and one token count: the last progress line's step is the table's and the JSON's step count
    (arrival gaps are idle steps, not left out), and the table's computed tokens are the JSON's."""
    out = tmp_path / "run.json"
    result = simulate("--requests", "10", "--plain", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = load(out)
    progress = [line for line in result.stderr.splitlines() if line.startswith("simulate: simulating: ")]
    assert progress and "10/10 requests finished" in progress[-1]
    final_step = number(r"step ([\d,]+)$", progress[-1])
    table_steps = number(r"steps\s+([\d,]+) \(", result.stdout)
    assert final_step == table_steps == report["steps"]
    idle = number(r"busy, ([\d,]+) idle", result.stdout)
    assert idle == report["idle_steps"] and isinstance(report["idle_steps"], int) and report["idle_steps"] > 0
    table_computed = number(r"computed tokens\s+([\d,]+) \(", result.stdout)
    assert table_computed == report["computed_tokens"] == report["prefill_tokens"] + report["decode_tokens"]  # type: ignore[operator]
    # Prompt tokens not reused at first admission are all computed (no recomputation in this run).
    assert report["recomputes"] == 0
    assert report["prefill_tokens"] == report["prompt_tokens"] - report["reused_tokens"]  # type: ignore[operator]
    timeline = report["timeline"]
    assert isinstance(timeline, dict)
    assert timeline["step"][-1] <= final_step and len(timeline["step"]) == final_step - idle


def test_rejected_requests_are_not_counted_as_finished() -> None:
    result = simulate("--gpu-mib", "20", "--requests", "2", "--no-check")
    assert result.returncode == 1
    progress = [line for line in result.stderr.splitlines() if line.startswith("simulate: simulating: ")]
    assert "0/2 requests finished, 2 rejected" in progress[-1], progress


def test_plain_progress_lines_without_a_terminal_even_without_plain() -> None:
    result = simulate("--requests", "3", "--no-check")  # stderr is a pipe here
    assert result.returncode == 0, result.stderr[-3000:]
    assert "simulate: simulating: 3/3 requests finished" in result.stderr


def test_plurals_tiers_and_pool_groups_in_words() -> None:
    result = simulate("--layers", "1", "--requests", "2", "--no-check", "--plain", "--disk-mib", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "layer group 0: 1 layer -> pool group 0" in out
    assert "GPU tier, pool group 0: " in out and "host tier, pool group 0: " in out and "disk tier, pool group 0" in out
    assert "level 0" not in out and "layer(s)" not in out
    assert "a pool group = the layers whose pages have the same size" in out and "a slot = room for one page" in out
    assert re.search(r"\b1 slots\b", out) is None


def test_manager_time_is_split_into_bookkeeping_and_page_copies() -> None:
    report = json.loads(simulate("--json", "--requests", "8", "--no-check").stdout)
    copies, bookkeeping, total = (report["manager_copy_seconds"], report["manager_bookkeeping_seconds"],
                                  report["manager_seconds"])
    assert report["movement"]["offloaded_pages"] > 0 and copies > 0 and bookkeeping > 0
    assert copies + bookkeeping == pytest.approx(total)


def test_the_copy_clock_counts_the_page_copies_of_an_offload() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(2 * 8 * KIB), HostCacheTierConfig(8 * 8 * KIB)]
    manager = KVCacheManager(make_config([attention(0)], tiers=tiers, tokens_per_block=4, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    calls, ns = COPY_CLOCK.calls, COPY_CLOCK.ns
    first = manager.create_kv_cache(None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert first.resume() and first.resize(8)
    engine.step(first, [1, 2, 3, 4, 5, 6, 7, 8])
    first.suspend()
    assert COPY_CLOCK.calls == calls  # nothing moved yet: the GPU had room
    second = manager.create_kv_cache(None, [9, 10, 11, 12, 13, 14, 15, 16])
    assert second.resume() and second.resize(8)  # the suspended cache's pages go to the host tier
    assert manager.movement_counters.offloaded_pages > 0
    assert COPY_CLOCK.calls > calls and COPY_CLOCK.ns > ns
    first.close()
    second.close()
    manager.shutdown()


# ------------------------------------------------------------------------------------------- the workload
def test_the_workload_is_described_before_the_figures() -> None:
    result = simulate("--requests", "6", "--no-check", "--plain")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    workload = out.index("\nworkload\n")
    assert workload < out.index("prefix hit rate")
    for label in ("source", "requests", "prompt tokens", "output tokens", "shared prefixes", "arrivals"):
        assert re.search(rf"^{label}\s", out[workload:], re.M), label
    assert "6 in " in out and "min / median / 90th percentile / max, by nearest rank" in out
    assert "dropped: cached pages evicted out of the cache" in out  # the evictions' figure says what it counts


def test_length_percentiles_are_nearest_rank() -> None:
    """What the workload table's note says: each figure is one of the lengths (numpy interpolates: 90th percentile
    46.0 of the five, median 25.0 and 90th percentile 37.0 of the four)."""
    lengths = Distribution([40, 10, 20, 30, 50])
    assert (lengths.min, lengths.median, lengths.p90, lengths.max) == (10, 30, 50, 50)
    even = Distribution([40, 10, 20, 30])
    assert (even.median, even.p90, even.mean) == (20, 40, 25.0)


def test_workload_shape_flags_shape_the_workload() -> None:
    report = json.loads(simulate(
        "--json", "--no-check", "--requests", "12", "--user-len", "40,40", "--output-len", "3,3",
        "--long-output-fraction", "0", "--long-user-fraction", "0", "--turns", "1", "--shared-prefixes", "1",
        "--shared-prefix-len", "64,64", "--shared-prefix-fraction", "1", "--arrival-rate", "inf",
    ).stdout)
    workload = report["workload"]
    assert workload["requests"] == workload["chats"] == 12 and workload["max_turns"] == 1
    assert workload["prompt_length"]["min"] == workload["prompt_length"]["max"] == 104
    assert workload["output_length"]["min"] == workload["output_length"]["max"] == 3
    assert workload["shared_prefixes"] == 1 and workload["requests_with_shared_prefix"] == 12
    assert workload["first_arrival_step"] == workload["last_arrival_step"] == 0
    assert report["options"]["user_length"] == [40, 40] and report["finished"] == 12


@pytest.mark.parametrize(
    ("flags", "kinds"),
    [(["--layers", "4", "--window", "64", "--full-every", "2"], ["full", "swa"]),
     (["--layers", "6", "--attention-every", "3", "--kv-heads", "2", "--head-dim", "64"], ["full", "ssm"])],
)
def test_a_custom_model_shape(flags: list[str], kinds: list[str]) -> None:
    result = simulate("--json", "--requests", "4", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert str(report["model"]).startswith("custom (") and report["finished"] == 4
    assert sorted(group["kind"] for group in report["layer_groups"]) == kinds
    assert sum(group["layers"] for group in report["layer_groups"]) == int(flags[1])


# --------------------------------------------------------------------------------- outputs and baselines
def test_output_dir_and_json_file_hold_the_report_and_its_timeline(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = simulate("--requests", "4", "--no-check", "--plain", "--output-dir", str(out),
                      "--json", str(tmp_path / "run.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["plot.png", "result.json", "summary.txt"]
    assert "prefix hit rate" in (out / "summary.txt").read_text() and "prefix hit rate" in result.stdout
    report = load(tmp_path / "run.json")
    assert report == load(out / "result.json")  # one report, written twice
    timeline = report["timeline"]
    assert isinstance(timeline, dict)
    samples = len(timeline["step"])
    assert samples > 0
    for key in ("hit_rate", "running", "preemptions", "gpu_in_use", "gpu_occupied"):
        assert len(timeline[key]) == samples, key
    assert list(timeline["colder_occupied"]) == ["host"] and len(timeline["colder_occupied"]["host"]) == samples
    assert timeline["preemptions"][-1] == report["preemptions"]
    assert f"written: {tmp_path / 'run.json'}" in result.stdout


def test_compare_no_reuse_shows_what_caching_saved(tmp_path: Path) -> None:
    """One run (two simulations) prints the comparison and writes its figures to ``--json FILE``."""
    out = tmp_path / "run.json"
    result = simulate("--requests", "10", "--no-check", "--plain", "--compare-no-reuse", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "without prefix reuse" in result.stdout and "caching saved" in result.stdout
    assert "not pages moved" in result.stdout
    report = json.loads(out.read_text())
    baseline = report["no_reuse"]
    assert baseline["hit_rate"] == 0.0 and baseline["reused_tokens"] == 0 and report["reused_tokens"] > 0
    assert baseline["prefill_tokens"] == baseline["prompt_tokens"] == report["prompt_tokens"]
    assert baseline["computed_tokens"] - report["computed_tokens"] == report["reused_tokens"]


def test_version() -> None:
    import subprocess
    import sys

    from tests.test_cli import IMPORT_ROOT

    result = subprocess.run([sys.executable, "-m", "kv_cache_manager_v2", "--version"], capture_output=True,
                            text=True, cwd=IMPORT_ROOT, env={"PYTHONPATH": IMPORT_ROOT})
    assert result.returncode == 0 and result.stdout.startswith("kv_cache_manager_v2 "), result
    assert ("compiled" if "build" in IMPORT_ROOT else "interpreted") in result.stdout


def test_a_sweep_over_one_parameter(tmp_path: Path) -> None:
    result = simulate("--requests", "6", "--no-check", "--plain", "--sweep", "max-batch=1,8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hit rate against --max-batch" in result.stdout
    report = json.loads(simulate(
        "--json", "--requests", "6", "--no-check", "--turns", "1", "--arrival-rate", "inf", "--sweep", "max-batch=1,8"
    ).stdout)
    assert report["parameter"] == "--max-batch" and [point["value"] for point in report["points"]] == ["1", "8"]
    assert [point["options"]["max_batch"] for point in report["points"]] == [1, 8]
    one, eight = report["points"]
    assert one["steps"] > eight["steps"]  # all there at step 0: one request at a time takes longer


# --------------------------------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--user-len", "5"], ["--user-len 5", "MIN,MAX"]),
        (["--output-len", "9,3"], ["--output-len", "(9, 3)"]),
        (["--long-user-len", "0,4"], ["--long-user-len", "(0, 4)"]),
        (["--long-output-len", "x,y"], ["--long-output-len x,y", "MIN,MAX"]),
        (["--long-user-fraction", "1.5"], ["--long-user-fraction", "1.5"]),
        (["--shared-prefix-len", "4000,5000"], ["--shared-prefix-len", "--max-prompt-len 2048"]),
        (["--long-output-fraction", "2"], ["--long-output-fraction", "2"]),
        (["--shared-prefix-fraction", "-1"], ["--shared-prefix-fraction", "-1"]),
        (["--turns", "0"], ["--turns", "0"]),
        (["--shared-prefixes", "-1"], ["--shared-prefixes", "-1"]),
        (["--max-prompt-len", "0"], ["--max-prompt-len", "0"]),
        (["--arrival-rate", "0"], ["--arrival-rate 0"]),
        (["--arrival-rate", "nan"], ["--arrival-rate nan"]),
        # Killed by the OOM killer (32 requests of up to 1e8 tokens, each a Python int); with --requests 2 the
        # quota error said only "raise --gpu-mib or lower --tokens-per-block" (the fuzz's seed 90).
        (["--output-len", "10,100000000"], ["--output-len must be <= 131,072 tokens, got 100,000,000"]),
        (["--long-output-len", "10,200000"], ["--long-output-len must be <= 131,072 tokens, got 200,000"]),
        (["--max-prompt-len", "200000"], ["--max-prompt-len must be <= 131,072 tokens, got 200,000"]),
        (["--requests", "2", "--output-len", "131072,131072", "--gpu-mib", "32"],
         ["--gpu-mib 32 is too small", "planned for their lengths up to the 90th percentile, median ", "--output-len"]),
        # Drawing a 1e300-step gap by counting failures never ended (the workload was never built).
        (["--arrival-rate", "1e-300"], ["--arrival-rate 1e-300", "from 0.001 (a chat every 1,000 steps) to inf"]),
        (["--kv-heads", "4"], ["--kv-heads 4", "needs --layers"]),
        (["--layers", "4", "--preset", "llama"], ["--layers 4", "drop --preset llama"]),
        (["--layers", "0"], ["--layers", "0"]),
        (["--layers", "4", "--full-every", "2"], ["--full-every 2", "needs a --window"]),
        (["--layers", "4", "--attention-every", "9"], ["--attention-every", "9"]),
        (["--layers", "4", "--head-dim", "0"], ["--head-dim", "0"]),
        (["--layers", "4", "--kv-heads", "0"], ["--kv-heads", "0"]),
        (["--layers", "4", "--window", "-1"], ["--window", "-1"]),
        (["--json", "/proc/x.json"], ["--json /proc/x.json"]),
        (["--json", "OUT.txt"], ["--json", "OUT.txt", ".json"]),
        (["--output-dir", "FILE"], ["--output-dir", "not a directory"]),
        (["--output-dir", "MISSING/x"], ["--output-dir", "does not exist"]),
        (["--sweep", "nope=1"], ["--sweep nope=1", "PARAM must be one of"]),
        (["--sweep", "chunk="], ["--sweep chunk=", "at least one value"]),
        (["--sweep", "chunk=a"], ["--sweep chunk=a", "not an integer"]),
        (["--sweep", "chunk=0"], ["--sweep chunk=0", "--chunk must be > 0, got 0"]),
        (["--sweep", "arrival-rate=0"], ["--arrival-rate 0", "from 0.001"]),
        (["--sweep", "arrival-rate=1,1e-300"], ["--arrival-rate 1e-300", "from 0.001"]),
        (["--sweep", "chunk=256", "--sweep-gpu-mib", "64"], ["--sweep and --sweep-gpu-mib"]),
        # Each ran without a word: the flag's own value, all but the last --sweep, or a second run of one value ignored.
        (["--sweep", "gpu-mib=256,384", "--gpu-mib", "100"], ["--sweep gpu-mib=256,384", "drop --gpu-mib 100"]),
        (["--sweep", "chunk=256", "--sweep", "seed=1,2"], ["--sweep chunk=256 --sweep seed=1,2", "one --sweep"]),
        (["--sweep", "chunk=256,256"], ["--sweep chunk=256,256", "256 twice"]),
        (["--sweep-gpu-mib", "256,384", "--host-mib", "64", "--gpu-mib", "100"], ["drop --gpu-mib 100"]),
        (["--sweep-gpu-mib", "256,256", "--host-mib", "64"], ["--sweep-gpu-mib 256,256", "a quota given twice"]),
        (["--compare-no-reuse", "--sweep", "chunk=256"], ["--compare-no-reuse", "drop the sweep"]),
        # A sweep's point whose manager cannot be built: a ValueError traceback (a quota past 64 bits), a NumPy
        # MemoryError traceback, or the config's field names where a single run says "--gpu-mib 1 is too small".
        (["--sweep-gpu-mib", "99999999999999999999", "--host-mib", "64"],
         ["--sweep-gpu-mib 99999999999999999999: --gpu-mib must be <= 8,796,093,022,207"]),
        (["--requests", "2", "--sweep-gpu-mib", "1000000000000", "--host-mib", "64"],
         ["--sweep-gpu-mib 1000000000000 (host 0 MiB): --gpu-mib 1000000000000 / --host-mib 0: the tier quotas "
          "cannot be allocated on this machine"]),
        (["--requests", "2", "--sweep", "host-mib=1000000000000,64"],
         ["--sweep host-mib=1000000000000: --gpu-mib 384 / --host-mib 1000000000000: the tier quotas cannot be"]),
        (["--requests", "2", "--sweep", "gpu-mib=1,2"], ["--sweep gpu-mib=1: --gpu-mib 1 is too small: it leaves"]),
        (["--gpu-mib", "abc"], ["--gpu-mib", "abc"]),
        (["--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_bad_new_flags_are_one_line_usage_errors(tmp_path: Path, args: list[str], words: list[str]) -> None:
    (tmp_path / "file").write_text("x")
    names = {"OUT.txt": str(tmp_path / "out.txt"), "FILE": str(tmp_path / "file"),
             "MISSING/x": str(tmp_path / "missing" / "x")}
    result = simulate(*[names.get(arg, arg) for arg in args])
    assert_one_line_error(result, *[names.get(word, word) for word in words])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]  # nothing written


# ------------------------------------------------------------------------------------------------ the plot
def test_the_plot_titles_each_panel_and_shows_colder_tiers_and_preemptions() -> None:
    options = SimulatorOptions(num_requests=10, check=False, backend="cpu", gpu_mib=256)
    result = simulate_in_process(options)
    assert result.preemptions > 0 and result.offloaded_pages > 0
    figure = run_figure(result)
    in_use, occupied, colder, hits, preemptions = figure.axes
    titles = [axes.get_title() for axes in (in_use, occupied, colder, hits)]
    assert titles == [
        "GPU slots in use (locked by running requests)",
        "GPU slots occupied (in use + cached pages kept for reuse)",
        "host / disk tier slots occupied (offloaded pages)",
        "prefix hit rate over time; preemptions so far (right axis)",
    ]
    # Two pool groups full at the same time stay apart: different dash patterns, the first one wider.
    lines = occupied.get_lines()
    assert len(lines) == 2 and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert lines[0].get_linewidth() > lines[1].get_linewidth()
    labels = [str(line.get_label()) for line in colder.get_lines()]
    assert len(labels) == len(result.pool_groups) and all(label.startswith("host, pool group ") for label in labels)
    assert max(float(np.asarray(line.get_ydata(), dtype=float).max()) for line in colder.get_lines()) > 0
    (counts,) = preemptions.get_lines()
    assert float(np.asarray(counts.get_ydata(), dtype=float).max()) == result.preemptions


@pytest.mark.parametrize("preset", ["llama", "gemma"])
def test_the_ideal_hit_rate_is_what_one_request_at_a_time_on_ample_memory_reaches(preset: str) -> None:
    """The ideal counted full blocks only while the manager also reuses the shared start of one more block
    (partial reuse, on without SSM layers): "prefix hit rate 46.3% (ideal for this workload 45.6%)" (llama, 16
    requests). Served one at a time with room for everything, the manager reaches exactly the ideal."""
    report = run_json("--preset", preset, "--no-check", "--requests", "8", "--max-batch", "1", "--gpu-mib", "1024",
                      "--host-mib", "0")
    assert report["finished"] == 8 and report["preemptions"] == 0
    assert report["hit_rate"] == pytest.approx(report["ideal_hit_rate"]), (report["hit_rate"], report["ideal_hit_rate"])


@pytest.mark.parametrize("preset", ["llama", "hybrid-ssm"])
def test_the_ideal_says_when_it_ignores_ssm_snapshots(preset: str) -> None:
    """The ideal counts whole blocks of each common prefix; a hybrid reuses only up to an SSM snapshot, and its
    ideal was printed like the exact one: "prefix hit rate 57.5% (ideal for this workload 69.2%)" (4 requests)."""
    result = simulate_in_process(SimulatorOptions(preset=preset, num_requests=4, check=False))
    hybrid = preset == "hybrid-ssm"
    report = result_json(result)
    assert report["ideal_ignores_ssm_snapshots"] is hybrid
    line = next(row[1] for table in summary_tables(result) for row in table.rows if row[0] == "prefix hit rate")
    assert ("SSM snapshot positions ignored" in line) is hybrid, line
    assert ("SSM snapshot positions ignored" in sweep_table("gpu_mib", ["1"], [result]).note) is hybrid


def test_manager_time_per_step_says_it_is_per_busy_step() -> None:
    """The figure divides by busy steps; the line said "µs/step" under "steps 215 (54 busy, 161 idle; ...)", so
    0.64 s / 215 steps = 2,970 µs read as false beside the 11,826 printed."""
    report = run_json("--requests", "4", "--no-check", "--arrival-rate", "0.05")
    steps, idle = int(str(report["steps"])), int(str(report["idle_steps"]))
    assert idle > 0
    per_busy_step = float(str(report["manager_seconds"])) * 1e6 / (steps - idle)
    assert report["manager_us_per_step"] == pytest.approx(per_busy_step)
    table = simulate("--plain", "--requests", "4", "--no-check", "--arrival-rate", "0.05").stdout
    line = next(line for line in table.splitlines() if line.startswith("manager time"))
    assert re.search(r"; [\d,]+ µs/busy step, [\d,]+ µs/request-step$", line), line
    # It is wall-clock time inside the manager's calls (perf_counter): labelled "manager CPU time", a --no-check run
    # on a loaded 2-core machine printed 2.93 s while the whole process used 2.30 s of CPU (user 0.78 + sys 1.52).
    assert "CPU time" not in table.replace("not CPU time", ""), table
    assert "manager time: wall-clock time inside the manager's calls" in table
    assert float(str(report["manager_seconds"])) <= float(str(report["wall_seconds"]))


def test_a_slow_arrival_rate_is_described_with_its_digits() -> None:
    """3 requests over 582 steps were described as "0.01 requests per step" (two decimals of 0.0052)."""
    table = simulate("--plain", "--requests", "3", "--turns", "1", "--arrival-rate", "0.001", "--no-check").stdout
    line = next(line for line in table.splitlines() if line.startswith("arrivals"))
    match = re.fullmatch(r"arrivals\s+steps (\d+) to ([\d,]+), ([\d.e-]+) requests per step on average", line)
    assert match is not None, line
    first, last, rate = int(match[1]), int(match[2].replace(",", "")), float(match[3])
    assert rate == pytest.approx(3 / (last - first + 1), rel=0.01), line


def test_a_request_rejected_while_decoding_leaves_the_hit_rate() -> None:
    """The second request reuses the first's 256-token prompt, then outgrows the 14-slot GPU tier while decoding
    4,000 tokens and is rejected: the hit rate is over served requests, so only the first one's 256 prompt tokens
    (none reused) count, and the tier split agrees."""
    prompt = list(range(1, 257))
    requests = [
        TraceRequest(0, prompt, [9000, 9001]),
        TraceRequest(1, [*prompt, 5], list(range(10000, 14000)), arrival_step=5),
    ]
    options = SimulatorOptions(gpu_mib=64, host_mib=0, check=False, backend="cpu")
    result = simulate_in_process(options, workload=Workload(requests, 0.0))
    assert (result.finished, result.rejected) == (1, 1)
    assert (result.prompt_tokens, result.reused_tokens, result.hit_rate) == (256, 0, 0.0)
    assert result.reused_tokens_by_tier == [0]
    assert all((group.reused_tokens, group.reused_pages) == (0, 0) for group in result.layer_groups)
    # Served, the same request counts: 256 of 513 prompt tokens reused.
    requests[1] = TraceRequest(1, [*prompt, 5], list(range(10000, 10100)), arrival_step=5)
    served = simulate_in_process(options, workload=Workload(requests, 0.0))
    assert (served.rejected, served.prompt_tokens, served.reused_tokens) == (0, 513, 256)
    assert served.reused_tokens_by_tier == [256]


@pytest.mark.parametrize(("parameter", "left_out"), [("capacity (GPU MiB)", "GPU MiB"), ("--gpu-mib", "GPU MiB"),
                                                     ("--host-mib", "host MiB"), ("--max-batch", None)])
def test_a_sweep_over_a_quota_shows_it_once(parameter: str, left_out: str | None) -> None:
    """--sweep-gpu-mib printed the swept quota twice: headers "capacity (GPU MiB)", "GPU MiB", "GPU slots", ..."""
    result = simulate_in_process(SimulatorOptions(num_requests=2, check=False))
    table = sweep_table(parameter, ["64"], [result])
    assert table.headers[0] == parameter and len(table.rows[0]) == len(table.headers)
    quotas = [header for header in table.headers if header in ("GPU MiB", "host MiB")]
    assert quotas == [header for header in ("GPU MiB", "host MiB") if header != left_out]
