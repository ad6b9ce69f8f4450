"""Run ``tests/test_eviction_model.py``'s random workloads (``tests/eviction_workload.py``) over many seeds and setups (more than the suite can
afford) and print, per setup, the seeds run and the first difference of each seed that found one: the step, its
log line and the assertion (the manager and the model answered a call differently, or disagree on the tiers, free
slots or reusable prefix after it).

    python tools/eviction_model_sweep.py --seeds 0:200 [--setups NAME,...] [--steps 300] [--fuzz]

``--fuzz`` mixes in the stateful fuzzer's shapes the model follows (``tests/eviction_shapes.py``: fan-out turns,
priority callbacks failing, interrupting or calling back in mid-call, handles dropped unclosed).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kv_cache_manager_v2 import AttentionLayerConfig, LayerConfig  # noqa: E402
from tests.helpers import KIB, attention, ssm  # noqa: E402
from tests.eviction_workload import (  # noqa: E402
    DEFAULT,
    EVERY_BLOCK,
    HYBRID,
    MIXED,
    TPB,
    Priorities,
    SsmOptions,
    build_run,
    compare,
    step,
)
from tests.eviction_shapes import fuzz_step  # noqa: E402
from tests.fuzz.model import FuzzInterrupt  # noqa: E402

WINDOW = 2 * TPB


@dataclass(frozen=True)
class Setup:
    name: str
    tier_slots: list[int]
    priorities: list[Priorities]
    layers: Sequence[LayerConfig] | None = None
    partial_reuse: bool = False
    ssm_options: SsmOptions | None = None


def windowed(window: int = WINDOW, sinks: int | None = None, windowed_bytes: int = KIB) -> list[AttentionLayerConfig]:
    return [attention(0, KIB), attention(1, windowed_bytes, window=window, sinks=sinks)]


def setups() -> list[Setup]:
    """The test file's setups (each priority choice its own), then setups it lacks."""
    result: list[Setup] = []
    for label, priorities in (("default", DEFAULT), ("mixed", MIXED)):
        result += [
            Setup(f"gpu-{label}", [12], priorities),
            Setup(f"gpu+host-{label}", [10, 8], priorities),
            Setup(f"3tiers-{label}", [8, 4, 6], priorities),
            Setup(f"swa1pg-{label}", [16, 10], priorities, windowed()),
            Setup(f"sinks-{label}", [16, 10], priorities, windowed(sinks=TPB + 1)),
            Setup(f"swa2pg-{label}", [24, 16], priorities, windowed(windowed_bytes=2 * KIB)),
        ]
    result += [
        Setup("swa1pg-3tiers-mixed", [12, 8, 8], MIXED, windowed(3 * TPB)),
        Setup("partial-gpu-mixed", [12], MIXED, partial_reuse=True),
        Setup("partial-gpu+host-mixed", [10, 8], MIXED, partial_reuse=True),
        Setup("partial-3tiers-mixed", [8, 4, 6], MIXED, partial_reuse=True),
        Setup("partial-swa1pg-mixed", [16, 10], MIXED, windowed(), True),
        # not in the test file
        Setup("partial-swa1pg-3tiers-default", [12, 8, 8], DEFAULT, windowed(), True),
        Setup("swa2pg-3tiers-mixed", [24, 16, 16], MIXED, windowed(windowed_bytes=2 * KIB)),
        Setup("partial-swa2pg-3tiers-mixed", [24, 16, 16], MIXED, windowed(windowed_bytes=2 * KIB), True),
        Setup("sinks-3tiers-mixed", [12, 8, 8], MIXED, windowed(3 * TPB, sinks=TPB + 1)),
        Setup("partial-sinks-2pg-mixed", [24, 16], MIXED, windowed(sinks=TPB + 1, windowed_bytes=2 * KIB), True),
        # hybrid: full attention + an SSM group (its own pool group)
        Setup("hybrid-gpu+host-mixed", [12, 8], MIXED, HYBRID, ssm_options=EVERY_BLOCK),
        Setup("hybrid-3tiers-interval2-mixed", [12, 8, 8], MIXED, HYBRID, ssm_options=SsmOptions(2 * TPB)),
        Setup("hybrid-gpu+host-savelast-default", [12, 8], DEFAULT, HYBRID, ssm_options=SsmOptions(0, True)),
        Setup(
            "hybrid-swa-3tiers-interval2-mixed",
            [20, 12, 10],
            MIXED,
            [*windowed(), ssm(2, KIB, KIB)],
            ssm_options=SsmOptions(2 * TPB),
        ),
    ]
    return result


def first_difference(setup: Setup, seed: int, steps: int, disk: str, fuzz: bool = False) -> str | None:
    disk_path = disk if len(setup.tier_slots) > 2 else None
    run = build_run(setup.tier_slots, disk_path, setup.layers, setup.partial_reuse, setup.ssm_options)
    rng = random.Random(seed)
    try:
        for index in range(steps):
            try:
                (fuzz_step if fuzz else step)(run, rng, setup.priorities)
                compare(run)
            except (Exception, FuzzInterrupt) as error:
                message = f"{type(error).__name__}: {str(error).split('[')[0][:300]}"
                return f"step {index}: {run.log[-1][:120]} | {message}"
        return None
    finally:
        for cache, _ in run.suspended.values():
            cache.close()
        run.manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0:100", help="first:last (exclusive)")
    parser.add_argument("--setups", default="", help="comma-separated names (default: all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fuzz", action="store_true", help="mix in the stateful fuzzer's shapes")
    args = parser.parse_args()
    first, last = (int(part) for part in args.seeds.split(":"))
    wanted = set(filter(None, args.setups.split(",")))
    with tempfile.TemporaryDirectory() as disk:
        for setup in setups():
            if wanted and setup.name not in wanted:
                continue
            start = time.perf_counter()
            found: list[str] = []
            for seed in range(first, last):
                difference = first_difference(setup, seed, args.steps, disk, args.fuzz)
                if difference is not None:
                    found.append(f"  seed {seed}: {difference}")
            elapsed = time.perf_counter() - start
            print(f"{setup.name}: seeds {first}..{last - 1}, {len(found)} differing ({elapsed:.0f} s)", flush=True)
            for line in found:
                print(line, flush=True)


if __name__ == "__main__":
    main()
