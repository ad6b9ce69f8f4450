"""The decode side's record of requests still to read (``_handoff/open_requests.py``), without NIXL."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2._handoff.control_messages import Failed, TransferError
from kv_cache_manager_v2._handoff.open_requests import OpenRequests


def test_closing_forgets_the_requests_given_up() -> None:
    # A given-up id stays recorded until its answer comes; a dead sender never answers, so only forgetting
    # everything at close bounds the record. After it, an answer to that id is no longer one of ours.
    open_requests = OpenRequests()
    open_requests.give_up(7)
    assert open_requests.forget_all() == []
    with pytest.raises(TransferError, match="unexpected control message"):
        open_requests.keep_answer(Failed(7, "late"), None)


def test_an_answer_to_a_request_given_up_is_dropped_once() -> None:
    open_requests = OpenRequests()
    open_requests.give_up(7)
    assert open_requests.keep_answer(Failed(7, "late"), None) is None
    with pytest.raises(TransferError, match="unexpected control message"):
        open_requests.keep_answer(Failed(7, "again"), None)
