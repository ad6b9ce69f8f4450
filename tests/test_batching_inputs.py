"""The continuous batcher refuses bad requests when it is built, before any step: a request id used twice, a
``follows`` naming no earlier request (itself, a later one, an unknown id), requests out of arrival order, negative
or non-integer lengths and steps. Each used to surface half way through a step (``create_kv_cache``'s duplicate-id
error after other requests of the step were already admitted and resized), as a wrong length deep in the manager,
or never: a request waiting on one that never finishes ended the run with "no request is running, suspended or
admissible", and one arriving early behind a later arrival waited for it."""

from __future__ import annotations

from typing import Callable

import pytest

from kv_cache_manager_v2.batching import BatchingOptions, ContinuousBatcher
from tests.test_batching import Checked, Replayed, manager_with, run_to_end

TOKENS = list(range(40))


def replayed(request_id: object, **fields: object) -> Replayed:
    request = Replayed(0, TOKENS, 30)
    request.request_id = request_id  # type: ignore[assignment]
    for name, value in fields.items():
        setattr(request, name, value)
    return request


BAD_REQUESTS: list[tuple[str, Callable[[], list[Replayed]], type[Exception], str]] = [
    ("duplicate id", lambda: [replayed(1), replayed(1)], ValueError, r"requests\[1\]\.request_id 1 .*requests\[0\]"),
    ("bool id", lambda: [replayed(True)], TypeError, r"requests\[0\]\.request_id"),
    ("float id", lambda: [replayed(2.5)], TypeError, r"requests\[0\]\.request_id"),
    ("follows an unknown id", lambda: [replayed(1, follows=5)], ValueError, r"requests\[0\]\.follows 5"),
    ("follows itself", lambda: [replayed(1, follows=1)], ValueError, r"requests\[0\]\.follows 1"),
    ("follows a later request", lambda: [replayed(1, follows=2), replayed(2)], ValueError, r"requests\[0\]\.follows 2"),
    ("follows a str", lambda: [replayed(1), replayed(2, follows="1")], TypeError, r"requests\[1\]\.follows"),
    ("negative prompt length", lambda: [replayed(1, prompt_length=-5)], ValueError, r"requests\[0\]\.prompt_length"),
    ("negative max_length", lambda: [replayed(1, max_length=-1)], ValueError, r"requests\[0\]\.max_length"),
    ("negative arrival", lambda: [replayed(1, arrival_step=-3)], ValueError, r"requests\[0\]\.arrival_step"),
    (
        "out of arrival order",
        lambda: [replayed(1, arrival_step=5), replayed(2, arrival_step=1)],
        ValueError,
        r"requests\[1\]\.arrival_step 1 .* requests\[0\]'s 5",
    ),
    ("not a request", lambda: [replayed(1), object()], TypeError, r"requests\[1\]"),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("name", "requests", "error", "match"), BAD_REQUESTS, ids=[row[0] for row in BAD_REQUESTS])
def test_a_bad_request_is_refused_before_any_step(
    name: str, requests: Callable[[], list[Replayed]], error: type[Exception], match: str
) -> None:
    manager = manager_with(64)
    with pytest.raises(error, match=match):
        ContinuousBatcher(manager, requests(), Checked(manager), BatchingOptions(chunk=16))
    assert manager.num_live_caches == 0
    manager.shutdown()


def test_numpy_ids_and_a_follow_up_of_an_earlier_request_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    manager = manager_with(64)
    first, second = replayed(np.int64(1)), replayed(2, follows=np.int32(1), arrival_step=np.int64(2))
    batcher = ContinuousBatcher(manager, [first, second], Checked(manager), BatchingOptions(chunk=16))
    run_to_end(batcher)
    assert batcher.finished_ids == {1, 2} and batcher.rejected == 0
    manager.shutdown()
