"""Memory and time of loading a large Mooncake-format trace as ``simulate --trace`` does, before any step: the
requests, both ideal rates, the batcher's queue and the workload summary (the whole list, README: replaying a
production trace).

Writes a seeded synthetic trace (shared prefixes, exponential lengths around 30 hash blocks) to a temporary file,
loads it in a child process and prints the figures, its peak RSS, what it holds once loaded (the ideal's trie
freed) and wall time; ``--tree`` loads another checkout
for a before/after in one sitting. Big traces are made here, never committed.

    python tools/trace_memory.py [--requests 200000] [--tree /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run in the child: the figures, its peak RSS (KiB on Linux), the seconds it took and the package it imported.
CHILD = """
import gc, os, resource, sys, time
import kv_cache_manager_v2
from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.result import WorkloadSummary
from kv_cache_manager_v2.sim.scheduler import SimulatedBatchRequest
from kv_cache_manager_v2.sim.simulator import build_workload
start = time.perf_counter()
workload = build_workload(SimulatorOptions(trace=sys.argv[1], check=False))
queue = [SimulatedBatchRequest(request, True) for request in workload.requests]
summary = WorkloadSummary(workload.requests)
seconds = time.perf_counter() - start
gc.collect()
with open("/proc/self/statm") as statm:  # what the run holds: resident pages once the ideal's trie is gone
    held_kib = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
print(repr(workload.ideal_hit_rate), repr(workload.hash_block_hit_rate), len(queue),
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, held_kib, f"{seconds:.1f}", kv_cache_manager_v2.__file__)
"""


def write_trace(path: str, num_requests: int, seed: int = 7) -> None:
    """Requests arriving ~250 ms apart; 85% start with at least half of a recent request's hash ids."""
    rng = random.Random(seed)
    recent: list[list[int]] = []
    next_id = 0
    timestamp = 0
    with open(path, "w") as lines:
        for _ in range(num_requests):
            blocks = max(1, int(rng.expovariate(1 / 30)))
            hash_ids: list[int] = []
            if recent and rng.random() < 0.85:
                base = rng.choice(recent)
                hash_ids = base[: rng.randint((len(base) + 1) // 2, len(base))]
            while len(hash_ids) < blocks:
                hash_ids.append(next_id)
                next_id += 1
            hash_ids = hash_ids[:blocks]
            input_length = (blocks - 1) * 512 + rng.randint(1, 512)
            recent.append(hash_ids)
            if len(recent) > 2000:
                recent.pop(rng.randrange(len(recent)))
            timestamp += int(rng.expovariate(1 / 250))
            line = {"timestamp": timestamp, "input_length": input_length,
                    "output_length": rng.randint(1, 400), "hash_ids": hash_ids}
            lines.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--tree", default=REPO, help="the checkout whose package loads the trace")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.jsonl")
        write_trace(path, args.requests)
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.tree))
        # From the temporary directory: ``-c`` puts the working directory first on ``sys.path``.
        output = subprocess.run([sys.executable, "-c", CHILD, path], env=env, cwd=directory, check=True,
                                capture_output=True, text=True).stdout.split()
    ideal, block, requests, max_rss_kib, held_kib, seconds, package = output
    print(f"{os.path.dirname(os.path.dirname(package))}: {int(requests):,} requests, ideal {ideal}, 512-token block figure {block}, "
          f"peak RSS {int(max_rss_kib) / 1024:,.0f} MiB, held after loading {int(held_kib) / 1024:,.0f} MiB, {seconds} s")


if __name__ == "__main__":
    main()
