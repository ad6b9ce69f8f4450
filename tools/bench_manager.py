"""The standard bookkeeping benchmark (SPEC §10.1): µs of manager time per request-step, interpreted and compiled.

One seeded trace (``workload.bench_trace()``: 2,000 requests, prompts of 256..4,096 tokens, half of them behind
one of 20 shared 1,024-token system prompts, outputs of 32..256 tokens) is replayed through a vLLM-like
scheduling loop:

- FCFS; each step first schedules the running requests in admission order, then — only if nothing was preempted
  this step — admits waiting requests while fewer than ``running`` requests run and step budget is left;
- chunked prefill: at most 2,048 tokens per request per step, 8,192 tokens per step in all; decode: 1 token;
- admit = ``probe_reuse`` + ``create_kv_cache`` + ``resume`` + ``resize`` for the first chunk; a running request
  ``resize``s by its chunk or by one decode token; computed tokens are ``commit``ted; finished requests ``close``;
- when a ``resize`` fails, the most recently admitted running request is preempted and recomputed later, as vLLM
  does: its cache is closed (its committed blocks stay in the prefix cache) and it goes back to the front of the
  waiting queue, to be admitted again with everything it knows so far (prompt + tokens generated) as its prompt.

Model: tokens_per_block 32, one GPU tier with 20,000 slots per pool group, tiny buffers (one K and one V of
256 bytes per block per layer) so memory traffic is negligible and only bookkeeping is measured. Configs:
``full`` (one full-attention layer) and ``hybrid`` (one full-attention + one 1,024-token sliding-window layer; both
life cycles have the same slot size, so they share one pool group of 20,000 slots, like vLLM's shared block pool).

Only manager calls are timed (``time.perf_counter_ns`` around each call; the timer's own cost, ~0.05 µs a call,
is included), in the peer harness's buckets (``BUCKETS``: lookup, admit, prefill, decode, update, free), so this
table's µs per call line up with ``../shared/peerbench/run_side_by_side.sh``'s. µs per request-step = manager time / Σ over steps of the requests scheduled in that step. The
achieved prefix hit rate counts each request's first admission (reused / prompt tokens) and is compared with
``ideal_prefix_hit_rate`` of the trace.

Each (config, running, mode) runs in its own subprocess pinned to one core (``os.sched_setaffinity``):
interpreted imports the sources (PYTHONPATH = repository root), compiled imports the mypyc build
(PYTHONPATH = ``build/compiled``, rebuilt first when missing or older than a source). GC: enabled with the default
thresholds; after the trace and the manager are built, ``gc.collect()`` + ``gc.freeze()`` move the set-up objects
out of the collector's way, so collections only scan what the run creates (``--gc default`` skips the freeze,
``--gc off`` disables the collector during the run).

    python tools/bench_manager.py              # full run: both configs, 64 / 256 / 1,024 running, both modes
    python tools/bench_manager.py --quick      # 200 requests, a smoke run
    python tools/bench_manager.py --json       # one JSON object instead of the table
    python tools/bench_manager.py --profile full   # cProfile of one interpreted run: the manager's hot spots
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(REPO)  # after PYTHONPATH: a compiled child must import the build, not the sources beside tools/

from tools.bench_manager_loop import (  # noqa: E402
    BUCKETS,
    CHUNK,
    CONFIGS,
    GPU_BLOCKS,
    STEP_BUDGET,
    TOKENS_PER_BLOCK,
    make_manager,
    run_loop,
)

DEFAULT_BUILD_DIR = os.path.join(REPO, "build", "compiled")

RUNNING = (64, 256, 1024)
QUICK_REQUESTS = 200
# SPEC §10.1 goals at 64 running requests, compiled: half of vLLM v1 (15.7 / 27.9 µs), >= 3x the interpreted mode.
GOALS_US = {"full": 7.8, "hybrid": 14.0}
GOAL_SPEEDUP = 3.0


def measure(
    config: str, max_running: int, num_requests: int, gc_mode: str, max_util: float | None = None
) -> dict[str, object]:
    """One loop over the trace in this process (the mode is whatever ``kv_cache_manager_v2`` resolves to)."""
    import kv_cache_manager_v2
    from kv_cache_manager_v2.sim.workload import bench_trace, ideal_prefix_hit_rate

    trace = bench_trace(0, num_requests)
    manager = make_manager(config, max_util_for_resume=max_util)
    gc.collect()
    if gc_mode == "freeze":
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    wall = time.perf_counter()
    result = run_loop(manager, trace, max_running)
    wall = time.perf_counter() - wall
    gc.enable()
    gc.unfreeze()
    manager.shutdown()
    return {
        "config": config,
        "running": max_running,
        "compiled": kv_cache_manager_v2.COMPILED,
        "requests": num_requests,
        "us_per_request_step": result.us_per_request_step,
        "hit_rate": result.hit_rate,
        "ideal_hit_rate": ideal_prefix_hit_rate(trace, TOKENS_PER_BLOCK),
        "request_steps": result.request_steps,
        "steps": result.steps,
        "preemptions": result.preemptions,
        "finished": result.finished,
        "peak_running": result.max_running,
        "manager_s": result.manager_ns / 1e9,
        # µs per call of each kind (the peer harness's columns), and the calls made
        "per_call_us": {
            bucket: result.bucket_ns[bucket] / 1000.0 / max(1, result.calls[bucket]) for bucket in BUCKETS
        },
        "calls": dict(result.calls),
        "wall_s": wall,
    }


def pin_to_one_core() -> int:
    """Pin this process to the last core it may use (the OS tends to put other work on the first)."""
    core = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {core})
    return core


def child(args: argparse.Namespace) -> int:
    core = pin_to_one_core()
    import kv_cache_manager_v2

    if kv_cache_manager_v2.COMPILED != (args.child_mode == "compiled"):
        raise RuntimeError(f"asked for {args.child_mode} mode, imported {kv_cache_manager_v2.__file__}")
    record = measure(args.child_config, args.child_running, args.requests, args.gc, args.max_util)
    record["core"] = core
    print(json.dumps(record))
    return 0


# ------------------------------------------------------------------------------------------------- driver
def ensure_compiled(build_dir: str) -> None:
    """Build the compiled mode into ``build_dir`` unless it is newer than every source."""
    sources = glob.glob(os.path.join(REPO, "kv_cache_manager_v2", "**", "*.py"), recursive=True)
    sources.append(os.path.join(REPO, "setup_mypyc.py"))
    built = glob.glob(os.path.join(build_dir, "kv_cache_manager_v2", "**", "*.so"), recursive=True)
    if built and min(os.path.getmtime(path) for path in built) > max(os.path.getmtime(path) for path in sources):
        return
    temp = os.path.join(os.path.dirname(os.path.abspath(build_dir)), "temp")
    print(f"building the compiled mode into {build_dir} ...", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "setup_mypyc.py", "build", "--build-lib", build_dir, "--build-temp", temp, "-j", "2"],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )


def run_child(mode: str, config: str, running: int, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(args.build_dir) if mode == "compiled" else REPO
    command = [
        sys.executable, os.path.abspath(__file__), "--child-mode", mode, "--child-config", config,
        "--child-running", str(running), "--requests", str(args.requests), "--gc", args.gc,
    ]
    if args.max_util is not None:
        command += ["--max-util", str(args.max_util)]
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=REPO).stdout
    record: dict[str, object] = json.loads(output.strip().splitlines()[-1])
    return record


def _float(record: dict[str, object], key: str) -> float:
    value = record[key]
    assert isinstance(value, (int, float))
    return float(value)


def _per_call(record: dict[str, object]) -> dict[str, float]:
    per_call = record["per_call_us"]
    assert isinstance(per_call, dict)
    return {str(bucket): float(value) for bucket, value in per_call.items()}


def summarize(records: list[dict[str, object]]) -> dict[str, object]:
    """Median over repeats per (config, running, mode), ratios, and the goal verdicts."""
    rows: list[dict[str, object]] = []
    ratios: list[dict[str, object]] = []
    keys = sorted({(str(r["config"]), int(_float(r, "running"))) for r in records}, key=lambda k: (CONFIGS.index(k[0]), k[1]))
    for config, running in keys:
        medians: dict[str, float] = {}
        for mode in ("interpreted", "compiled"):
            group = [r for r in records if r["config"] == config and _float(r, "running") == running
                     and bool(r["compiled"]) == (mode == "compiled")]
            if not group:
                continue
            us = statistics.median(_float(r, "us_per_request_step") for r in group)
            medians[mode] = us
            first = group[0]
            rows.append({
                "config": config, "running": running, "mode": mode, "us_per_request_step": us,
                "runs": [_float(r, "us_per_request_step") for r in group],
                "hit_rate": first["hit_rate"], "ideal_hit_rate": first["ideal_hit_rate"],
                "preemptions": first["preemptions"], "request_steps": first["request_steps"],
                "steps": first["steps"], "peak_running": first["peak_running"], "requests": first["requests"],
                "per_call_us": {
                    bucket: statistics.median(_per_call(r)[bucket] for r in group) for bucket in BUCKETS
                },
            })
        if len(medians) == 2:
            ratio = medians["interpreted"] / medians["compiled"] if medians["compiled"] else 0.0
            entry: dict[str, object] = {"config": config, "running": running, "speedup": ratio}
            if running == RUNNING[0]:
                entry["goal_us"] = GOALS_US[config]
                entry["meets_us_goal"] = medians["compiled"] <= GOALS_US[config]
                entry["meets_speedup_goal"] = ratio >= GOAL_SPEEDUP
            ratios.append(entry)
    return {"rows": rows, "ratios": ratios}


def print_table(summary: dict[str, object], args: argparse.Namespace) -> None:
    rows = summary["rows"]
    ratios = summary["ratios"]
    assert isinstance(rows, list) and isinstance(ratios, list)
    print(f"bench_manager: {args.requests} requests, tpb {TOKENS_PER_BLOCK}, {GPU_BLOCKS:,} GPU blocks per pool group, "
          f"chunk {CHUNK}, step budget {STEP_BUDGET}, one pinned core, gc {args.gc}, "
          f"median of {args.repeat} run(s), {os.cpu_count()} cores on this machine")
    header = f"{'config':<7} {'running':>7} {'mode':<12} {'µs/request-step':>15} {'hit rate':>8} {'ideal':>6} " \
             f"{'preempt':>7} {'peak run':>8} {'request-steps':>13}   µs per call: " + " / ".join(BUCKETS)
    print(header)
    print("-" * len(header))
    for row in rows:
        per_call = row["per_call_us"]
        print(f"{row['config']:<7} {row['running']:>7} {row['mode']:<12} {row['us_per_request_step']:>15.2f} "
              f"{100 * row['hit_rate']:>7.1f}% {100 * row['ideal_hit_rate']:>5.1f}% {row['preemptions']:>7} "
              f"{row['peak_running']:>8} {row['request_steps']:>13,}   "
              + " / ".join(f"{per_call[bucket]:.2f}" for bucket in BUCKETS))
    for entry in ratios:
        line = f"ratio {entry['config']:<6} at {entry['running']:>4} running: interpreted / compiled = {entry['speedup']:.2f}x"
        if "goal_us" in entry:
            line += (f"  (goals: compiled <= {entry['goal_us']} µs: {'met' if entry['meets_us_goal'] else 'NOT met'}; "
                     f">= {GOAL_SPEEDUP:.0f}x: {'met' if entry['meets_speedup_goal'] else 'NOT met'})")
        print(line)


def profile(config: str, args: argparse.Namespace) -> int:
    """cProfile one interpreted loop (64 running) and print the manager's hottest functions."""
    import cProfile
    import pstats

    sys.path.insert(0, REPO)
    pin_to_one_core()
    from kv_cache_manager_v2.sim.workload import bench_trace

    trace = bench_trace(0, args.requests)
    manager = make_manager(config)
    profiler = cProfile.Profile()
    profiler.enable()
    run_loop(manager, trace, RUNNING[0])
    profiler.disable()
    manager.shutdown()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats("kv_cache_manager_v2", 25)
    stats.sort_stats("cumulative").print_stats("kv_cache_manager_v2", 25)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests: a smoke run")
    parser.add_argument("--requests", type=int, default=None, help="trace length (default 2,000; --quick 200)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--running", nargs="+", type=int, default=list(RUNNING), help="max running requests")
    parser.add_argument("--modes", nargs="+", choices=("interpreted", "compiled"), default=["interpreted", "compiled"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per (config, running, mode); the median counts")
    parser.add_argument("--gc", choices=("freeze", "default", "off"), default="freeze", help="see the docstring")
    parser.add_argument("--build-dir", default=DEFAULT_BUILD_DIR, help="where the compiled mode is built")
    parser.add_argument(
        "--max-util", type=float, default=None,
        help="KVCacheManagerConfig.max_util_for_resume (default: the manager's, 0.97, which keeps admissions from "
        "filling the last 3%% of the GPU; 1.0 admits until memory runs out, like vLLM v1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--profile", choices=CONFIGS, default=None, help="cProfile one interpreted run instead")
    parser.add_argument("--child-mode", choices=("interpreted", "compiled"), help=argparse.SUPPRESS)
    parser.add_argument("--child-config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--child-running", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = QUICK_REQUESTS if args.quick else 2000
    if args.child_mode:
        return child(args)
    if args.profile:
        return profile(args.profile, args)
    if "compiled" in args.modes:
        ensure_compiled(args.build_dir)
    records: list[dict[str, object]] = []
    for config in args.configs:
        for running in args.running:
            for _ in range(args.repeat):
                for mode in args.modes:
                    record = run_child(mode, config, running, args)
                    records.append(record)
                    if not args.json:
                        print(f"  {config} {running} {mode}: {_float(record, 'us_per_request_step'):.2f} µs/request-step "
                              f"({_float(record, 'wall_s'):.1f} s)", file=sys.stderr, flush=True)
    summary = summarize(records)
    if args.json:
        summary["requests"] = args.requests
        summary["gc"] = args.gc
        summary["cores"] = os.cpu_count()
        summary["records"] = records
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
