"""What the fuzzer knows of each cache (``CacheModel``), its priority callbacks, and the counts it reports
(``FuzzStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import LifeCycle, MovementCounters, Priority, ReuseByTier, ReuseScope, TokenSequence, _KVCache
from kv_cache_manager_v2.testing import ContextualTokens

Token = Union[int, bytes]
I32 = npt.NDArray[np.int32]


class CallbackFault(RuntimeError):
    """What a misbehaving priority callback raises."""


class FuzzInterrupt(BaseException):
    """What the fuzzer's user code (priority callback, codec, store) raises to interrupt a call, as
    ``KeyboardInterrupt`` would: not an ``Exception``. A codec's or store's comes out when the call has completed;
    a priority callback's at once, with nothing changed."""


class CallbackInterrupt(FuzzInterrupt):
    """A misbehaving priority callback's ``FuzzInterrupt`` (the operations that arm it expect it)."""


class FuzzCallback:
    """A deterministic priority callback that the fuzzer can make misbehave for one call."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.fault = 0  # 0: behaves; 1: returns an out-of-range priority; 2: raises CallbackFault; 3: FuzzInterrupt
        self.calls: int = 0
        self.reenter: Callable[[], object] | None = None  # run on every call (calls back into the manager)

    def __call__(self, ordinal: int, life_cycle: LifeCycle) -> Priority:
        self.calls += 1
        if self.reenter is not None:
            self.reenter()
        if self.fault == 1:
            return Priority(101 + ordinal)
        if self.fault == 2:
            raise CallbackFault(f"priority callback failed for block {ordinal}")
        if self.fault == 3:
            raise CallbackInterrupt(f"priority callback interrupted at block {ordinal}")
        return Priority((self.base + 7 * ordinal + 13 * (life_cycle.window_size or 0)) % 101)


class CacheModel:
    """What the engine knows about one cache: its tokens by position and the lengths it expects."""

    def __init__(self, cache: _KVCache, tokens: list[Token], scope: ReuseScope | None, reused: int) -> None:
        self.cache = cache
        self.tokens = tokens
        self.prompt_length: int = len(tokens)
        self.scope = scope
        self.capacity = reused
        self.history = reused
        self.committed = reused
        self.active = False
        self.stopped = False
        self.buffers: dict[int, I32] = {}
        self.callback: FuzzCallback | None = None
        # Batch admission: (history, committed) when admitted, until either moves on. Meanwhile the history may
        # go back (rows an earlier request of the batch was to compute, recalled when it skipped its step).
        self.borrowed_at: tuple[int, int] | None = None
        self.step_skipped = False  # suspended before its first step: the engine runs it once the cache is back
        # Where the engine's last step (``FuzzWorld._step``) ended: its rows and SSM live states hold
        # the tokens up to here, ahead of the history until the step's tokens are all committed.
        self.computed = reused
        # ``probe_reuse_by_tier`` at creation and the movement counters then: until a page moves, the first resume
        # onboards and copies what it said (``LifecycleOperations.resume`` checks it).
        self.split_at_create: tuple[ReuseByTier, MovementCounters] | None = None
        self._written = ContextualTokens(scope_context(scope))

    @property
    def engine_tokens(self) -> list[int]:
        """What the FakeEngine writes and checks for ``tokens``: digests of the scope and the whole prefix at each
        position, so a page of another prompt or scope holding the same tokens fails the check."""
        return self._written.of(self.tokens)

    @property
    def lengths(self) -> tuple[int, int, int]:
        return self.capacity, self.history, self.committed


@dataclass
class FuzzStats:
    operations: int = 0
    caches_created: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    shortages: int = 0
    invalid_moves: int = 0
    quota_changes: int = 0
    tokens_checked: int = 0
    callback_faults: int = 0
    batches_refused: int = 0
    batch_shares: int = 0  # batch requests holding pages an earlier request of their batch computes
    preemptions: int = 0  # batches whose first request was cut, suspended, closed or dropped before its step
    recalls: int = 0  # histories that went back because an earlier request of their batch skipped its step
    lost_caches: int = 0  # suspended caches closed after PageContentLostError (disk or codec faults)
    interrupts: int = 0  # calls a codec's or store's FuzzInterrupt came out of (after completing)
    stale_retries: int = 0  # refused calls retried after stop_committing (``LifecycleOperations._stop_and_retry``)
    stale_rescues: int = 0  # of those, the retries that fitted (the refusal named its own stale pages)
    handoffs_executed: int = 0  # local handoffs (``handoff_ops``) whose plan ran, the receiver's rows checked
    handoffs_refused: int = 0  # of those planned, refused by ``execute`` (their sender moved on meanwhile)
    by_operation: dict[str, int] = field(default_factory=dict)

    def add(self, other: FuzzStats) -> None:
        self.operations += other.operations
        self.caches_created += other.caches_created
        self.reuse_hits += other.reuse_hits
        self.reused_tokens += other.reused_tokens
        self.shortages += other.shortages
        self.invalid_moves += other.invalid_moves
        self.quota_changes += other.quota_changes
        self.tokens_checked += other.tokens_checked
        self.callback_faults += other.callback_faults
        self.batches_refused += other.batches_refused
        self.batch_shares += other.batch_shares
        self.preemptions += other.preemptions
        self.recalls += other.recalls
        self.lost_caches += other.lost_caches
        self.interrupts += other.interrupts
        self.stale_retries += other.stale_retries
        self.stale_rescues += other.stale_rescues
        self.handoffs_executed += other.handoffs_executed
        self.handoffs_refused += other.handoffs_refused
        for name, count in other.by_operation.items():
            self.by_operation[name] = self.by_operation.get(name, 0) + count


def lengths_of(cache: _KVCache) -> tuple[int, int, int]:
    """The lengths a cache reports, in ``CacheModel.lengths`` order."""
    return cache.capacity, cache.history_length, cache.num_committed_tokens


def pick(candidates: Sequence[CacheModel], index: int) -> CacheModel | None:
    """The candidate an operation's ``index`` picks (None when there is none)."""
    return candidates[index % len(candidates)] if candidates else None


# Ints hash to themselves modulo this Mersenne prime: adding it to one token keeps a block's ``hash(tuple)``.
HASH_MODULUS = (1 << 61) - 1


def hash_colliding(tokens: list[Token], tokens_per_block: int) -> list[Token]:
    """``tokens`` with the last token of its last full block moved by ``HASH_MODULUS`` (an int not moved yet): that
    block then shares its ``hash()`` with the original's, so the radix tree keeps the two apart by its collision slots
    while every other block stays the same."""
    end = len(tokens) // tokens_per_block * tokens_per_block
    last = tokens[end - 1] if end else None
    if not isinstance(last, int) or last >= HASH_MODULUS:  # moved once already: stay within int64
        return tokens
    twin = list(tokens)
    twin[end - 1] = last + HASH_MODULUS
    return twin


def scope_context(scope: ReuseScope | None) -> str:
    """The contextual tokens' context of a scope (None is the default scope: the same tree, the same KV)."""
    return repr(ReuseScope() if scope is None else scope)


def same_scope(a: ReuseScope | None, b: ReuseScope | None) -> bool:
    """Whether two scopes share one prefix tree (None is the default scope)."""
    return (ReuseScope() if a is None else a) == (ReuseScope() if b is None else b)


def token_arg(tokens: list[Token], as_numpy: bool) -> TokenSequence:
    """Tokens as the engine passes them: a list, or an int64 NumPy array when every token is an int."""
    if as_numpy and all(isinstance(token, int) for token in tokens):
        return np.array(tokens, dtype=np.int64)
    return tokens
