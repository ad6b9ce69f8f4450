"""Instructions per decode step of the compiled hot path, counted by valgrind's callgrind: a figure that load on a
shared machine cannot move, for comparing builds (``python tools/hot_path_instructions.py ROOT [ROOT ...]``, each
ROOT a checkout holding a compiled build in ``build/compiled``).

Each workload (a ``capacity`` read; ``resize``; ``resize`` then ``commit``) runs on active caches that stay inside
their last block, once for a short and once for a long run; the difference of the two totals over the extra
cache-steps is the cost of one step, the interpreter's call into the compiled code included, with start-up and
setup cancelled out. The child runs isolated from the working directory and with fixed hashing, so a repeated
count is identical.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

WORKLOADS = ("capacity", "resize", "resize+commit")
TOKENS_PER_BLOCK = 64
SHORT_RUN, LONG_RUN = 10, 50  # steps; both stay inside the block each cache starts in


def child(root: str, workload: str, steps: int, num_caches: int) -> None:
    """The measured process: set up the caches, then run ``steps`` steps of ``workload`` over all of them."""
    sys.path[:0] = [os.path.join(root, "build", "compiled"), root]
    import kv_cache_manager_v2 as package
    from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, GpuCacheTierConfig
    from kv_cache_manager_v2 import KVCacheManager, KVCacheManagerConfig

    if not package.COMPILED:
        raise SystemExit(f"{root}: no compiled build in build/compiled")
    layer = AttentionLayerConfig(0, [BufferConfig("key", 256), BufferConfig("value", 256)])
    quota = (num_caches * 6 + 64) * TOKENS_PER_BLOCK * 512
    config = KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK, layers=[layer], backend="cpu", cache_tiers=[GpuCacheTierConfig(quota)]
    )
    manager = KVCacheManager(config)
    caches = []
    for number in range(num_caches):
        tokens = [number * 100_000 + i for i in range(TOKENS_PER_BLOCK * 4 + 1)]  # one token into a fresh block
        cache = manager.create_kv_cache(None, tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        caches.append(cache)
    for _ in range(steps):
        for cache in caches:
            length = cache.capacity
            if workload != "capacity":
                cache.resize(length + 1)
                if workload == "resize+commit":
                    cache.commit([length])


def count(root: str, workload: str, steps: int, num_caches: int) -> int:
    """Instructions of one child run (callgrind's total)."""
    environment = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-P", "-s"]
    command += [os.path.abspath(__file__), "--child", root, workload, str(steps), str(num_caches)]
    run = subprocess.run(command, env=environ_without_pythonpath(environment), capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"callgrind failed for {root} {workload}:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def environ_without_pythonpath(environment: dict[str, str]) -> dict[str, str]:
    """The child finds the package under the root it is given, never through an inherited ``PYTHONPATH``."""
    return {name: value for name, value in environment.items() if name != "PYTHONPATH"}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        root, workload, steps, num_caches = sys.argv[2:6]
        child(root, workload, int(steps), int(num_caches))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", help="checkouts holding build/compiled")
    parser.add_argument("--caches", type=int, default=300, help="active caches (default 300)")
    args = parser.parse_args()
    extra_steps = (LONG_RUN - SHORT_RUN) * args.caches
    print(f"instructions per cache-step ({args.caches} caches, {LONG_RUN - SHORT_RUN} extra steps)")
    print(f"{'root':<40}" + "".join(f"{name:>16}" for name in WORKLOADS))
    for root in args.roots:
        row = [
            (count(root, name, LONG_RUN, args.caches) - count(root, name, SHORT_RUN, args.caches)) / extra_steps
            for name in WORKLOADS
        ]
        print(f"{root:<40}" + "".join(f"{value:>16.0f}" for value in row))


if __name__ == "__main__":
    main()
