"""The eviction model inside a fuzz machine: a Hypothesis ``RuleBasedStateMachine`` whose rules are the eviction
workload's operations (``tests/eviction_workload.py``: serve, hold, resume, decode, placement hints, close, private
pressure, quota changes, clear, batches) and the stateful fuzzer's shapes the model can follow
(``tests/eviction_shapes.py``: fan-out chat turns, priority callbacks failing, interrupting or calling back in
mid-call, handles dropped unclosed). After every rule, ``compare``: which blocks the KV events say are cached on
which tier, each tier's free slots and the reuse of recent prompts equal the model's (and every new cache's reuse
equals the model's match, as it is made).

Configs: full attention on one, two and three tiers, a window with sinks beside full attention, a window in a pool
group of its own, partial reuse, an SSM hybrid. Sizes: ``KV_CACHE_MANAGER_V2_ORACLE_EXAMPLES`` examples per config
(default 8) of ``KV_CACHE_MANAGER_V2_ORACLE_STEPS`` steps (default 40); ``tools/eviction_model_sweep.py --fuzz``
runs the same operations from seeds for long runs."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kv_cache_manager_v2 import LayerConfig
from tests.eviction_shapes import FAULTS, drop_handle, fan_out, fuzz_step, serve_misbehaving
from tests.eviction_workload import (
    DEFAULT,
    EVERY_BLOCK,
    HYBRID,
    MIXED,
    TPB,
    WINDOW,
    Priorities,
    Run,
    SsmOptions,
    batch,
    build_run,
    change_quota,
    clear,
    close_one,
    compare,
    decode,
    placement_hint,
    pressure,
    resume_one,
    serve,
)
from tests.fuzz.machine_settings import machine_settings
from tests.helpers import KIB, attention

SETTINGS = machine_settings("ORACLE", examples=8, steps=40)


@dataclass(frozen=True)
class OracleConfig:
    """One manager shape for ``build_run`` and the priorities its requests choose from."""

    tier_slots: tuple[int, ...]
    layers: tuple[LayerConfig, ...] | None = None
    partial_reuse: bool = False
    ssm_options: SsmOptions | None = None
    priorities: Sequence[Priorities] = tuple(MIXED)


CONFIGS = {
    "full_gpu": OracleConfig((12,), priorities=tuple(DEFAULT)),
    "full_three_tiers": OracleConfig((8, 4, 6)),
    "window_sinks": OracleConfig((16, 10), (attention(0, KIB), attention(1, KIB, window=WINDOW, sinks=TPB + 1))),
    "window_own_pool_group": OracleConfig((24, 16), (attention(0, KIB), attention(1, 2 * KIB, window=WINDOW))),
    "partial_reuse": OracleConfig((10, 8), partial_reuse=True),
    "partial_window_three_tiers": OracleConfig(
        (12, 8, 8), (attention(0, KIB), attention(1, KIB, window=WINDOW)), partial_reuse=True
    ),
    "ssm_hybrid": OracleConfig((12, 8), tuple(HYBRID), ssm_options=EVERY_BLOCK),
    "ssm_hybrid_three_tiers": OracleConfig((12, 8, 8), tuple(HYBRID), ssm_options=SsmOptions(2 * TPB)),
}

SEED = st.integers(0, 2**32 - 1)


def oracle_run(config: OracleConfig, directory: str) -> Run:
    disk = directory if len(config.tier_slots) > 2 else None
    layers = list(config.layers) if config.layers is not None else None
    return build_run(list(config.tier_slots), disk, layers, config.partial_reuse, config.ssm_options)


def machine_for(config: OracleConfig) -> type[RuleBasedStateMachine]:
    choices = list(config.priorities)

    class EvictionOracleMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.directory = tempfile.TemporaryDirectory(prefix="kvcm-oracle-")
            self.run = oracle_run(config, self.directory.name)

        def priorities(self, seed: int) -> tuple[random.Random, Priorities]:
            rng = random.Random(seed)
            return rng, rng.choice(choices)

        @rule(seed=SEED, hold=st.booleans())
        def serve(self, seed: int, hold: bool) -> None:
            rng, priorities = self.priorities(seed)
            serve(self.run, rng, priorities, hold)

        @rule(seed=SEED, fault=st.integers(0, FAULTS - 1), hold=st.booleans())
        def misbehave(self, seed: int, fault: int, hold: bool) -> None:
            rng, priorities = self.priorities(seed)
            serve_misbehaving(self.run, rng, priorities, fault, hold)

        @rule(seed=SEED)
        def fan_out(self, seed: int) -> None:
            rng, priorities = self.priorities(seed)
            fan_out(self.run, rng, priorities)

        @rule(seed=SEED)
        def pressure(self, seed: int) -> None:
            rng, priorities = self.priorities(seed)
            pressure(self.run, rng, priorities)

        @rule(seed=SEED)
        def change_quota(self, seed: int) -> None:
            change_quota(self.run, random.Random(seed))

        @rule()
        def clear(self) -> None:
            clear(self.run)

        @precondition(lambda self: not self.run.shared_tokens)  # prompts sharing a block's first tokens share a batch
        @rule(seed=SEED)
        def batch(self, seed: int) -> None:
            batch(self.run, random.Random(seed), choices)

        @precondition(lambda self: bool(self.run.suspended))
        @rule(seed=SEED, kind=st.integers(0, 3))
        def suspended_cache(self, seed: int, kind: int) -> None:
            """Resume (and suspend), decode a block, give a placement hint, close or drop the handle of one."""
            rng = random.Random(seed)
            if kind == 0:
                resume_one(self.run, rng)
            elif kind == 1:
                decode(self.run, rng)
            elif kind == 2:
                placement_hint(self.run, rng)
            elif rng.random() < 0.5:
                close_one(self.run, rng.choice(sorted(self.run.suspended)))
            else:
                drop_handle(self.run, rng)

        @invariant()
        def agrees_with_the_model(self) -> None:
            compare(self.run)

        def teardown(self) -> None:
            for cache, _ in self.run.suspended.values():
                cache.close()
            self.run.manager.shutdown()
            self.directory.cleanup()

    return EvictionOracleMachine


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_manager_evicts_as_the_model(name: str) -> None:
    run_state_machine_as_test(machine_for(CONFIGS[name]), settings=SETTINGS)


def fuzz_run(config: OracleConfig, seed: int, steps: int, directory: str) -> None:
    """``steps`` of ``fuzz_step`` from ``seed`` on ``config``, compared after each."""
    run = oracle_run(config, directory)
    rng = random.Random(seed)
    for _ in range(steps):
        fuzz_step(run, rng, list(config.priorities))
        compare(run)
    for cache, _ in run.suspended.values():
        cache.close()
    run.manager.shutdown()


PARTIAL_GPU = OracleConfig((12,), partial_reuse=True)


def test_turns_sharing_a_marker_copy_from_the_first_sibling_in_tree_order(tmp_path: Path) -> None:
    # Found by the fan-out shape: several turns after one system prompt share the turn marker's tokens, so a new
    # turn's partial match ties between them. The manager copies from the first in the tree's order (and files that
    # page as used); the model took any of them, so another turn's page was the next victim (model defect).
    fuzz_run(PARTIAL_GPU, 0, 10, str(tmp_path))


def test_a_block_with_many_children_orders_them_as_they_arrived(tmp_path: Path) -> None:
    # Found by the fan-out shape (step 76): once a block has 8 children with partial reuse, the tree finds them by
    # first token, in the order they arrived; a child joining after the first one was pruned no longer takes the
    # first place. The model kept the first-place order, so the tie went to another turn (model defect).
    fuzz_run(PARTIAL_GPU, 3, 77, str(tmp_path))


def test_a_partial_match_copies_from_a_sibling_that_still_has_every_groups_rows(tmp_path: Path) -> None:
    # Found by the fan-out shape: the first turn sharing the marker had lost its windowed page; the manager copies
    # the marker's rows from the next sibling holding them in every layer group (README "How much a request
    # reuses"), the model tried only the first and reused the system prompt alone: manager 6 tokens, model 4.
    layers = (attention(0, KIB), attention(1, KIB, window=WINDOW))
    fuzz_run(OracleConfig((16, 10), layers, partial_reuse=True), 0, 14, str(tmp_path))
