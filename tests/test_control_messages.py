"""The handoff's control messages as bytes (no NIXL needed): every kind survives the round trip, and anything that
is not exactly one of them (not JSON, a pickle, a field missing, too many, of the wrong type or out of range) is a
``TransferError`` naming what is wrong, without running anything the bytes name."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
from multiprocessing import Pipe
from pathlib import Path

import pytest

from kv_cache_manager_v2._handoff.control_messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    Bye,
    ControlMessage,
    Failed,
    Hello,
    Request,
    Sources,
    check_extra,
    decode,
    receive_bytes,
    send,
)
from kv_cache_manager_v2._handoff.transfer import GroupTransfer, KVSlice, SourceBlock, SourcePlan
from kv_cache_manager_v2._base.types import HalfOpenRange
from kv_cache_manager_v2 import ReuseScope
from kv_cache_manager_v2.disagg import TransferError

PLAN = SourcePlan(
    KVSlice(100, HalfOpenRange(32, 100)),
    32,
    (GroupTransfer(0, "ssm", 0, 0, 0, 0, 1, 4096), GroupTransfer(1, "attention", 32, 1, 1, 4, 3, 3 * 2048)),
    (SourceBlock(0, -1, 0, 0, 5, 4096, 2**64 - 4096), SourceBlock(1, 1, 1, 0, 7, 2048, 123_456)),
    bytes(range(256))[::8],  # every byte value class crosses (base64)
)
MESSAGES: list[ControlMessage] = [
    Hello(b"\x00agent\xff", (("tokens_per_block", "32"), ("layer groups", "[[0], [1]]")), "VRAM", 3, (((2**64 - 8192, 8192),), ((0, 4096), (4096, 4096)))),
    Request(7, [0, 5, 2**63 - 1], [0, 3], ReuseScope(), 60.0),
    Request(8, [1], [0], ReuseScope(lora_id=0, salt=b"\x00tenant\xff"), 0.25),  # lora 0 is not None; bytes stay bytes
    Request(9, [1], [0], ReuseScope(lora_id=-3, salt="1"), 60.0),  # a str salt is not the int 1
    Request(10, [1], [0], ReuseScope(lora_id=2**70, salt=1), 60.0),
    # Every token the manager takes crosses (unsigned 64-bit ids upstream, negative and wider ones here): the
    # sender once refused tokens >= 2**63, failing a request the decode side had already prepared.
    Request(11, [2**63, 2**64 - 1, -1, 2**70], [0], ReuseScope(), 60.0),
    Sources(7, PLAN, {"first_token": 42, "note": ["a", 1.5, None, True]}),
    Failed(7, "no room"),
    Abort(7, "gave up"),
    Bye(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_survives_the_connection(message: ControlMessage) -> None:
    ours, theirs = Pipe()
    send(ours, message)
    assert decode(theirs.recv_bytes()) == message
    ours.close()
    with pytest.raises(TransferError, match="cannot send 'bye': the peer closed the control connection"):
        send(ours, Bye())


def request_with_scope(scope: object) -> bytes:
    return json.dumps({"kind": "request", "id": 0, "tokens": [1], "counts": [0], "read_timeout_s": 60, "scope": scope}).encode()


def request_with_timeout(read_timeout_s: object) -> bytes:
    fields = {"kind": "request", "id": 0, "tokens": [1], "counts": [0], "read_timeout_s": read_timeout_s,
              "scope": {"lora_id": None, "salt": None}}
    return json.dumps(fields).encode()


def good_sources() -> dict[str, object]:
    fields = json.loads(json.dumps({"kind": "sources", "id": 1, "extra": None, "plan": {
        "prompt_len": 100, "token_range": [0, 100], "tokens_per_block": 32,
        "groups": [{"layer_group": 0, "kind": "attention", "cached_tokens": 0, "src_start_block": 0,
                    "dst_start_block": 0, "end_block": 4, "num_blocks": 1, "num_bytes": 64}],
        "sources": {"layer_group": [0], "block": [3], "pool_group": [0], "pool": [0], "src_slot": [2],
                    "num_bytes": [64], "src_address": [4096]},
        "prompt_key": "AAEC",
    }}))
    assert isinstance(fields, dict)
    return fields


def spoiled(path: str, value: object) -> bytes:
    """``good_sources`` with the field at the dot-separated ``path`` replaced (removed for ``KeyError``)."""
    root = good_sources()
    fields: object = root
    *parents, last = path.split(".")
    for name in parents:
        assert isinstance(fields, dict)
        fields = fields[name]
    assert isinstance(fields, dict)
    if value is KeyError:
        del fields[last]
    else:
        fields[last] = value
    return json.dumps(root).encode()


def test_the_good_sources_decode() -> None:
    message = decode(json.dumps(good_sources()).encode())
    assert isinstance(message, Sources) and message.plan.sources[0] == SourceBlock(0, 3, 0, 0, 2, 64, 4096)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\x80\x05\x95garbage", "not JSON"),
        (pickle.dumps(("request", 0, [1, 2], [0])), "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b'{"kind": "request", "id": ' + b"9" * 5000 + b', "tokens": [], "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', "not JSON"),
        (b'"hello"', "control message must be a JSON object"),
        (b'{"kind": "teleport"}', "unknown kind 'teleport'"),
        (b'{"kind": "bye", "also": 1}', r"bye must have exactly the fields \['kind'\]"),
        (b'{"kind": "request", "id": true, "tokens": [], "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', "request.id must be an integer, got True"),
        (b'{"kind": "request", "id": -1, "tokens": [], "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', r"request.id = -1 is outside \[0, "),
        (b'{"kind": "request", "id": 0, "tokens": [1, 2], "counts": [3], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', r"request.counts\[\] = 3 is outside \[0, 2\]"),
        (b'{"kind": "request", "id": 0, "tokens": [1.5], "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', r"request.tokens\[\] must be an integer"),
        (b'{"kind": "request", "id": 0, "tokens": {}, "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": null}}', "request.tokens must be a JSON array"),
        (b'{"kind": "abort", "id": 0, "reason": 5}', "abort.reason must be a string"),
        (b'{"kind": "hello", "metadata": "!!", "layout": [], "mem_type": "DRAM", "device": 0, "pools": []}', "hello.metadata must be base64"),
        (b'{"kind": "hello", "metadata": "", "layout": [], "mem_type": "HBM", "device": 0, "pools": []}', "hello.mem_type must be one of"),
        (b'{"kind": "hello", "metadata": "", "layout": [["a"]], "mem_type": "DRAM", "device": 0, "pools": []}', r"hello.layout\[\] must have 2 items"),
        (b'{"kind": "hello", "metadata": "", "layout": [], "mem_type": "DRAM", "device": 0, "pools": [[[-1, 8]]]}', r"hello.pools\[\]\[\]\[0\] = -1 is outside"),
        (spoiled("plan.sources.src_slot", [-1]), r"sources.plan.sources.src_slot\[\] = -1 is outside"),
        (spoiled("plan.sources.block", [-2]), r"sources.plan.sources.block\[\] = -2 is outside \[-1, "),
        (spoiled("plan.sources.src_address", [2**64]), r"sources.plan.sources.src_address\[\] = 18446744073709551616"),
        (spoiled("plan.sources.num_bytes", [0]), r"sources.plan.sources.num_bytes\[\] = 0 is outside \[1, "),
        (spoiled("plan.sources.pool", [0, 1]), r"columns of different lengths \[1, 1, 1, 2, 1, 1, 1\]"),
        (spoiled("plan.sources.pool", KeyError), "sources.plan.sources must have exactly the fields"),
        (spoiled("plan.token_range", [50, 10]), r"sources.plan.token_range\[1\] = 10 is outside \[50, 100\]"),
        (spoiled("plan.tokens_per_block", 0), r"sources.plan.tokens_per_block = 0 is outside \[1, "),
        (spoiled("plan.groups", [{"layer_group": 0}]), r"sources.plan.groups\[\] must have exactly the fields"),
        (spoiled("plan", None), "sources.plan must be a JSON object, got None"),
        (spoiled("plan.prompt_key", "!!"), "sources.plan.prompt_key must be base64"),
        (spoiled("plan.prompt_key", KeyError), r"sources.plan must have exactly the fields \[.*'prompt_key'"),
        (spoiled("id", "1"), "sources.id must be an integer, got '1'"),
        # JSON has no NaN or Infinity: json.loads took them and handed a NaN to the caller as ``extra``.
        (spoiled("extra", float("nan")), "NaN is not JSON"),
        (spoiled("extra", [float("-inf")]), "-Infinity is not JSON"),
        # A peer's 4,000-digit id was quoted whole in the error; now cut to 80 characters.
        (b'{"kind": "abort", "id": %s, "reason": ""}' % (b"9" * 4000), r"abort.id = 9{77}\.\.\. is outside"),
        # The receiver's READ deadline: the sender holds the pages at least that long (wait_released).
        (request_with_timeout(0), r"request.read_timeout_s = 0 is outside \(0, "),
        (request_with_timeout(-1.5), r"request.read_timeout_s = -1.5 is outside \(0, "),
        (request_with_timeout(10**400), r"request.read_timeout_s = 1000.* is outside \(0, "),
        (request_with_timeout(True), "request.read_timeout_s must be a number of seconds, got True"),
        (request_with_timeout("60"), "request.read_timeout_s must be a number of seconds, got '60'"),
        (request_with_scope({"lora_id": None}), r"request.scope must have exactly the fields \['lora_id', 'salt'\]"),
        (request_with_scope({"lora_id": "1", "salt": None}), "request.scope.lora_id must be null or an integer, got '1'"),
        (request_with_scope({"lora_id": True, "salt": None}), "request.scope.lora_id must be null or an integer, got True"),
        (request_with_scope({"lora_id": None, "salt": 1.5}), "request.scope.salt must be null, an integer, a string or"),
        (request_with_scope({"lora_id": None, "salt": {"bytes": "!!"}}), "request.scope.salt.bytes must be base64"),
        (request_with_scope({"lora_id": None, "salt": {"str": "a"}}), r"request.scope.salt must have exactly the fields"),
        (b'{"kind": "request", "id": 0, "tokens": [], "counts": [], "read_timeout_s": 60, "scope": {"lora_id": null, "salt": "\\ud800"}}',
         "request.scope: ReuseScope.salt must be encodable as UTF-8"),
    ],
)
def test_anything_else_is_a_transfer_error_naming_what_is_wrong(data: bytes, error: str) -> None:
    with pytest.raises(TransferError, match=error):
        decode(data)


def test_a_pickle_that_would_run_code_is_never_unpickled(tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")  # pytest's directory: mkdtemp left one behind per run
    payload = b"cos\nmkdir\n(" + pickle.dumps(marker, protocol=0)[:-1] + b"tR."
    with pytest.raises(TransferError, match="not JSON"):
        decode(payload)
    assert not os.path.exists(marker)


def test_extra_must_be_json_data() -> None:
    check_extra({"token": 1, "scores": [0.5, None]})
    for bad in (b"bytes", {(1, 2): "tuple key"}, float("nan"), object()):
        with pytest.raises(TypeError, match="extra must be JSON data"):
            check_extra(bad)


def test_a_length_header_past_the_bound_is_refused_before_anything_is_allocated() -> None:
    """12 bytes naming a 2**62-byte message made ``recv_bytes()`` raise MemoryError on the receiving side."""
    reading, writing = Pipe()
    with reading, writing:
        with socket.socket(fileno=os.dup(writing.fileno())) as raw:  # the header by hand: send_bytes would send it all
            raw.sendall(struct.pack("!i", -1) + struct.pack("!Q", 2**62))
        with pytest.raises(TransferError, match=f"longer than {MAX_MESSAGE_BYTES} bytes"):
            receive_bytes(reading)


def test_messages_up_to_the_bound_are_read_and_a_closed_peer_is_eof() -> None:
    reading, writing = Pipe()
    with reading:
        send(writing, Bye())
        assert decode(receive_bytes(reading)) == Bye()
        writing.close()
        with pytest.raises(EOFError):
            receive_bytes(reading)
