"""The reuse model inside a fuzz machine: a Hypothesis ``RuleBasedStateMachine`` whose rules are
``tests/reuse_workload.py``'s requests (a new family, a branch or the next turn of an earlier conversation,
prefilled in chunks, decoded, suspended, ``stop_committing``, planned drops, batches) and the stateful fuzzer's
fan-out (9-12 chat turns after a system prompt sharing a turn marker). Each request's reuse, tallies and
``snapshot_points`` are the model's as it is made; after every rule the pages the KV events say are stored are the
model's (``Run.sync``) and every recent history's and suspended request's ``probe_reuse`` is the model's reuse.

Setups: every one of ``tests/test_reuse_model.py``'s (full, windows with sinks, SSM hybrids, partial reuse, SWA
scratch reuse, backoff, small quotas on two tiers). Sizes: ``KV_CACHE_MANAGER_V2_ORACLE_EXAMPLES`` examples per
setup (default 2) of ``KV_CACHE_MANAGER_V2_ORACLE_STEPS`` steps (default 12: a fan-out is a dozen requests, each
synced call by call; 4 x 40 took 8.7 min for the 27 setups on 2 busy cores).

Left out (the model cannot follow them; the main fuzzer drives them): priority callbacks failing mid-call (the
eviction machine, ``tests/test_eviction_fuzz.py``, checks those change nothing), reuse scopes, the remote tier,
disk and codec faults."""

from __future__ import annotations


import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.fuzz.machine_settings import machine_settings
from tests.reuse_workload import SETUPS, Setup, build_run

SETTINGS = machine_settings("ORACLE", examples=2, steps=12)


def machine_for(setup: Setup) -> type[RuleBasedStateMachine]:
    class ReuseOracleMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run = build_run(setup, 0)

        @rule(seed=st.integers(0, 2**32 - 1))
        def admit(self, seed: int) -> None:
            self.run.rng.seed(seed)
            self.run.resume_beyond(2)
            self.run.admit()

        @rule(seed=st.integers(0, 2**32 - 1))
        def admit_batch(self, seed: int) -> None:
            self.run.rng.seed(seed)
            self.run.resume_beyond(2)
            self.run.admit_batch()

        @rule(seed=st.integers(0, 2**32 - 1))
        def fan_out(self, seed: int) -> None:
            self.run.rng.seed(seed)
            self.run.resume_beyond(2)
            self.run.fan_out()

        @precondition(lambda self: bool(self.run.suspended))
        @rule(seed=st.integers(0, 2**32 - 1))
        def resume_one(self, seed: int) -> None:
            self.run.rng.seed(seed)
            self.run.resume_one()

        @invariant()
        def agrees_with_the_model(self) -> None:
            self.run.sync()
            self.run.check_probes()

        def teardown(self) -> None:
            while self.run.suspended:
                self.run.suspended.pop().cache.close()
            if self.run.manager.num_live_caches == 0:  # else a failed rule left its request open: the error says why
                self.run.manager.shutdown()

    return ReuseOracleMachine


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_the_manager_reuses_as_the_model(name: str) -> None:
    run_state_machine_as_test(machine_for(SETUPS[name]), settings=SETTINGS)
