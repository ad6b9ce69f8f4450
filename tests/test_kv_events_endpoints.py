"""Endpoint strings as vLLM's publishers read them: which ones bind, the per-rank offset, and a tcp port past the
last refused before any socket exists (ZeroMQ would take it modulo 2**16)."""

from __future__ import annotations

import re

import pytest

from tests.events_helpers import TCP_ANY_PORT, require_events_extra

require_events_extra()

from kv_cache_manager_v2.kv_events.publisher import (  # noqa: E402
    ZmqEventPublisher, binds, check_tcp_port, offset_endpoint,
)


def test_vllm_endpoint_conventions() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("inproc://x") and not binds("tcp://host:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(TCP_ANY_PORT, buffer_steps=0)


@pytest.mark.parametrize("name", ["endpoint", "replay_endpoint"])
@pytest.mark.parametrize("endpoint", ["tcp://*:99999", "tcp://127.0.0.1:65536", "tcp://*:%s" % ("9" * 5000)])
def test_a_tcp_port_past_the_last_is_refused_naming_the_endpoint(name: str, endpoint: str) -> None:
    """ZeroMQ took the port modulo 2**16: ``tcp://*:99999`` was bound as port 34463, ``endpoint`` said so."""
    settings = {"endpoint": TCP_ANY_PORT, "replay_endpoint": TCP_ANY_PORT, name: endpoint}
    with pytest.raises(ValueError, match=f"^{name} {re.escape(endpoint)}: port [0-9]+ is past the last TCP port 65535$"):
        ZmqEventPublisher(str(settings["endpoint"]), settings["replay_endpoint"])
    assert check_tcp_port("tcp://*:065535", name) == "tcp://*:065535"  # the last port, however written
