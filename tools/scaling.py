"""How each manager call's cost grows with state it should not depend on: time per call at n and factor * n.

Each scenario builds a manager holding n of something (cached blocks in the radix tree, children of one tree
block, live or suspended caches, blocks of one prompt, full tiers' pages, requests of a batch, observed closed
caches, SSM snapshots), then times one call (or a short fixed sequence of calls) that should cost the same at
any n, or per unit of its own work where the call's work is n (a prompt of n blocks: time per block). The
fitted exponent is log(t(factor * n) / t(n)) / log(factor): ~0 is flat, ~1 means the call walks the state.
Calls are timed best of ``--repeat`` runs of ``--calls`` calls each, the state rebuilt for every size and then
frozen out of the garbage collector's way (``gc.freeze``, as ``bench_manager.py`` does); cpu backend, tiny
buffers, so only bookkeeping is measured. Interpreted always; compiled too when ``build/compiled``
exists (it is not built here).

    python tools/scaling.py                    # every scenario, n and 4n, both modes where available
    python tools/scaling.py --factor 16 -k fanout   # one scenario family, n and 16n
    python tools/scaling.py --profile probe_partial_fanout   # cProfile of one scenario's timed calls at 4n
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.modes import COMPILED_DIR, select_mode  # noqa: E402
from tools.scaling_scenarios import SCENARIOS, Scenario  # noqa: E402

def time_scenario(scenario: Scenario, n: int, calls: int, repeat: int, profile: bool = False) -> float:
    """Seconds per work unit of the scenario's call at n: best of ``repeat`` runs of ``calls`` calls."""
    call, units, close = scenario(n)
    try:
        call()  # warm up
        gc.collect()
        gc.freeze()  # the state built is out of the collector's way: a collection's cost is not the call's
        best = math.inf
        profiler = cProfile.Profile() if profile else None
        for _ in range(repeat):
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - start) / calls / units)
            if profiler is not None:
                profiler.disable()
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        return best
    finally:
        gc.unfreeze()
        close()


def measure(names: list[str], factor: int, calls: int, repeat: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    for name, scenario, base, _ in SCENARIOS:
        if name in names:
            results[name] = [time_scenario(scenario, size, calls, repeat) for size in (base, base * factor)]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=int, default=4, help="the larger size is factor * n (default 4)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed run (default 20)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs, best kept (default 3)")
    parser.add_argument("-k", default="", help="only scenarios whose name contains this")
    parser.add_argument("--profile", metavar="SCENARIO", help="cProfile one scenario's timed calls at factor * n")
    parser.add_argument("--child-mode", choices=("fast", "compiled"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [name for name, _, _, _ in SCENARIOS if args.k in name]
    if args.profile:
        select_mode("fast")
        entry = next(item for item in SCENARIOS if item[0] == args.profile)
        time_scenario(entry[1], entry[2] * args.factor, args.calls, 1, profile=True)
        return 0
    if args.child_mode:
        select_mode(args.child_mode)
        print(json.dumps(measure(names, args.factor, args.calls, args.repeat)))
        return 0
    modes = ["fast"] + (["compiled"] if os.path.isdir(os.path.join(COMPILED_DIR, "kv_cache_manager_v2")) else [])
    results: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        command = [sys.executable, os.path.abspath(__file__), "--child-mode", mode, "--factor", str(args.factor),
                   "--calls", str(args.calls), "--repeat", str(args.repeat), "-k", args.k]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    print(f"µs per call (per unit where noted) at n and {args.factor}n; exponent = log(t({args.factor}n)/t(n)) / "
          f"log({args.factor}); cpu backend, one core, best of {args.repeat} x {args.calls} calls")
    header = f"{'call':<22} {'n counts':<36} {'n':>6}"
    for mode in modes:
        header += f" {mode + ' t(n)':>14} {'t(' + str(args.factor) + 'n)':>9} {'exp':>5}"
    print(header)
    for name, _, base, what in SCENARIOS:
        if name not in names:
            continue
        line = f"{name:<22} {what:<36} {base:>6}"
        for mode in modes:
            small, large = results[mode][name]
            exponent = math.log(large / small) / math.log(args.factor)
            line += f" {small * 1e6:>14.1f} {large * 1e6:>9.1f} {exponent:>5.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
