"""User code reached through the arguments of a public call: a ``list`` subclass or an iterator given as tokens, an
``int`` subclass or an object with ``__index__`` given as an integer. Each is read once, at the input checks, into
plain values; none of its methods runs again inside the call or in a later one, and a value that answers
differently each time it is read is used as it was checked."""

from __future__ import annotations

from collections.abc import Iterator

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked

TPB = 16
KV = 2 * KIB


class Interrupt(BaseException):
    """What an armed argument's method raises (like ``KeyboardInterrupt``, not an ``Exception``)."""


class ShiftingTokens(list):  # type: ignore[type-arg]
    """Tokens whose slices answer other tokens (and count every call): the manager must read it once."""

    calls = 0

    def __getitem__(self, index: object) -> object:  # type: ignore[override]
        ShiftingTokens.calls += 1
        items = list.__getitem__(self, index)  # type: ignore[call-overload]
        return [token + 1000 for token in items] if isinstance(index, slice) else items

    def __len__(self) -> int:
        ShiftingTokens.calls += 1
        return list.__len__(self)


def manager() -> KVCacheManager:
    return KVCacheManager(make_config([attention(0, KV, window=TPB), attention(1, KV)], tokens_per_block=TPB))


def test_a_list_subclass_of_tokens_is_read_once_as_plain_tokens() -> None:
    """Before: 'assert 7 <= 1': the subclass's methods ran 7 times inside create_kv_cache (the match sliced it, and
    its slices answered other tokens, so the prompt served just before reused nothing)."""
    kv = manager()
    engine = FakeEngine(kv)
    prompt = seeded_prompt(1, 4 * TPB)
    serve_checked(kv, engine, prompt)
    ShiftingTokens.calls = 0
    cache = kv.create_kv_cache(None, ShiftingTokens(prompt[:-1]))
    assert ShiftingTokens.calls <= 1  # list() asks the length once, at the input check
    assert cache.num_committed_tokens == len(prompt) - 1  # as a plain list reuses (partial reuse)
    assert cache.resume() and cache.resize(len(prompt))
    engine.check(cache, prompt[: cache.history_length])
    engine.step(cache, prompt)
    ShiftingTokens.calls = 0
    cache.commit(ShiftingTokens(prompt[cache.num_committed_tokens :]))
    assert ShiftingTokens.calls <= 1 and cache.committed_tokens == prompt
    cache.close()
    ShiftingTokens.calls = 0
    assert kv.probe_reuse(None, ShiftingTokens(prompt)) == len(prompt) and ShiftingTokens.calls <= 1
    kv.check_invariants()
    kv.shutdown()


def test_a_text_only_cache_commits_every_token_of_an_iterator() -> None:
    """Before: 'assert 0 == 20' (the text-only check consumed the iterator; the cache committed what was left of it,
    nothing), while a cache without text_only committed all 20."""
    kv = manager()
    for text_only in (False, True):
        cache = kv.create_kv_cache(None, [], text_only=text_only)
        assert cache.resume() and cache.resize(2 * TPB)
        cache.commit(iter(range(20)))  # type: ignore[arg-type]  # any iterable is read (check_tokens)
        assert cache.num_committed_tokens == 20 and cache.committed_tokens == list(range(20))
        cache.close()
    kv.check_invariants()
    kv.shutdown()


class ArmedInt(int):
    """An id whose ``__hash__`` and ``__eq__`` interrupt once armed: they must never run inside a manager call."""

    armed = False

    def __hash__(self) -> int:
        if ArmedInt.armed:
            raise Interrupt("__hash__ ran inside a manager call")
        return int.__hash__(self)

    def __eq__(self, other: object) -> bool:
        if ArmedInt.armed:
            raise Interrupt("__eq__ ran inside a manager call")
        return int.__eq__(self, other)


def test_an_int_subclass_id_is_kept_as_a_plain_int() -> None:
    """Before: 'assert ArmedInt is int' (the cache kept the subclass as its id; past that line, 'Interrupt: __hash__
    ran inside a manager call' out of close, the registry's lookup)."""
    kv = manager()
    cache = kv.create_kv_cache(None, [1, 2, 3], id=ArmedInt(7))
    assert type(cache.id) is int and cache.id == 7
    ArmedInt.armed = True
    try:
        other = kv.create_kv_cache(None, [1, 2, 3])
        cache.close()
        other.close()
    finally:
        ArmedInt.armed = False
    kv.check_invariants()
    kv.shutdown()


class Flipping:
    """An integer argument answering ``first`` once, then ``then``."""

    def __init__(self, first: int, then: int) -> None:
        self.values = [first, then]

    def __index__(self) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def test_get_page_view_reads_its_layer_id_once() -> None:
    """Before: 'assert (16382, 2048) == (16384, 2048)': the placement of layer 0 with the row count of layer 1 (the
    id read twice)."""
    kv = KVCacheManager(make_config([attention(0, KV), attention(1, KV)], tokens_per_block=TPB))
    wanted = kv.get_page_view(0, "key")
    assert kv.get_page_view(1, "key").shape != wanted.shape  # one pool: layer 1's rows start past layer 0's
    assert kv.get_page_view(Flipping(0, 1), "key").shape == wanted.shape
    kv.shutdown()


def test_a_token_iterator_calling_the_manager_is_refused_naming_what_ran_it() -> None:
    """The refusal names the user code an argument runs, not only callbacks and hooks (before: '... (a priority
    callback or an event-manager hook must not call the manager or its caches)' for a token iterator)."""
    kv = manager()
    refused: list[str] = []

    def tokens() -> Iterator[int]:
        try:
            kv.create_kv_cache(None, [1, 2, 3])
        except RuntimeError as error:
            refused.append(str(error))
        yield from range(8)

    cache = kv.create_kv_cache(None, tokens())  # type: ignore[arg-type]  # any iterable is read (check_tokens)
    assert len(refused) == 1 and "KVCacheManager.create_kv_cache was called while" in refused[0]
    assert "a token iterator or an argument's __index__" in refused[0]
    assert kv.num_live_caches == 1
    cache.close()
    kv.check_invariants()
    kv.shutdown()
