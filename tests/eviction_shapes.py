"""The stateful fuzzer's shapes (``tests/fuzz/``) that the eviction model (``tests/eviction_model.py``) can follow,
as operations on ``tests/eviction_workload.py``'s ``Run``: a system prompt fanned out into 9-12 chat turns sharing a
turn marker, priority callbacks that fail, interrupt (a ``BaseException``) or call back into the manager in the
middle of a resume or a resize, and handles dropped instead of closed (closed by the next manager call).

A call whose callback failed must raise and change nothing: the model is not told, and ``compare`` checks the
manager against it before the call is made again with a callback that behaves. ``fuzz_step`` mixes these with the
workload's own ``step``.

Left out because the model cannot follow them (the main fuzzer drives them, without this oracle): planned drops
(``plan_committed_block_drop``), SWA scratch reuse, ``stop_committing`` and commits of a partial block other than a
partial reuse's, reuse scopes, the remote tier, disk and codec faults (pages lost), and an interrupt coming out of a
codec or store after its call completed."""

from __future__ import annotations

import random
from typing import Callable, SupportsIndex, TypeVar

from kv_cache_manager_v2 import KVCache, LifeCycle, Priority, PriorityCallback
from tests.eviction_workload import (
    TPB,
    Priorities,
    Run,
    block_tokens,
    compare,
    priority_callbacks,
    random_prompt,
    serve_prompt,
    step,
)
from tests.fuzz.model import CallbackFault, FuzzInterrupt

T = TypeVar("T")

