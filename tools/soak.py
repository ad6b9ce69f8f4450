"""Long soak of the request lifecycle: the stateful fuzz test's operations (``tests/fuzz/``), driven by a
seeded ``random.Random`` instead of Hypothesis, with every check of the test after every operation.

    python tools/soak.py --operations 100000 --seed 0

Rotates through every config of ``tests/fuzz/configs.CONFIGS`` (a fresh manager every ``--world-operations``
operations, after the end-of-world checks; every other round of configs drops its managers without ``shutdown``).
Any exception (including invariant and content failures) is a violation: it is reported with its traceback and the
world is replaced; so is a descriptor or thread count after a world above the first world's. Exits 1 when a
violation was found.
``KV_CACHE_MANAGER_V2_MODE=compiled`` (with ``KV_CACHE_MANAGER_V2_BUILD_DIR``, default ``build/compiled``)
soaks the mypyc-compiled package, as ``tests/conftest.py`` does.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import random
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
if os.environ.get("KV_CACHE_MANAGER_V2_MODE", "fast") == "compiled":
    sys.path.insert(0, os.environ.get("KV_CACHE_MANAGER_V2_BUILD_DIR", str(REPO / "build" / "compiled")))

import kv_cache_manager_v2  # noqa: E402
from tests.fuzz.configs import CONFIGS, FuzzConfig  # noqa: E402
from tests.fuzz.driver import Fuzzer  # noqa: E402
from tests.fuzz.model import FuzzStats  # noqa: E402
from tests.steady_state import open_descriptors  # noqa: E402


def rss_mib() -> float:
    """Resident set size of this process now (Linux ``/proc``; the peak from ``getrusage`` elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--operations", type=int, default=100_000, help="operations to run (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random driver (default 0)")
    parser.add_argument(
        "--config",
        action="append",
        choices=[config.name for config in CONFIGS],
        help="config(s) to rotate through (default: all)",
    )
    parser.add_argument(
        "--world-operations", type=int, default=2_000, help="operations before a fresh manager (default 2000)"
    )
    parser.add_argument("--max-reports", type=int, default=5, help="violations printed in full (default 5)")
    parser.add_argument(
        "--progress-every", type=int, default=50, help="print a progress line every N managers (default 50)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs: list[FuzzConfig] = [c for c in CONFIGS if args.config is None or c.name in args.config]
    rng = random.Random(args.seed)
    totals = FuzzStats()
    violations = 0
    worlds = 0
    mode = "compiled" if kv_cache_manager_v2.COMPILED else "interpreted"
    print(f"soak: {args.operations} operations, seed {args.seed}, {mode} mode, configs {[c.name for c in configs]}")

    def report(config: FuzzConfig, operation: int, last: str) -> None:
        """Count and print the exception being handled."""
        nonlocal violations
        violations += 1
        if violations <= args.max_reports:
            print(f"\nVIOLATION {violations} in config {config.name!r} at operation {operation} ({last}):")
            traceback.print_exc(file=sys.stdout)

    start = time.perf_counter()
    done = 0
    rss_start = 0.0  # after the first world, when imports and caches are warm
    rss_samples: list[float] = []
    # Descriptors and threads after each world (its manager shut down, or dropped when the world broke): a count
    # above the first world's is something a world left behind (a pool file, a socket, a thread).
    held_start = held_now = (0, 0)
    while done < args.operations:
        config = configs[worlds % len(configs)]
        worlds += 1
        try:
            fuzz = Fuzzer(config)
        except Exception:  # noqa: BLE001 - a failing constructor or warm-up is a violation too
            report(config, done, "warm-up")
            done += 1
            continue
        try:
            for _ in range(min(args.world_operations, args.operations - done)):
                done += 1
                fuzz.random_step(rng)
                fuzz.check()
            fuzz.last_operation = "teardown"
            fuzz.teardown(shut_down=(worlds - 1) // len(configs) % 2 == 0)  # every other round: dropped, collected
        except Exception:  # noqa: BLE001 - every exception is a finding
            fuzz.broken = True
            report(config, done, fuzz.last_operation)
            fuzz.teardown()
        totals.add(fuzz.stats)
        del fuzz
        gc.collect()
        rss_samples.append(rss_mib())
        held_now = (len(open_descriptors()), threading.active_count())
        if worlds == 1:
            rss_start = rss_samples[-1]
            held_start = held_now
        if worlds % args.progress_every == 0:
            rate = done / (time.perf_counter() - start)
            print(f"  {done} operations, {violations} violations, RSS {rss_samples[-1]:.1f} MiB, {rate:.0f}/s", flush=True)
    elapsed = time.perf_counter() - start

    print(f"\noperations run:          {done}")
    print(f"elapsed:                 {elapsed:.1f} s")
    print(f"rules per second:        {done / elapsed:.0f}")
    print(f"managers (worlds):       {worlds}")
    print(f"caches created:          {totals.caches_created}")
    print(f"reuse hits:              {totals.reuse_hits} ({totals.reused_tokens} tokens)")
    print(f"memory-shortage returns: {totals.shortages}")
    print(f"retried after stop_committing: {totals.stale_retries} ({totals.stale_rescues} then fitted)")
    print(f"invalid moves checked:   {totals.invalid_moves}")
    print(f"quota changes applied:   {totals.quota_changes}")
    print(f"tokens content-checked:  {totals.tokens_checked}")
    print(f"callback faults checked: {totals.callback_faults}")
    print(f"interrupted calls:       {totals.interrupts}")
    print(f"batches refused whole:   {totals.batches_refused}")
    print(f"batch shares:            {totals.batch_shares} ({totals.preemptions} preempted, {totals.recalls} recalls)")
    print(f"local handoffs:          {totals.handoffs_executed} executed and checked, {totals.handoffs_refused} refused late")
    print(f"RSS after first world:   {rss_start:.1f} MiB")
    print(f"RSS at the end:          {rss_samples[-1]:.1f} MiB (max over worlds {max(rss_samples):.1f} MiB)")
    print(f"descriptors, threads:    {held_start} after the first world, {held_now} at the end")
    if held_now[0] > held_start[0] or held_now[1] > held_start[1]:
        violations += 1
        print("VIOLATION: the worlds left descriptors or threads behind")
    print("operations by kind:      " + ", ".join(f"{k} {v}" for k, v in sorted(totals.by_operation.items())))
    print(f"violations found:        {violations}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
