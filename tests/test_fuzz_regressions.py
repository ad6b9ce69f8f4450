"""Fixed operation sequences the stateful fuzzer (``tests/test_stateful.py``) once failed on, each kept as a test of
its own so the case runs every time, not only when Hypothesis or the soak driver draws it again."""

from __future__ import annotations

from kv_cache_manager_v2 import KVCacheStatus
from tests.fuzz.configs import CONFIGS
from tests.fuzz.driver import Fuzzer
from tests.test_stateful import KVCacheMachine


def test_an_interrupt_out_of_half_a_hybrids_commit_leaves_its_engine_in_step() -> None:
    """Found by tools/soak.py once the hybrid ran over a remote tier (``remote_hybrid``), the first SSM config whose
    calls an interrupt can come out of (the store's). The step had run to its capacity, the first of its two commits
    wrote its full blocks through and the store's put raised ``FuzzInterrupt``; the world took the lengths as
    reported and ran the step again from the history the commit left behind, with the live states already past it:
    ``ContentError: ... live state is of 88 tokens ..., expected the state of 68 tokens``. The engine's follow-up
    now sets its states back to that history before computing again, and commits what it computed."""
    config = next(config for config in CONFIGS if config.name == "remote_hybrid")
    fuzz = Fuzzer(config)
    try:
        fuzz.create(0, 0, 40, 0, 0)
        fuzz.resume(0, 0)
        assert fuzz.store is not None
        fuzz.store.faults = [5]  # the next store call raises FuzzInterrupt: the first commit's write-through put
        fuzz.serve(0, 63)  # odd: the chunk is committed in two calls
        assert fuzz.stats.interrupts == 1
        fuzz.check()
    finally:
        fuzz.teardown()


def test_a_hybrid_left_stopped_by_an_interrupted_close_is_closed_by_its_engine() -> None:
    """Found by tools/soak.py on ``remote_hybrid`` (seed 31, operation 1364) once the test above was fixed: ``close``
    of an SSM world first saves the last snapshot (``stop_committing(save_last_ssm_snapshot=True)``); an interrupt
    out of that call (a store put) left the cache open, committing stopped, and the world served it on, computing
    without committing: "ContentError: cache 5 SSM layer 0 role 'ssm_state': live state is of 89 tokens ...,
    expected the state of 88 tokens". There committing stops only on the way to close, so the follow-up closes it.
    The interrupt is taken as coming out of that call here (the store's own is rare to arrange)."""
    config = next(config for config in CONFIGS if config.name == "remote_hybrid")
    fuzz = Fuzzer(config)
    try:
        fuzz.create(0, 0, 40, 0, 0)
        fuzz.resume(0, 0)
        fuzz.serve(0, 63)
        fuzz.live[0].cache.stop_committing(save_last_ssm_snapshot=True)  # what close calls first
        fuzz._follow_interrupted_call()
        fuzz.check()
        fuzz.serve(0, 0)
        fuzz.check()
        assert not fuzz.live
    finally:
        fuzz.teardown()


def test_a_batch_follower_recalled_by_its_writers_suspend_keeps_its_admitted_capacity() -> None:
    """Found by Hypothesis (``test_state_machine[full]``): a follower admitted with ``num_new_tokens=4`` on 16
    borrowed rows (history 16, capacity 20) whose writer was suspended before the batch's step goes back to history 0
    and keeps capacity 20, computing the recalled rows too; the model counted the new tokens from the history after
    the recall: ``AssertionError: (KVCache(id=6, ..., capacity=20, history_length=0, ...), (4, 0, 0))``."""
    config = next(config for config in CONFIGS if config.name == "full")
    fuzz = Fuzzer(config)
    try:
        for _ in range(4):
            fuzz.adjust()
        fuzz.create_batch(2, 0, 56, 16)  # flags 56: one new shared prefix, num_new_tokens; extra 16: suspend the writer
        assert fuzz.stats.preemptions == 1 and fuzz.stats.recalls == 1
        fuzz.check()
    finally:
        fuzz.teardown()


def test_an_interrupt_out_of_half_the_commit_of_a_preempted_batch_requests_step() -> None:
    """Found once edges13's quota factor 0 shifted ``test_random_driver_of_the_soak_tool``'s choices (seed 0,
    ``remote_hybrid``, operation 24). A batch request suspended before its first step (``preempt_batch``, mode 1)
    runs that step when ``serve`` resumes it, its live states then at its capacity; the first of the chunk's two
    commits wrote its full blocks through and the store's put raised ``FuzzInterrupt`` (the commit completed:
    history 25 of 51). The world had not recorded that step as computed, so its follow-up ran the step again
    without setting the states back to that history: "ContentError: cache 1000003 SSM layer 0 role 'ssm_state':
    live state is of 51 tokens ..., expected the state of 25 tokens". Every engine step now goes through
    ``FuzzWorld._step``, which records where it ended."""
    config = next(config for config in CONFIGS if config.name == "remote_hybrid")
    fuzz = Fuzzer(config)
    try:
        fuzz.preempt_batch(0, 0, 1, 3)  # two requests behind a new prefix (the first absurd: refused), the
        # second suspended before its step: 48 tokens, a commit of 24 then 24
        model = fuzz.live[0]
        assert fuzz.stats.preemptions == 1 and not model.active and model.history == 0 < model.capacity
        assert fuzz.store is not None
        fuzz.store.faults = [5]  # the next store call raises FuzzInterrupt: the first commit's write-through put
        fuzz.serve(0, 1)  # odd: the chunk is committed in two calls; its capacity is already the step's
        assert fuzz.stats.interrupts == 1
        assert 0 < model.history == model.committed == model.capacity, model.lengths
        fuzz.check()
    finally:
        fuzz.teardown()


def test_a_resumed_cache_whose_scratch_slots_another_cache_wrote_is_checked_outside_them() -> None:
    """Found by Hypothesis (``swa_scratch``, 120 examples), on main and at dee109b alike: a cache computed 48 tokens
    in one chunk (block 0 in a scratch slot: it leaves layer 0's 20-token window within the chunk) and committed 44,
    so the scratch block stays; suspended, its scratch slot went to other caches (``fan_out``), and resumed with a
    fresh one. No query from ``capacity - max_rewind_len`` on attends a scratch block, but the FakeEngine's history
    check compared its rows too: "ContentError: cache 1000005 layer 0 role 'key': wrong content at positions
    [0, 1, 2, 3, 4, 5, 6, 7] (16 of 44 checked tokens)". Scratch rows are now compared only in the layer that wrote
    them."""
    config = next(config for config in CONFIGS if config.name == "swa_scratch")
    machine = KVCacheMachine(config)
    try:
        machine.preempt_batch(extra=0, mode=0, size=0, source=0)
        machine.create_batch(extra=45, flags=57, size=3, source=0)
        machine.stop_committing(index=7)
        machine.create_batch(extra=38, flags=16, size=1, source=13)
        machine.stop_committing(index=6)
        machine.stop_committing(index=0)
        machine.commit(count=44, flags=0, index=3)
        for _ in range(3):
            machine.close(index=0)
        machine.drop_in_cycle(follow=2, index=0, point=0)  # the live cache left is suspended
        machine.fan_out(count=0, cut=0)
        (model,) = machine.fuzz.live
        assert (model.cache.capacity, model.history, model.cache.status) == (48, 44, KVCacheStatus.SUSPENDED)
        machine.resume(index=0, stream=0)
        scratch = model.cache.get_scratch_desc(0)
        assert scratch is not None and scratch.range.beg == 0 < scratch.range.end
        machine.fuzz.check()
    finally:
        machine.teardown()
