"""``KVCacheEventManager`` (TensorRT-LLM's event manager) refuses bad configuration with an error naming the
argument, and changes nothing when it does: a window-size or kind mapping that is not a mapping raised
``AttributeError`` ('int' object has no attribute 'items'); negative window sizes and ranks, and a
``window_size_by_layer_group`` the setter would refuse, were taken and stamped on every event."""

from __future__ import annotations

import re
from typing import Callable

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import KVCacheEventManager

BAD: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("window sizes not a mapping", lambda: KVCacheEventManager(8).set_layer_group_window_sizes("x"), TypeError, "window_sizes"),  # type: ignore[arg-type]
    ("kinds not a mapping", lambda: KVCacheEventManager(8).set_layer_group_kinds(5), TypeError, "kinds"),  # type: ignore[arg-type]
    ("negative window size", lambda: KVCacheEventManager(8).set_layer_group_window_sizes({0: -3}), ValueError, r"window_sizes\[0\]"),
    ("negative layer group", lambda: KVCacheEventManager(8).set_layer_group_window_sizes({-1: 3}), ValueError, "window_sizes"),
    ("constructor: negative window", lambda: KVCacheEventManager(8, window_size=-1), ValueError, "window_size"),
    ("constructor: negative rank", lambda: KVCacheEventManager(8, attention_dp_rank=-1), ValueError, "attention_dp_rank"),
    ("constructor: hash_algo not a str", lambda: KVCacheEventManager(8, hash_algo=5), TypeError, "hash_algo"),  # type: ignore[arg-type]
    (
        "constructor: window by group, str key",
        lambda: KVCacheEventManager(8, window_size_by_layer_group={"a": 5}),  # type: ignore[dict-item]
        TypeError,
        "window_size_by_layer_group",
    ),
    (
        "constructor: window by group, negative",
        lambda: KVCacheEventManager(8, window_size_by_layer_group={0: -5}),
        ValueError,
        r"window_size_by_layer_group\[0\]",
    ),
    ("constructor: window by group not a mapping", lambda: KVCacheEventManager(8, window_size_by_layer_group=[1]), TypeError, "window_size_by_layer_group"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "call", "error", "match"), BAD, ids=[row[0] for row in BAD])
def test_bad_configuration_is_refused_naming_the_argument(
    name: str, call: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error) as raised:
        call()
    # Compiled, mypyc checks a parameter of a concrete type (``hash_algo: str``) itself; its TypeError names the
    # type ("str object expected; got int"), not the argument (tests/test_bad_inputs.py).
    by_mypyc = kv_cache_manager_v2.COMPILED and raised.type is TypeError and " expected; got " in str(raised.value)
    assert by_mypyc or re.search(match, str(raised.value)), (match, str(raised.value))


def test_a_refused_window_mapping_sets_none_of_its_entries() -> None:
    events = KVCacheEventManager(8)
    events.set_layer_group_window_sizes({0: 64})
    with pytest.raises(ValueError, match=r"window_sizes\[2\]"):
        events.set_layer_group_window_sizes({0: 32, 1: 16, 2: -1})
    events.add_created_event([4], [0, 1])
    events.flush_iteration_events()
    assert [event.window_size for event in events.get_latest_events(0)] == [64, 0]  # group 1: the default


def test_a_manager_of_another_model_on_a_fed_event_manager_is_refused() -> None:
    """Before: a second live manager whose layer group 0 is an SSM group restamped the shared event manager's group
    0 (the first manager's full attention) as ``ssm``, so the first manager's events reached routers mislabelled.
    Now its construction raises ``ValueError`` saying to give each model its own event manager; the same model is
    taken, and another model is once the first manager shut down."""
    from kv_cache_manager_v2 import KVCacheManager
    from tests.helpers import KIB, attention, make_config, ssm

    events = KVCacheEventManager(64)
    llama = make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=16)
    mamba = make_config([ssm(0, 512, 64)], gpu_quota=16 * KIB, tokens_per_block=16)
    first = KVCacheManager(llama, events)
    twin = KVCacheManager(llama, events)
    with pytest.raises(ValueError, match="layer group 0 is full_attention .*this one's is ssm .*own KVCacheEventManager"):
        KVCacheManager(mamba, events)
    cache = first.create_kv_cache(input_tokens=list(range(16)))
    assert cache.resume() and cache.resize(16)
    cache.commit(list(range(16)))
    cache.close()
    events.flush_iteration_events()
    kinds = {event.layer_group_kind for event in events.get_latest_events() if event.layer_group_id == 0}
    assert kinds == {"full_attention"}
    first.shutdown()
    twin.shutdown()
    KVCacheManager(mamba, events).shutdown()  # no live feeder left: the next model may stamp its groups
