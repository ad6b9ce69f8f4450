"""The shared driver of the stateful fuzz test (``tests/test_stateful.py``) and the soak tool (``tools/soak.py``).

A ``Fuzzer`` owns one manager, a ``FakeEngine`` and a model of every cache it created (token list, capacity,
history, committed length, status). Each operation takes plain ints (so Hypothesis rules and a seeded
``random.Random`` can both draw them), calls the public API like an engine would, and asserts what a user can
observe: the modelled lengths, content written by the FakeEngine (checked after every resume, commit and resize,
and for every active cache after every operation), that a ``False`` from ``resume``/``resize``/``manager.resize``
changes nothing (lengths, page indices, storage statistics of every level, quotas, reuse probes, movement
counters) and is explained (``checks.check_refusal``; every other refused resize/resume of a cache with computed tokens
it has not committed is retried after ``stop_committing()``: it fits exactly when the refusal named
``own_stale_pages``), that documented invalid moves raise ``ValueError`` and change nothing, and ``check_invariants``.
Memory shortage (``False``, ``OutOfPagesError`` from a setter) is legal; any other exception is a bug.

No pytest here: ``tools/soak.py`` imports this package. ``Fuzzer`` is the world (``world.py``) with its
operations (``lifecycle_ops``, ``fault_ops``, ``handoff_ops``, ``manager_ops``, ``misuse_ops``, ``reentrancy_ops``, ``remote_ops``) and the random driver
below; ``configs`` holds the setups, ``limits`` the bounds of the operations' ints, ``checks`` the
observation snapshots, ``model`` what the fuzzer knows of each cache.

Beyond the plain lifecycle it drives SSM layers with snapshots (history only moves by computing, and chunks are
sometimes committed in two calls), SWA scratch reuse with windows that are not multiples of the block size, a host
tier with no slot for one pool group, priority callbacks that misbehave for one call (out of range, raising or
interrupting with a ``BaseException``: the call must raise and change nothing), a codec or store interrupting a
call (``FuzzInterrupt``: it comes out once the call completed; the world takes the caches' state and runs the
interrupted step), batches with id collisions, repeated prompts, absurd capacities and failing
callbacks, quota changes on every level and ``adjust()``, registered page-index buffers across suspend, resume and
close, and remote-tier fills into a small GPU tier (closed requests asked again, a store that answers short, long,
failed or raising, and restarts empty), disk tier pool files failing reads or writes during a step and a cold-page
codec raising (``fault_ops``: misses, or ``PageContentLostError`` closing the cache that lost pages). Re-entrancy (no manager call may run inside another): handles dropped inside
reference cycles with the cycle collector armed to run at a random allocation of the next manager call (or from a
priority callback), priority callbacks that call back into the manager (refused with ``RuntimeError``, nothing
changed), and attempts to copy or pickle a handle.

Extension points: add configs to ``configs.CONFIGS``; add operations as methods of the operations module they
belong to, list them in ``OPERATIONS`` with a weight (soak), dispatch them in ``Fuzzer.random_step`` and add a
matching rule to ``KVCacheMachine`` in ``tests/test_stateful.py``.
"""

from __future__ import annotations

import random
from typing import Final

from tests.fuzz.faulty_tiers import DISK_FAULTS
from tests.fuzz.flaky_store import STORE_FAULTS
from tests.fuzz.limits import (
    AMOUNT_MAX,
    BATCH_MAX,
    COLLECT_POINT_MAX,
    COPY_KINDS,
    HELD_CALLS,
    COUNT_MAX,
    CUT_MAX,
    FAULTS,
    FLAGS_MAX,
    FOLLOW_UPS,
    INDEX_MAX,
    INVALID_KINDS,
    QUOTA_CHOICES,
    REENTRY_TARGETS,
    RESIZE_KINDS,
    RESIZE_MODES,
    SCOPES,
    SOURCE_MAX,
    SUFFIX_MAX,
)
from tests.fuzz.fault_ops import FaultOperations
from tests.fuzz.handoff_ops import HANDOFF_CHOICES, HandoffOperations
from tests.fuzz.manager_ops import ManagerOperations
from tests.fuzz.misuse_ops import MisuseOperations
from tests.fuzz.reentrancy_ops import ReentrancyOperations
from tests.fuzz.remote_ops import TWIN_KINDS, RemoteOperations

# (operation, weight in the random driver); every name is a ``Fuzzer`` method taking ints.
OPERATIONS: Final[tuple[tuple[str, float], ...]] = (
    ("create", 3.0),
    ("fan_out", 0.3),
    ("resume", 3.0),
    ("resize", 6.0),
    ("serve", 6.0),
    ("commit", 4.0),
    ("stop_committing", 0.7),
    ("suspend", 2.0),
    ("place", 1.0),
    ("close", 2.0),
    ("change_quota", 0.4),
    ("clear_reusable", 0.3),
    ("register_buffer", 0.6),
    ("invalid_move", 1.0),
    ("create_batch", 1.2),
    ("preempt_batch", 0.6),
    ("misbehave", 0.6),
    ("adjust", 0.2),
    ("drop_in_cycle", 0.6),
    ("reenter", 0.6),
    ("copy_handle", 0.2),
    ("held_call", 0.3),
    ("refetch", 2.0),
    ("twin_serves", 1.0),
    ("store_fault", 0.4),
    ("restart_store", 0.05),
    ("disk_fault", 0.3),
    ("codec_fault", 0.3),
    ("misuse", 0.6),
    ("probe", 0.6),
    ("handoff", 0.6),
)


