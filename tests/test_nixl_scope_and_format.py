"""What both sides of a NIXL handoff must agree on beyond the manager's layout: the request's reuse scope and what
a page's bytes mean (``KVFormat``).

A reuse scope (a LoRA, a tenant's salt) keys the prefix match on each side: the same tokens in another scope are
other KV. So the request carries the receiving cache's scope, the prefill side computes the prompt in it, and
``send_sources`` refuses a cache of another. Content is checked with ``contextual_tokens`` keyed by the scope: a
page computed in another scope fails the decode side's ``FakeEngine.check``. The pages' element type, model,
arrangement and tensor-parallel rank are invisible in their sizes; the handshake compares the two sides' ``KVFormat``
and refuses a difference on both sides. Every process and agent is started and stopped here.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheManagerConfig, ReuseScope
from kv_cache_manager_v2.disagg import KVFormat, KVReceiver, KVSender, prepare_receiver
from kv_cache_manager_v2.testing import FakeEngine, contextual_tokens
from tests.helpers import KIB, MIB, attention, make_config
from tests.nixl_helpers import FAKE_FORMAT, DecodeSide, PrefillSide, child_side, fake_prefill_side, hybrid_config, prefill, require_nixl, tokens_of
from tests.test_nixl_sender_hold import PROMPT, decode_side

SHARED = tokens_of(700, 160)  # five blocks both prompts start with
PROMPTS = [SHARED + tokens_of(701, 90), SHARED + tokens_of(702, 120)]
# (scope, prompt) in order: the second asks the first's shared blocks in another scope; the third and fourth reuse
# their own scope's shared blocks on both sides.
REQUESTS = [
    (ReuseScope(), 0),
    (ReuseScope(lora_id=1), 1),
    (ReuseScope(), 1),
    (ReuseScope(lora_id=1), 0),
    (ReuseScope(lora_id=1, salt=b"tenant"), 0),
]


def attention_config() -> KVCacheManagerConfig:
    """Full attention and a window: both sides reuse a committed prefix (the hybrid layout's SSM groups reuse only
    at snapshots, which a received prompt lacks)."""
    return make_config([attention(0, 2 * KIB), attention(1, 2 * KIB, window=64, sinks=10)], gpu_quota=8 * MIB)


def context_of(scope: ReuseScope) -> str:
    return repr((scope.lora_id, scope.salt))


def scoped_prefill_side(connection: Connection) -> None:
    """Prefills each request in its scope (its own prefix match there), the KV keyed by that scope; each
    ``send_sources`` reports how many tokens the prefill side reused (``extra``)."""
    manager = KVCacheManager(attention_config())
    engine = FakeEngine(manager)
    sender = KVSender(manager, connection, kv_format=FAKE_FORMAT)
    while (request := sender.next_request()) is not None:
        tokens = request.tokens
        cache = manager.create_kv_cache(request.reuse_scope, tokens)
        assert cache.resume() and cache.resize(len(tokens), cache.history_length)
        engine.step(cache, contextual_tokens(tokens, context_of(request.reuse_scope)))
        reused = cache.num_committed_tokens
        cache.commit(tokens[reused:])
        sender.send_sources(request, cache, extra=reused)
        assert sender.wait_released(request)
        cache.close()
    sender.close()
    manager.check_invariants()
    manager.shutdown()


def test_each_scope_s_prompt_arrives_with_that_scope_s_kv() -> None:
    """Prompts sharing 160 tokens asked in two scopes and a salted one. Before: the request had no scope, so the
    prefill side matched every prompt in the default scope: the lora 1 request (computed with the LoRA's codes)
    reused the default scope's shared blocks ('cache 1 layer 0 role 'key': wrong content at positions [0, 1, ...]
    (160 of 160 checked tokens)', on the prefill side's own check)."""
    require_nixl()
    with child_side(scoped_prefill_side) as side:
        manager = KVCacheManager(attention_config())
        engine = FakeEngine(manager)
        receiver = KVReceiver(manager, side.connection, timeout_s=30, kv_format=FAKE_FORMAT)
        reused = []
        for scope, index in REQUESTS:
            prompt = PROMPTS[index]
            received = prepare_receiver(manager, prompt, scope)
            assert received is not None
            cache, counts = received
            here = cache.num_committed_tokens
            result = receiver.receive(cache, prompt, counts)
            reused.append((here > 0, result.extra))
            engine.check(cache, contextual_tokens(prompt, context_of(scope)))
            cache.commit(prompt[here:])
            cache.close()
        # each scope reuses its own shared blocks only, on both sides (here: a window's blocks limit it; prefill side)
        assert reused == [(False, 0), (False, 0), (True, 160), (True, 160), (False, 0)]
        receiver.close()
        manager.check_invariants()
        manager.shutdown()
        assert side.wait_exit() == 0


def test_sources_from_a_cache_of_another_scope_are_refused() -> None:
    """The prefill engine hands ``send_sources`` a cache of another reuse scope (here the request's prompt computed
    under a LoRA). Before: its KV went out as the request's."""
    require_nixl()
    with child_side(decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        manager, engine, sender = prefill_side.manager, prefill_side.engine, prefill_side.sender
        request = sender.next_request()
        assert request is not None and request.reuse_scope == ReuseScope()
        other = manager.create_kv_cache(ReuseScope(lora_id=3), request.tokens)
        assert other.resume() and other.resize(len(request.tokens), 0)
        engine.step(other, request.tokens)
        with pytest.raises(ValueError, match=r"is of ReuseScope\(lora_id=3, salt=None\), request 0 of ReuseScope\(lora_id=None"):
            sender.send_sources(request, other)
        assert not other.held_for
        other.close()
        cache = prefill(manager, engine, request)
        sender.send_sources(request, cache)
        assert sender.wait_released(request, timeout_s=30)
        cache.close()
        assert sender.next_request() is None
        assert side.wait_exit() == 0  # the decode side read every page as written
        prefill_side.close()


def prefill_side_of_format(connection: Connection, kv_format: KVFormat) -> None:
    """``fake_prefill_side``'s service, declaring ``kv_format``; exits 1 when the handshake raises."""
    prefill_side = PrefillSide(connection, kv_format=kv_format)
    request, cache = prefill_side.serve(commit=False, send=True)
    assert prefill_side.sender.wait_released(request)
    cache.close()
    assert prefill_side.sender.next_request() is None
    prefill_side.close()


DECODE_FORMAT = KVFormat("bfloat16", "llama-3.1-8b@main", "NHD 8x128", 1, 2)
DIFFERENCES = {
    "dtype": (KVFormat("float16", "llama-3.1-8b@main", "NHD 8x128", 1, 2), "KV dtype is float16 on the sender"),
    "model": (KVFormat("bf16", "llama-3.1-8b-tuned@main", "NHD 8x128", 1, 2), "model is llama-3.1-8b-tuned@main on the sender"),
    "page_layout": (KVFormat("bf16", "llama-3.1-8b@main", "NHD 16x64", 1, 2), "page layout is 'NHD 16x64' on the sender"),
    "tensor_parallel_rank": (KVFormat("bf16", "llama-3.1-8b@main", "NHD 8x128", 0, 2), "tensor-parallel rank is 0 on the sender"),
    # Rank 1 of 4 holds other heads than rank 1 of 2 when there are fewer KV heads than ranks.
    "tensor_parallel_size": (KVFormat("bf16", "llama-3.1-8b@main", "NHD 8x128", 1, 4), "tensor-parallel size is 4 on the sender"),
}


@pytest.mark.parametrize("what", list(DIFFERENCES))
def test_a_kv_format_that_differs_fails_the_handshake_on_both_sides(what: str) -> None:
    """Pages of the same size the other side would read as other values. Before: nothing but sizes was compared
    (fp16 pages went into bf16 caches): the handshake passed and the handoff ran."""
    require_nixl()
    prefill_format, message = DIFFERENCES[what]
    with child_side(prefill_side_of_format, prefill_format) as side:
        manager = KVCacheManager(hybrid_config(8))
        expected = getattr(DECODE_FORMAT, what)
        shown = repr(expected) if what == "page_layout" else expected
        with pytest.raises(ValueError, match=f"^layouts differ: {message}, {shown} on the receiver$"):
            KVReceiver(manager, side.connection, timeout_s=30, kv_format=DECODE_FORMAT)
        assert side.wait_exit() == 1  # the prefill side compared the formats too and raised
        manager.check_invariants()
        manager.shutdown()


def test_spellings_of_one_dtype_agree() -> None:
    """``bf16`` on one side, ``torch.bfloat16`` on the other: one dtype, the handoff runs and arrives intact."""
    require_nixl()
    with child_side(prefill_side_of_format, KVFormat("bf16", "llama-3.1-8b@main", "NHD 8x128", 1, 2)) as side:
        decode = DecodeSide(side.connection, kv_format=KVFormat("torch.bfloat16", "llama-3.1-8b@main", "NHD 8x128", 1, 2))
        cache, counts = decode.open(PROMPT)
        decode.receiver.receive(cache, PROMPT, counts)
        decode.engine.check(cache, PROMPT)
        cache.close()
        decode.close()
        assert side.wait_exit() == 0


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (("", "m"), ValueError, "KVFormat.dtype must name the KV element type"),
        (("bf16", " "), ValueError, "KVFormat.model must name the model's weights"),
        (("bf16", "m", "", -1), ValueError, r"KVFormat.tensor_parallel_rank must be in \[0, tensor_parallel_size\)"),
        (("bf16", "m", "", 1), ValueError, r"= \[0, 1\), got 1: give the group's size as tensor_parallel_size"),
        (("bf16", "m", "", 0, 0), ValueError, "KVFormat.tensor_parallel_size must be >= 1, got 0"),
        (("bf16", "m", "", 0, True), TypeError, "KVFormat.tensor_parallel_size"),
        ((16, "m"), TypeError, "KVFormat.dtype"),
        (("bf16", "m", "", True), TypeError, "KVFormat.tensor_parallel_rank"),
    ],
)
def test_a_bad_kv_format_is_refused_naming_the_field(arguments: tuple[object, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        KVFormat(*arguments)  # type: ignore[arg-type]


def test_a_side_without_a_kv_format_is_refused_before_anything() -> None:
    """No default: an engine that does not say what its pages hold could not be checked. The refusal comes before
    either side says anything on the connection (no peer process: a child's handshake would race the close)."""
    require_nixl()
    ours, peers = multiprocessing.Pipe()
    manager = KVCacheManager(hybrid_config(8))
    try:
        for side in (KVReceiver, KVSender):
            # compiled: mypyc checks the declared KVFormat itself, naming the type (tests/test_bad_inputs.py)
            with pytest.raises(TypeError, match="kv_format must be a KVFormat|KVFormat object expected; got str"):
                side(manager, ours, kv_format="bf16")  # type: ignore[arg-type]
        assert not peers.poll(0.1)
        manager.check_invariants()
    finally:
        manager.shutdown()
        ours.close()
        peers.close()


@pytest.mark.parametrize(
    ("cap", "error", "message"),
    [
        (0, ValueError, r"max_read_timeout_s must be in \(0, "),
        (float("inf"), ValueError, r"max_read_timeout_s must be in \(0, "),
        (True, TypeError, "max_read_timeout_s must be a number, got bool"),
    ],
)
def test_a_sender_with_a_bad_read_deadline_cap_is_refused_before_anything(
    cap: object, error: type[Exception], message: str
) -> None:
    """The cap on a request's READ deadline is checked as every timeout is, before the handshake."""
    require_nixl()
    ours, peers = multiprocessing.Pipe()
    manager = KVCacheManager(hybrid_config(8))
    try:
        with pytest.raises(error, match=message):
            KVSender(manager, ours, kv_format=FAKE_FORMAT, max_read_timeout_s=cap)  # type: ignore[arg-type]
        assert not peers.poll(0.1)
    finally:
        manager.shutdown()
        ours.close()
        peers.close()