# What a misbehaving callback does on its next call: answer out of range, raise, interrupt (``BaseException``),
# call back into the manager and let the refusal propagate, or call back in and swallow the refusal.
OUT_OF_RANGE, RAISES, INTERRUPTS, REENTERS, REENTERS_SWALLOWED = range(5)
FAULTS = 5
TURN_MARKER = [9_000_000 + position for position in range(TPB // 2)]  # a chat template's turn start


class FlakyCallback:
    """A priority callback that misbehaves (``fault``) while armed, asked at least once then (``asked``)."""

    def __init__(self, run: Run, behaving: PriorityCallback) -> None:
        self.run = run
        self.behaving = behaving
        self.fault: int | None = None
        self.asked = 0
        self.refusals: list[str] = []

    def __call__(self, ordinal: int, life_cycle: LifeCycle) -> SupportsIndex:
        if self.fault is None:
            return self.behaving(ordinal, life_cycle)
        self.asked += 1
        if self.fault == OUT_OF_RANGE:
            return Priority(101 + ordinal)
        if self.fault == RAISES:
            raise CallbackFault(f"priority callback failed for block {ordinal}")
        if self.fault == INTERRUPTS:
            raise FuzzInterrupt(f"priority callback interrupted at block {ordinal}")
        try:
            self.run.manager.probe_reuse(None, [1, 2, 3])
        except RuntimeError as error:
            self.refusals.append(str(error))
            if self.fault == REENTERS:
                raise
        else:
            raise AssertionError("a manager call from inside a priority callback was not refused")
        return self.behaving(ordinal, life_cycle)


def with_fault(run: Run, callback: FlakyCallback, fault: int, call: Callable[[], T]) -> T:
    """``call`` with ``callback`` misbehaving: if it asked the callback (and the fault is not one it survives), it
    must raise and change nothing (``compare`` against the model, which is not told); then ``call`` again with the
    callback behaving."""
    callback.fault, callback.asked = fault, 0
    try:
        result = call()
    except (ValueError, CallbackFault, FuzzInterrupt, RuntimeError) as error:
        assert callback.asked, f"{error!r} without asking the callback: {run.log}"
        assert fault != REENTERS_SWALLOWED, f"{error!r} from a swallowed refusal: {run.log}"
        run.log.append(f"  {type(error).__name__} from the priority callback: nothing changed")
        callback.fault = None
        compare(run)
        return call()
    finally:
        callback.fault = None
    assert not callback.asked or fault == REENTERS_SWALLOWED, f"a misbehaving callback's answer was accepted: {run.log}"
    assert all("is in flight" in message for message in callback.refusals), callback.refusals
    return result


def serve_misbehaving(run: Run, rng: random.Random, priorities: Priorities, fault: int, hold: bool) -> None:
    """``serve_prompt`` with a callback misbehaving at the first resume (an SSM live state, a partial block's copy)
    and at the resizes (new pages)."""
    tokens = random_prompt(run, rng)
    run.log.append(f"serve with fault {fault} {len(tokens) // TPB} blocks {tokens[::TPB]} priorities {priorities}")
    run.prompts.append(tokens)
    behaving, of = priority_callbacks(run, priorities)
    callback = FlakyCallback(run, behaving)
    cache_id = run.next_id
    run.next_id += 1
    cache = with_fault(
        run,
        callback,
        fault,
        lambda: run.manager.create_kv_cache(None, tokens, id=cache_id, custom_priority_callback=callback),
    )
    assert cache.num_committed_tokens == run.model.create(cache_id, tokens, of), run.log
    util = run.manager.config.max_util_for_resume
    done = with_fault(run, callback, fault, cache.resume)
    assert done == run.model.resume(cache_id, util), run.log
    hybrid = run.model.ssm is not None
    capacity = len(tokens) + (TPB if hold else 0)
    computed = len(tokens) if hybrid else capacity  # an SSM live state holds what was computed: the prompt only
    if done:
        run.engine.check(cache, tokens)
        done = with_fault(run, callback, fault, lambda: cache.resize(computed))
        assert done == run.model.resize(cache_id, computed), run.log
    if done:
        run.engine.step(cache, tokens + [0] * (computed - len(tokens)))
        cache.commit(tokens[cache.num_committed_tokens :])
        run.model.commit(cache_id, len(tokens))
        if capacity > computed:
            done = with_fault(run, callback, fault, lambda: cache.resize(capacity))
            assert done == run.model.resize(cache_id, capacity), run.log
    if done and hold and len(run.suspended) < 2:
        cache.suspend()
        run.model.suspend(cache_id)
        run.suspended[cache_id] = (cache, tokens)
        return
    cache.close()
    run.model.close(cache_id)


def fan_out(run: Run, rng: random.Random, priorities: Priorities) -> None:
    """A system prompt (1-2 blocks) served, then 9-12 chat turns after it: each starts with ``TURN_MARKER`` and goes
    on with its own tokens (children of the system prompt's last block sharing their first tokens)."""
    system = [token for ordinal in range(rng.randint(1, 2)) for token in block_tokens(0, ordinal)]
    run.log.append(f"fan out after {system[::TPB]}")
    for _ in range(rng.randint(9, 12)):
        own = 10_000_000 + 1_000 * run.next_id
        turn = system + TURN_MARKER + [own + position for position in range(rng.randint(1, 2) * TPB - len(TURN_MARKER))]
        serve_prompt(run, turn, priorities, hold=False)
        compare(run)


def drop_handle(run: Run, rng: random.Random) -> None:
    """A suspended cache's handle dropped (no ``close``): the manager closes it at the start of its next call."""
    cache_id = rng.choice(sorted(run.suspended))
    run.log.append(f"drop the handle of {cache_id}")
    held: list[KVCache] = [run.suspended.pop(cache_id)[0]]
    held.clear()  # the last reference: the handle's finalizer queues its close
    run.model.close(cache_id)


def fuzz_step(run: Run, rng: random.Random, priority_choices: list[Priorities]) -> None:
    """The workload's ``step`` or, now and then, one of the fuzzer's shapes above."""
    action = rng.choices(("step", "misbehave", "fan_out", "drop"), (20, 4, 1, 2))[0]
    priorities = rng.choice(priority_choices)
    if action == "misbehave":
        serve_misbehaving(run, rng, priorities, rng.randrange(FAULTS), rng.random() < 0.3)
    elif action == "fan_out":
        fan_out(run, rng, priorities)
    elif action == "drop" and run.suspended:
        drop_handle(run, rng)
    else:
        step(run, rng, priority_choices)