class Fuzzer(HandoffOperations, FaultOperations, ManagerOperations, MisuseOperations, ReentrancyOperations, RemoteOperations):
    """One manager under random operations; see the module docstring."""

    def random_step(self, rng: random.Random) -> str:
        """One operation with random arguments, chosen among the enabled ones by ``OPERATIONS`` weight."""
        names = [name for name, _ in OPERATIONS if self.enabled(name)]
        weights = [weight for name, weight in OPERATIONS if self.enabled(name)]
        name = rng.choices(names, weights)[0]
        self.last_operation = name
        index = rng.randint(0, INDEX_MAX)
        if name == "create":
            self.create(
                rng.randint(0, SOURCE_MAX),
                rng.randint(0, CUT_MAX),
                rng.randint(0, SUFFIX_MAX),
                rng.randint(0, len(SCOPES) - 1),
                rng.randint(0, FLAGS_MAX),
            )
        elif name == "fan_out":
            self.fan_out(rng.randint(0, COUNT_MAX), rng.randint(0, CUT_MAX))
        elif name == "resume":
            self.resume(index, rng.choice((0, 0, 1, 7)))
        elif name == "resize":
            self.resize(index, rng.randrange(RESIZE_KINDS), rng.randint(0, AMOUNT_MAX), rng.randrange(RESIZE_MODES))
        elif name == "serve":
            self.serve(index, rng.randint(0, AMOUNT_MAX))
        elif name == "commit":
            self.commit(index, rng.randint(0, COUNT_MAX), rng.randint(0, FLAGS_MAX))
        elif name == "stop_committing":
            self.stop_committing(index)
        elif name == "suspend":
            self.suspend(index)
        elif name == "place":
            self.place(index, rng.randrange(3))
        elif name == "close":
            self.close(index)
        elif name == "change_quota":
            self.change_quota(rng.randint(0, 3), rng.randrange(QUOTA_CHOICES))
        elif name == "clear_reusable":
            self.clear_reusable()
        elif name == "register_buffer":
            self.register_buffer(index, rng.randint(0, 3))
        elif name == "invalid_move":
            self.invalid_move(rng.randrange(INVALID_KINDS), index)
        elif name == "create_batch":
            self.create_batch(rng.randint(0, BATCH_MAX), rng.randint(0, SOURCE_MAX), rng.randint(0, FLAGS_MAX), rng.randint(0, AMOUNT_MAX))
        elif name == "preempt_batch":
            self.preempt_batch(
                rng.randint(0, 1), rng.randint(0, SOURCE_MAX), rng.randrange(4), rng.randint(0, AMOUNT_MAX)
            )
        elif name == "misbehave":
            self.misbehave(index, rng.randrange(FAULTS), rng.randint(0, AMOUNT_MAX))
        elif name == "adjust":
            self.adjust()
        elif name == "drop_in_cycle":
            self.drop_in_cycle(index, rng.randint(0, COLLECT_POINT_MAX), rng.randrange(FOLLOW_UPS))
        elif name == "reenter":
            self.reenter(index, rng.randrange(REENTRY_TARGETS), rng.random() < 0.5, rng.randint(0, AMOUNT_MAX))
        elif name == "copy_handle":
            self.copy_handle(index, rng.randrange(COPY_KINDS))
        elif name == "held_call":
            self.held_call(index, rng.randrange(HELD_CALLS), rng.randint(0, AMOUNT_MAX))
        elif name == "refetch":
            self.refetch(index, rng.randint(0, SUFFIX_MAX))
        elif name == "twin_serves":
            self.twin_serves(index, rng.randint(0, SUFFIX_MAX), rng.randrange(TWIN_KINDS))
        elif name == "store_fault":
            self.store_fault(rng.randrange(STORE_FAULTS), rng.randint(0, 2))
        elif name == "restart_store":
            self.restart_store()
        elif name == "disk_fault":
            self.disk_fault(rng.randrange(DISK_FAULTS), index, rng.randint(0, AMOUNT_MAX))
        elif name == "codec_fault":
            self.codec_fault(rng.randint(0, 2))
        elif name == "misuse":
            self.misuse(rng.getrandbits(32))
        elif name == "probe":
            scope = rng.randint(0, len(SCOPES) - 1)
            self.probe(rng.randint(0, SOURCE_MAX), rng.randint(0, CUT_MAX), scope, rng.randint(0, 1))
        elif name == "handoff":
            self.handoff(index, rng.randrange(HANDOFF_CHOICES))
        else:
            raise AssertionError(f"unknown operation {name}")
        return name
