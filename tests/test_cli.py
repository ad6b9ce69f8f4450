"""The serving simulator CLI (SPEC §10) and the bookkeeping benchmark's scheduling loop (SPEC §10.1).

The CLI runs in a subprocess that imports the package from the same root as this test session (sources in fast
mode, ``build/compiled`` in compiled mode), with content checks on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2.presets import PRESET_NAMES

REPO = Path(__file__).resolve().parent.parent
IMPORT_ROOT = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))

JSON_KEYS = {
    "preset", "backend", "compiled", "options", "requests", "finished", "rejected", "steps", "request_steps",
    "prompt_tokens", "reused_tokens", "generated_tokens", "hit_rate", "ideal_hit_rate", "layer_groups",
    "pool_groups", "movement", "preemptions", "resumes", "recomputes", "manager_us_per_step",
    "manager_us_per_request_step", "checked_tokens", "wall_seconds",
}


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kv_cache_manager_v2 simulate ...`` importing the package this session imported (run from the
    import root: ``-m`` puts the working directory first on ``sys.path``, where the sources would shadow a build)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = IMPORT_ROOT
    return subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", *args],
        capture_output=True, text=True, env=env, cwd=IMPORT_ROOT, timeout=600,
    )


def run_json(*args: str) -> dict[str, object]:
    result = simulate("--json", *args)
    assert result.returncode == 0, result.stderr[-4000:]
    report: dict[str, object] = json.loads(result.stdout)
    return report


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_each_preset_serves_every_request_with_content_checks_on(preset: str, tmp_path: Path) -> None:
    plot = tmp_path / "run.png"
    extra = ["--plot", str(plot)] if preset == "hybrid-ssm" else []
    report = run_json("--preset", preset, "--requests", "20", *extra)
    assert JSON_KEYS <= set(report)
    assert report["preset"] == preset and report["backend"] == "cpu"
    assert report["compiled"] is kv_cache_manager_v2.COMPILED
    assert report["requests"] == 20 and report["finished"] == 20 and report["rejected"] == 0
    assert isinstance(report["checked_tokens"], int) and report["checked_tokens"] > 0
    assert isinstance(report["prompt_tokens"], int) and report["prompt_tokens"] > 0
    hit_rate = report["hit_rate"]
    assert isinstance(hit_rate, float) and 0.0 < hit_rate <= 1.0
    groups = report["layer_groups"]
    assert isinstance(groups, list)
    expected_kinds = {"llama": ["full"], "gemma": ["swa", "full"], "hybrid-ssm": ["ssm", "full"]}[preset]
    assert sorted(group["kind"] for group in groups) == sorted(expected_kinds)
    for group in groups:
        assert group["hit_rate"] == pytest.approx(hit_rate)  # one reuse length per cache, for every group
    pools = report["pool_groups"]
    assert isinstance(pools, list) and pools
    for pool in pools:
        assert 0 < pool["peak_in_use"] <= pool["gpu_slots"]
    assert isinstance(report["manager_us_per_step"], float) and report["manager_us_per_step"] > 0
    if extra:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if preset == "gemma":
        # The default quotas are small enough that requests are preempted (suspended, then resumed) and cached
        # pages go to the host tier and come back.
        assert isinstance(report["preemptions"], int) and report["preemptions"] > 0
        assert report["resumes"] == report["preemptions"]
        movement = report["movement"]
        assert isinstance(movement, dict)
        assert movement["offloaded_pages"] > 0 and movement["onboarded_pages"] > 0


def test_table_shows_the_layout_and_every_figure() -> None:
    result = simulate("--requests", "3", "--plain")
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "layer group 1: 4 layer(s) -> pool group 1" in out
    for label in ("prefix hit rate", "peak in use", "offloaded pages", "onboarded pages", "preemptions",
                  "scratch savings", "manager CPU time", "µs/step", "content checks"):
        assert label in out, label
    assert "simulate:" in result.stderr  # plain progress lines


def test_scratch_batch_admission_and_a_disk_tier(tmp_path: Path) -> None:
    report = run_json(
        "--requests", "8", "--scratch", "--chunk", "2048", "--batch-admission", "--host-mib", "0",
        "--disk-mib", "512", "--disk-dir", str(tmp_path),
    )
    assert report["finished"] == 8
    options = report["options"]
    assert isinstance(options, dict) and options["scratch"] is True and options["batch_admission"] is True
    pools = report["pool_groups"]
    assert isinstance(pools, list)
    swa_pool = pools[0]
    assert swa_pool["peak_without_scratch"] > swa_pool["peak_in_use"]  # 2,048-token chunks past the window


def test_bad_flags_fail_cleanly(tmp_path: Path) -> None:
    result = simulate("--requests", "0")
    assert result.returncode != 0 and "requests" in result.stderr
    result = simulate("--plot", str(tmp_path / "missing" / "x.png"))
    assert result.returncode != 0 and "plot" in result.stderr


def test_a_chat_turn_waits_for_its_parent_and_preempted_requests_come_back() -> None:
    from kv_cache_manager_v2._manager import KVCacheManager
    from kv_cache_manager_v2.simulator import Simulation, SimulatorOptions, build_config, build_workload

    # Every chat starts at step 0: later turns queue up behind their parents.
    options = SimulatorOptions(num_requests=24, backend="cpu", check=False, mean_arrival_gap=0.0)
    workload = build_workload(options)
    requests = workload.requests
    assert any(request.parent_id is not None for request in requests)
    manager = KVCacheManager(build_config(options, None, 1024))
    simulation = Simulation(options, manager, workload)
    parents = {request.request_id: request.parent_id for request in requests}
    held_back = 0
    while len(simulation.finished_ids) < len(requests):
        simulation.step()
        for request in simulation.running + simulation.suspended:
            parent = parents[request.request_id]
            assert parent is None or parent in simulation.finished_ids
        held_back += sum(1 for request in simulation.waiting if parents[request.request_id] not in
                         (None, *simulation.finished_ids))
        manager.check_invariants()
    assert held_back > 0  # turns did arrive before their parent finished, and waited
    result = simulation.result
    assert result.rejected == 0 and result.preemptions > 0 and result.resumes + result.recomputes == result.preemptions
    assert manager.num_live_caches == 0
    manager.shutdown()


# ------------------------------------------------------------------------------------------- bench loop
def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_manager", REPO / "tools" / "bench_manager.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", ["full", "hybrid"])
def test_bench_loop_preempts_recomputes_and_finishes_a_tiny_trace(config: str) -> None:
    from kv_cache_manager_v2.workload import bench_trace, ideal_prefix_hit_rate

    bench = load_bench()
    trace = bench_trace(
        3, 40, prompt_length=(64, 512), output_length=(4, 40), num_system_prompts=3, system_prompt_length=128,
        min_unique_suffix=8,
    )
    manager = bench.make_manager(config, gpu_blocks=48, tokens_per_block=16)
    result = bench.run_loop(manager, trace, 8, chunk=128, step_budget=320, after_step=manager.check_invariants)
    assert result.finished == 40 and manager.num_live_caches == 0
    assert result.preemptions > 0 and result.max_running <= 8
    assert result.request_steps >= sum(request.output_length for request in trace)
    assert 0.0 < result.hit_rate <= 1.0 and ideal_prefix_hit_rate(trace, 16) > 0.0
    assert result.manager_ns > 0
    manager.shutdown()
