"""The KV event package's exported values pickle and copy in both modes (SPEC §11: "value types (events, ...)
pickle and copy in both modes"), like the package's own (``tests/test_value_types.py``, whose round trips this
reuses): a router process receives ``EventBatch``es and a subscriber's ``Gap``/``Restart`` records and may ship
them on. Compiled, a frozen dataclass that is not a ``FrozenValue`` raised ``FrozenInstanceError`` on unpickling
or copying (``tools/mode_parity.py`` found it: a batch pickled in either mode could not be loaded compiled)."""

from __future__ import annotations

import inspect

from tests.events_helpers import require_events_extra

require_events_extra()

from kv_cache_manager_v2 import kv_events  # noqa: E402
from kv_cache_manager_v2.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Gap,
    LayerGroupSpec,
    ReceivedBatch,
    Restart,
    WireBlock,
    WireFormatError,
)
from tests.test_value_types import assert_round_trips, with_parts  # noqa: E402

NOT_VALUES: dict[str, str] = {
    "EventSubscriber": "owns ZMQ sockets",
    "EventTranslator": "the running state of one manager's event stream",
    "KVEventsPublisher": "owns a publisher thread and a manager's event cursor",
    "PrefixIndex": "a router's mutable index, rebuilt from the stream",
    "ZmqEventPublisher": "owns ZMQ sockets and a thread",
}


def examples() -> list[object]:
    stored = BlockStored((1, b"\x02" * 8), None, (1, 2, 3, 4), 2, 3, "GPU", "lora", (None, ("mm", 0)), 1, "sliding_window", 64)
    batch = EventBatch(1.5, (stored, BlockRemoved((5,), "CPU", 0), AllBlocksCleared()), 2)
    return [
        batch,
        ReceivedBatch(7, batch, replayed=True),
        Gap(3, 9, 2),
        Restart(12, 0),
        LayerGroupSpec(1, "sliding_window", 512),
        WireBlock((1, 2), ("mm", 0)),
        WireFormatError("not a batch"),
    ]


def test_every_event_value_pickles_and_copies() -> None:
    for value in with_parts(examples()):
        assert_round_trips(value)


def test_every_exported_event_class_is_a_value_with_an_example_or_says_why_not() -> None:
    covered = {type(value) for value in with_parts(examples())}
    exported = {
        name: value for name in kv_events.__all__ if inspect.isclass(value := getattr(kv_events, name))
        and str(value.__module__).startswith("kv_cache_manager_v2")
    }
    missing = [name for name, cls in exported.items() if name not in NOT_VALUES and cls not in covered]
    assert missing == [], f"give these exported classes an example in tests/test_kv_events_values.py: {missing}"
    assert [name for name in NOT_VALUES if name not in exported] == []
