"""The differential twin (SPEC §11: bad input "leaves every cache and the manager unchanged"): two fuzz worlds built
from one config run one seeded workload step for step; into one of them, at random points, go bad calls from
``tests/fuzz/misuse.py``. Each must raise the documented exception naming its argument, and afterwards everything
observable (``tests/fuzz/deep_state.py``: return values, page indices, statistics, usage, KV events, refusals,
the tree, pages and eviction lists) must stay equal between the twins at every later step. A difference is a bad
call that changed state, found at the step where it first shows.

The workload is the fuzzer's (``driver.Fuzzer``) without the operations whose outcome depends on more than the
seed: the collector (``drop_in_cycle``, ``reenter``), injected faults and a shared remote store.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Final

from kv_cache_manager_v2 import KVCacheManagerConfig
from tests.fuzz.configs import FuzzConfig
from tests.fuzz.deep_state import deep_state, differences
from tests.fuzz.driver import Fuzzer
from tests.fuzz.misuse import BadCallChangedState, Misuse, call_badly, misuses
from tests.fuzz.world import FuzzWorld

# Operations left out: their effects depend on the collector, the clock or faults, not on the seed alone (and
# ``misuse``: here only the victim gets bad calls).
NOT_SEEDED: Final = frozenset(
    {"drop_in_cycle", "reenter", "store_fault", "restart_store", "disk_fault", "codec_fault", "refetch", "misuse"}
)


class TwinFuzzer(Fuzzer):
    """A fuzz world whose random steps are a function of the seed alone, with KV events on."""

    def __init__(self, config: FuzzConfig) -> None:
        with_events = dataclasses.replace(config, build=lambda directory: _with_events(config, directory))
        super().__init__(with_events)

    def enabled(self, operation: str) -> bool:
        return operation not in NOT_SEEDED and super().enabled(operation)

    def observed(self) -> dict[str, object]:
        return deep_state(self.manager, [model.cache for model in self.live + self.closed], self.events.follow)


def _with_events(config: FuzzConfig, directory: str) -> KVCacheManagerConfig:
    return dataclasses.replace(config.build(directory), enable_kv_events=True)


Catalogue = Callable[[FuzzWorld, random.Random, FuzzWorld], list[Misuse]]


def run_twins(
    config: FuzzConfig, seed: int, steps: int, misuse_rate: float = 0.5, catalogue: Catalogue = misuses
) -> list[str]:
    """Run the twins; returns the bad calls made (names). Raises ``BadCallChangedState`` at the first defect.
    ``catalogue``: the bad calls to draw from, given the victim, the misuse generator and the witness."""
    victim, witness = TwinFuzzer(config), TwinFuzzer(config)
    made: list[str] = []
    try:
        rng_victim, rng_witness, rng_misuse = random.Random(seed), random.Random(seed), random.Random(seed ^ 0x5EED)
        _compare(victim, witness, "construction", made)
        for step in range(steps):
            while rng_misuse.random() < misuse_rate:
                found = catalogue(victim, rng_misuse, witness)
                if not found:  # a catalogue of one kind of call may have none for this state (no live cache)
                    break
                misuse = rng_misuse.choice(found)
                call_badly(misuse)
                made.append(misuse.name)
                _compare(victim, witness, f"step {step}, after the bad call", made)
            operation = victim.random_step(rng_victim)
            assert witness.random_step(rng_witness) == operation
            victim.check()
            witness.check()
            _compare(victim, witness, f"step {step} ({operation})", made)
    except BaseException:
        victim.broken = witness.broken = True
        raise
    finally:
        victim.teardown()
        witness.teardown()
    return made


def _compare(victim: TwinFuzzer, witness: TwinFuzzer, when: str, made: list[str]) -> None:
    diff = differences(victim.observed(), witness.observed())
    if diff:
        recent = made[-3:]
        shown = {key: (str(a)[-400:], str(b)[-400:]) for key, (a, b) in sorted(diff.items())[:3]}
        raise BadCallChangedState(f"{when}: the twins differ after bad calls {recent} in {sorted(diff)}: {shown}")
