"""NumPy numbers are accepted wherever the config takes floats, the same in both modes (SPEC §11; issue #35
item 15): ``initial_pool_ratio`` was refused interpreted (``np.int64``, ``np.float32`` are not ``int``/``float``)
and accepted unchecked compiled (a ``float`` loop variable converted every item, ``True`` included).

Decided: any 1-D iterable of numbers is a ratio, a NumPy array too (it is what a caller computing weights has);
a scalar, a string or a 2-D array is a ``TypeError`` naming the field. Bools are refused as everywhere.
"""

from __future__ import annotations

import io
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from kv_cache_manager_v2 import KVCacheEventManager, KVCacheManager, MooncakeStoreConfig, RemoteCacheTierConfig
from kv_cache_manager_v2.kv_events import EventSubscriber, KVEventsPublisher, ZmqEventPublisher
from kv_cache_manager_v2.kv_events.listen import listen
from tests.helpers import MIB, attention, gemma_like_layers, make_config


def split_of(ratio: object) -> list[int]:
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=64 * MIB, initial_pool_ratio=ratio))
    return [stats.total for stats in manager.get_storage_statistics(0)]


@pytest.mark.parametrize(
    "ratio",
    [np.array([1, 3]), np.array([1.0, 3.0], dtype=np.float32), [np.int64(1), np.float32(3)], (1, np.float64(3))],
    ids=["int-array", "float32-array", "numpy-scalars", "tuple"],
)
def test_initial_pool_ratio_takes_numpy_numbers(ratio: object) -> None:
    config = make_config(gemma_like_layers(), initial_pool_ratio=ratio)
    assert config.initial_pool_ratio == (1.0, 3.0)
    assert all(type(weight) is float for weight in config.initial_pool_ratio)
    assert split_of(ratio) == split_of([1.0, 3.0])


@pytest.mark.parametrize(
    ("ratio", "error", "message"),
    [
        ([True, 1.0], TypeError, r"initial_pool_ratio\[0\] must be a number, got bool"),
        ([1.0, np.bool_(True)], TypeError, r"initial_pool_ratio\[1\] must be a number"),
        (np.array([[1.0, 2.0]]), TypeError, "initial_pool_ratio must be a sequence of floats"),
        (np.int64(3), TypeError, "initial_pool_ratio must be a sequence of floats"),
        ("12", TypeError, "initial_pool_ratio must be a sequence of floats"),
        ([1.0, "2"], TypeError, r"initial_pool_ratio\[1\] must be a number"),
        ([1.0, np.float32("nan")], ValueError, r"initial_pool_ratio\[1\] must be a finite number"),
        ([1.0, 10**400], ValueError, r"initial_pool_ratio\[1\] must be a finite number"),
        (np.array([1.0, -2.0]), ValueError, "initial_pool_ratio values must be positive"),
    ],
)
def test_initial_pool_ratio_refuses_what_is_not_positive_numbers(ratio: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make_config(gemma_like_layers(), initial_pool_ratio=ratio)


def test_float_fields_take_numpy_numbers_and_refuse_bools() -> None:
    config = make_config(gemma_like_layers(), max_util_for_resume=np.float32(0.5))
    assert config.max_util_for_resume == 0.5 and type(config.max_util_for_resume) is float
    assert make_config(gemma_like_layers(), max_util_for_resume=np.int64(1)).max_util_for_resume == 1.0
    with pytest.raises(TypeError, match="max_util_for_resume must be a number, got bool"):
        make_config(gemma_like_layers(), max_util_for_resume=True)
    backend = MooncakeStoreConfig("master:50051", "http://meta:8080/metadata")
    remote = RemoteCacheTierConfig(0, backend, "m", retry_after_s=np.float32(2.5))  # type: ignore[arg-type]
    assert remote.retry_after_s == 2.5 and type(remote.retry_after_s) is float
    with pytest.raises(TypeError, match="retry_after_s must be a number, got bool"):
        RemoteCacheTierConfig(0, backend, "m", retry_after_s=True)
    with pytest.raises(ValueError, match="retry_after_s must be a finite float >= 0"):
        RemoteCacheTierConfig(0, backend, "m", retry_after_s=np.float64(-1))


def test_event_timeouts_and_stamps_take_numpy_numbers_and_refuse_bools() -> None:
    """Compiled, these were typed ``float``: mypyc refused ``numpy.float32`` ("float or None object expected; got
    numpy.float32") where the interpreted mode took it, and a publish stamped ``True`` was sent as it was."""
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(TypeError, match="ts must be a number, got bool"):
            publisher.publish([], True)
        with pytest.raises(TypeError, match="timeout_s must be a number, got bool"):
            publisher.wait_sent(True)
        assert publisher.next_seq == 0  # the refused batch took no sequence number
        assert publisher.publish([], np.float32(1.5)) == 0 and publisher.wait_sent(np.float32(5.0))
    finally:
        publisher.close()
    manager = KVCacheManager(make_config([attention(0)], enable_kv_events=True))
    events = KVEventsPublisher(manager, "tcp://127.0.0.1:*")
    try:
        assert events.wait_sent(np.float64(1.0)) and events.wait_sent(np.float32(1.0))
    finally:
        events.shutdown()
        manager.shutdown()
    subscriber = EventSubscriber("tcp://127.0.0.1:5999")  # connects: nothing needs to listen there
    try:
        assert listen(subscriber, 1, np.float32(0.0), io.StringIO()) == 0
        with pytest.raises(TypeError, match="timeout_s must be a number, got bool"):
            listen(subscriber, 1, True, io.StringIO())
    finally:
        subscriber.close()


def test_every_supports_float_that_is_a_finite_float_is_taken_in_both_modes() -> None:
    """A ``SupportsFloat`` parameter takes what mypy lets through: ``Fraction`` and ``Decimal`` were a
    ``TypeError`` ("ts must be a number, got Decimal") at run time. Complex numbers, arrays and bools stay refused,
    a value beyond a float is a ``ValueError`` naming the argument."""
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*")
    try:
        assert publisher.publish([], Decimal("1.5")) == 0 and publisher.publish([], Fraction(7, 2)) == 1
        assert publisher.wait_sent(Decimal("5")) and publisher.wait_sent(Fraction(5, 1))
        for refused in (1j, np.complex64(1), np.array(1.5), "1.5", np.True_):
            with pytest.raises(TypeError, match="ts must be a number, got"):
                publisher.publish([], refused)  # type: ignore[arg-type]
        for beyond in (Decimal("NaN"), Decimal("sNaN"), Decimal("1e400"), Fraction(10**400)):
            with pytest.raises(ValueError, match="ts must be a finite number"):
                publisher.publish([], beyond)
        assert publisher.next_seq == 2  # the refused batches took no sequence number
    finally:
        publisher.close()
    events = KVCacheEventManager(16)
    assert events.get_latest_events(Decimal("0.5")) == [] and events.get_latest_events(Fraction(1, 2)) == []
    with pytest.raises(ValueError, match="timeout_ms must be a number of milliseconds"):
        events.get_latest_events(Decimal("sNaN"))
    with pytest.raises(TypeError, match="timeout_ms must be a number of milliseconds"):
        events.get_latest_events(1j)  # type: ignore[arg-type]
