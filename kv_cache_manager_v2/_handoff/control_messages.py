"""The handoff's control messages as bytes: one JSON object per message, every field named and checked.

JSON (the standard library's) rather than pickle: unpickling runs whatever code the bytes name, so a peer (or
anything that can write to the connection) could run code in this process. Here the bytes can only ever become
the six messages below; anything else (not JSON, another shape, a field of the wrong type or out of range, a
field too many or missing) is a ``TransferError``, on either side. Field names and ranges are listed in
``_nixl_transport``'s docstring, the protocol's one description.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Final, Union, final

from mypy_extensions import mypyc_attr

from .transfer import GroupTransfer, KVSlice, SourceBlock, SourcePlan
from .._base.hashing import ReuseScope
from .._base.types import FrozenValue, HalfOpenRange
from .._base.validation import as_bounded_float
from .._base.wording import counted

# Ids, counts, slots and byte sizes: non-negative and below 2**63; addresses: below 2**64; tokens: any integer.
MAX_INT: Final = 2**63 - 1
MAX_ADDRESS: Final = 2**64 - 1
MAX_DEVICE: Final = 2**31 - 1
# A request's ``read_timeout_s``: positive and finite, at most a year (a larger one is a mistake, not a wait).
MAX_READ_TIMEOUT_S: Final = 365 * 24 * 3600.0
MEM_TYPES: Final = ("DRAM", "VRAM")
# The longest control message read. A request of 2**24 tokens of 19 digits or the sources of as many blocks fit;
# a length header naming more is refused before anything is allocated (``recv_bytes()`` without a bound allocates
# whatever 8-byte length the peer names: 12 bytes made the receiving side raise MemoryError).
MAX_MESSAGE_BYTES: Final = 1 << 30
# ``sources``' per-block columns, in ``SourceBlock``'s field order, with each column's smallest value.
SOURCE_COLUMNS: Final = (
    ("layer_group", 0),
    ("block", -1),  # -1: an SSM live state
    ("pool_group", 0),
    ("pool", 0),
    ("src_slot", 0),
    ("num_bytes", 1),
    ("src_address", 0),
)
GROUP_FIELDS: Final = (
    "layer_group",
    "kind",
    "cached_tokens",
    "src_start_block",
    "dst_start_block",
    "end_block",
    "num_blocks",
    "num_bytes",
)


# Any JSON value (what ``extra`` may be). A module-level name: mypyc's dataclasses look field annotations up in the
# module's globals, where the builtin ``object`` is not.
JsonData = object


@mypyc_attr(native_class=False)
class TransferError(RuntimeError):
    """A cross-process handoff failed: peer gone, transfer in error state, timeout, the sender's error, or a
    control message that is not one of the protocol's."""


@final
@dataclass(frozen=True)
class Hello(FrozenValue):
    """``pools``: per pool group, per pool, the GPU tier's ``(address, nbytes)``: where the sender's sources may
    lie (``open_requests.check_source_addresses``)."""

    metadata: bytes
    layout: tuple[tuple[str, str], ...]
    mem_type: str
    device: int
    pools: tuple[tuple[tuple[int, int], ...], ...] = ()


@final
@dataclass(frozen=True)
class Request(FrozenValue):
    """A prompt, the receiving cache's per-group counts and its reuse scope: the counts come from a prefix match in
    that scope, and the sender must compute (and reuse) the prompt in the same one. ``read_timeout_s``: how long
    after sending it the receiver still READs (its deadline), which the sender must hold the pages at least for."""

    request_id: int
    tokens: list[int]
    counts: list[int]
    reuse_scope: ReuseScope
    read_timeout_s: float


@final
@dataclass(frozen=True)
class Sources(FrozenValue):
    request_id: int
    plan: SourcePlan
    extra: JsonData


@final
@dataclass(frozen=True)
class Failed(FrozenValue):
    """The sender could not serve the request (``"error"`` on the wire)."""

    request_id: int
    message: str


@final
@dataclass(frozen=True)
class Abort(FrozenValue):
    request_id: int
    reason: str


@final
@dataclass(frozen=True)
class Bye(FrozenValue):
    pass


ControlMessage = Union[Hello, Request, Sources, Failed, Abort, Bye]


# ---------------------------------------------------------------------------------------------------- sending


def check_extra(extra: object) -> None:
    """``extra`` must be JSON data (None, bool, int, float, str, lists, dicts with str keys): TypeError else."""
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise TypeError(f"extra must be JSON data (it crosses to the decode side as JSON): {error}") from error


def send(connection: Connection, message: ControlMessage) -> None:
    """Encode and send ``message``; ``TransferError`` when the peer closed the connection."""
    data = json.dumps(_fields(message), allow_nan=False, separators=(",", ":")).encode()
    try:
        connection.send_bytes(data)
    except (OSError, ValueError) as error:  # ValueError: our own end already closed
        raise TransferError(f"cannot send {_kind(message)!r}: the peer closed the control connection") from error


def _kind(message: ControlMessage) -> str:
    if isinstance(message, Hello):
        return "hello"
    if isinstance(message, Request):
        return "request"
    if isinstance(message, Sources):
        return "sources"
    if isinstance(message, Failed):
        return "error"
    if isinstance(message, Abort):
        return "abort"
    return "bye"


def _fields(message: ControlMessage) -> dict[str, object]:
    kind = _kind(message)
    if isinstance(message, Hello):
        return {
            "kind": kind,
            "metadata": base64.b64encode(message.metadata).decode(),
            "layout": [[what, value] for what, value in message.layout],
            "mem_type": message.mem_type,
            "device": message.device,
            "pools": [[[address, nbytes] for address, nbytes in group] for group in message.pools],
        }
    if isinstance(message, Request):
        return {
            "kind": kind,
            "id": message.request_id,
            "tokens": message.tokens,
            "counts": message.counts,
            "scope": _scope_fields(message.reuse_scope),
            "read_timeout_s": message.read_timeout_s,
        }
    if isinstance(message, Sources):
        return {"kind": kind, "id": message.request_id, "plan": _plan_fields(message.plan), "extra": message.extra}
    if isinstance(message, Failed):
        return {"kind": kind, "id": message.request_id, "message": message.message}
    if isinstance(message, Abort):
        return {"kind": kind, "id": message.request_id, "reason": message.reason}
    return {"kind": kind}


def _scope_fields(scope: ReuseScope) -> dict[str, object]:
    """A salt keeps its type across (1, "1" and b"1" are three scopes): an int or a str as itself, bytes as
    ``{"bytes": base64}``."""
    salt = scope.salt
    wire_salt: object = {"bytes": base64.b64encode(salt).decode()} if isinstance(salt, bytes) else salt
    return {"lora_id": scope.lora_id, "salt": wire_salt}


def _plan_fields(plan: SourcePlan) -> dict[str, object]:
    blocks = plan.sources
    return {
        "prompt_len": plan.kv_slice.prompt_len,
        "token_range": [plan.kv_slice.token_range.beg, plan.kv_slice.token_range.end],
        "tokens_per_block": plan.tokens_per_block,
        "groups": [{name: getattr(group, name) for name in GROUP_FIELDS} for group in plan.groups],
        "sources": {name: [getattr(block, name) for block in blocks] for name, _ in SOURCE_COLUMNS},
        "prompt_key": base64.b64encode(plan.prompt_key).decode(),
    }


# -------------------------------------------------------------------------------------------------- receiving


def receive_bytes(connection: Connection) -> bytes:
    """The next message's bytes, at most ``MAX_MESSAGE_BYTES``: what every reader of the control connection calls.
    ``EOFError`` / ``OSError`` as ``recv_bytes`` (the peer closed); ``TransferError`` for a longer length header
    (the connection stops reading then: the rest of that message is never consumed)."""
    try:
        return connection.recv_bytes(MAX_MESSAGE_BYTES)
    except OSError as error:
        if connection.closed or connection.readable:
            raise
        raise TransferError(f"a control message longer than {MAX_MESSAGE_BYTES} bytes") from error


def receive(connection: Connection, deadline: float, waiting_for: str) -> ControlMessage:
    """The next message by ``deadline`` (``time.monotonic``); ``TransferError`` when none came or the peer closed."""
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0 or not connection.poll(remaining):
            raise TransferError(f"no {waiting_for} from the peer in time")
        data = receive_bytes(connection)
    except (EOFError, OSError) as error:
        raise TransferError(f"the peer closed the control connection while we waited for {waiting_for}") from error
    return decode(data)


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """Seconds in ``(0, MAX_READ_TIMEOUT_S]`` (NumPy numbers accepted, bools refused, as every float argument):
    every timeout of the handoff, and a request's ``read_timeout_s``, which the sender waits for at least."""
    return as_bounded_float(
        timeout_s, name, f"(0, {MAX_READ_TIMEOUT_S:.0f}] seconds", lambda seconds: 0 < seconds <= MAX_READ_TIMEOUT_S
    )


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity; send() never writes them


def decode(data: bytes) -> ControlMessage:
    """The message ``data`` encodes; ``TransferError`` saying what is wrong for anything else."""
    try:
        fields = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, too deep, an int too long, NaN
        raise TransferError(f"a control message that is not JSON ({counted(len(data), 'byte')}): {error}") from error
    message = _object(fields, "control message", None)
    kind = message.get("kind")
    if kind == "hello":
        _keys(message, "hello", ("kind", "metadata", "layout", "mem_type", "device", "pools"))
        mem_type = _str(message["mem_type"], "hello.mem_type")
        if mem_type not in MEM_TYPES:
            raise TransferError(f"hello.mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        return Hello(
            _base64(message["metadata"], "hello.metadata"),
            tuple((_str(pair[0], "hello.layout[].what"), _str(pair[1], "hello.layout[].value"))
                  for pair in (_list(item, "hello.layout[]", 2) for item in _list(message["layout"], "hello.layout"))),
            mem_type,
            _int(message["device"], "hello.device", 0, MAX_DEVICE),
            tuple(
                tuple((_int(pair[0], "hello.pools[][][0]", 0, MAX_ADDRESS), _int(pair[1], "hello.pools[][][1]", 0, MAX_ADDRESS))
                      for pair in (_list(item, "hello.pools[][]", 2) for item in _list(group, "hello.pools[]")))
                for group in _list(message["pools"], "hello.pools")
            ),
        )
    if kind == "request":
        _keys(message, "request", ("kind", "id", "tokens", "counts", "scope", "read_timeout_s"))
        tokens = [_token(token) for token in _list(message["tokens"], "request.tokens")]
        counts = [_int(count, "request.counts[]", 0, len(tokens)) for count in _list(message["counts"], "request.counts")]
        return Request(
            _int(message["id"], "request.id", 0, MAX_INT), tokens, counts, _scope(message["scope"]),
            _seconds(message["read_timeout_s"], "request.read_timeout_s"),
        )
    if kind == "sources":
        _keys(message, "sources", ("kind", "id", "plan", "extra"))
        return Sources(_int(message["id"], "sources.id", 0, MAX_INT), _plan(message["plan"]), message["extra"])
    if kind == "error":
        _keys(message, "error", ("kind", "id", "message"))
        return Failed(_int(message["id"], "error.id", 0, MAX_INT), _str(message["message"], "error.message"))
    if kind == "abort":
        _keys(message, "abort", ("kind", "id", "reason"))
        return Abort(_int(message["id"], "abort.id", 0, MAX_INT), _str(message["reason"], "abort.reason"))
    if kind == "bye":
        _keys(message, "bye", ("kind",))
        return Bye()
    raise TransferError(f"a control message of unknown kind {_short(kind)}")


def _plan(value: object) -> SourcePlan:
    plan = _object(value, "sources.plan", ("prompt_len", "token_range", "tokens_per_block", "groups", "sources", "prompt_key"))
    prompt_len = _int(plan["prompt_len"], "sources.plan.prompt_len", 0, MAX_INT)
    token_range = _list(plan["token_range"], "sources.plan.token_range", 2)
    beg = _int(token_range[0], "sources.plan.token_range[0]", 0, prompt_len)
    end = _int(token_range[1], "sources.plan.token_range[1]", beg, prompt_len)
    tokens_per_block = _int(plan["tokens_per_block"], "sources.plan.tokens_per_block", 1, MAX_INT)
    groups: list[GroupTransfer] = []
    for item in _list(plan["groups"], "sources.plan.groups"):
        group = _object(item, "sources.plan.groups[]", GROUP_FIELDS)
        numbers = [_int(group[name], f"sources.plan.groups[].{name}", 0, MAX_INT) for name in GROUP_FIELDS if name != "kind"]
        kind = _str(group["kind"], "sources.plan.groups[].kind")
        groups.append(GroupTransfer(numbers[0], kind, *numbers[1:]))
    columns = _object(plan["sources"], "sources.plan.sources", tuple(name for name, _ in SOURCE_COLUMNS))
    rows: list[list[int]] = []
    for name, low in SOURCE_COLUMNS:
        high = MAX_ADDRESS if name == "src_address" else MAX_INT
        rows.append([_int(cell, f"sources.plan.sources.{name}[]", low, high) for cell in _list(columns[name], f"sources.plan.sources.{name}")])
    if len({len(column) for column in rows}) > 1:
        raise TransferError(f"sources.plan.sources: columns of different lengths {[len(column) for column in rows]}")
    blocks = tuple(SourceBlock(*cells) for cells in zip(*rows))
    prompt_key = _base64(plan["prompt_key"], "sources.plan.prompt_key")
    return SourcePlan(KVSlice(prompt_len, HalfOpenRange(beg, end)), tokens_per_block, tuple(groups), blocks, prompt_key)


def _scope(value: object) -> ReuseScope:
    scope = _object(value, "request.scope", ("lora_id", "salt"))
    lora_id = scope["lora_id"]  # any integer, as ReuseScope takes (JSON's parser bounds its digits)
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
        raise TransferError(f"request.scope.lora_id must be null or an integer, got {_short(lora_id)}")
    salt = scope["salt"]
    if isinstance(salt, dict):
        salt = _base64(_object(salt, "request.scope.salt", ("bytes",))["bytes"], "request.scope.salt.bytes")
    elif isinstance(salt, bool) or (salt is not None and not isinstance(salt, (int, str))):
        raise TransferError(f"request.scope.salt must be null, an integer, a string or {{\"bytes\": base64}}, got {_short(salt)}")
    try:
        return ReuseScope(lora_id, salt)
    except (TypeError, ValueError) as error:  # a str salt that UTF-8 cannot encode (a lone surrogate)
        raise TransferError(f"request.scope: {error}") from error


def _object(value: object, name: str, keys: tuple[str, ...] | None) -> dict[str, object]:
    if not isinstance(value, dict):
        raise TransferError(f"{name} must be a JSON object, got {_short(value)}")
    if keys is not None:
        _keys(value, name, keys)
    return value


def _keys(value: dict[str, object], name: str, keys: tuple[str, ...]) -> None:
    if set(value) != set(keys):
        raise TransferError(f"{name} must have exactly the fields {sorted(keys)}, got {sorted(value)}")


def _list(value: object, name: str, length: int | None = None) -> list[object]:
    if not isinstance(value, list):
        raise TransferError(f"{name} must be a JSON array, got {_short(value)}")
    if length is not None and len(value) != length:
        raise TransferError(f"{name} must have {counted(length, 'item')}, got {len(value)}")
    return value


def _int(value: object, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransferError(f"{name} must be an integer, got {_short(value)}")
    if not low <= value <= high:
        raise TransferError(f"{name} = {_short(value)} is outside [{low}, {high}]")
    return value


def _token(value: object) -> int:
    """Any integer, as the manager takes a text token (upstream's ids are unsigned 64-bit; the manager bounds
    none): a bound here only made a prompt the decode side had cached fail half way through its handoff."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransferError(f"request.tokens[] must be an integer, got {_short(value)}")
    return value


def _seconds(value: object, name: str) -> float:
    """A JSON number that ``check_timeout`` takes; quoted at most 80 characters (a peer's 4,000-digit int)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TransferError(f"{name} must be a number of seconds, got {_short(value)}")
    try:
        return check_timeout(value, name)
    except ValueError:
        raise TransferError(f"{name} = {_short(value)} is outside (0, {MAX_READ_TIMEOUT_S:.0f}] seconds") from None


def _str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TransferError(f"{name} must be a string, got {_short(value)}")
    return value


def _base64(value: object, name: str) -> bytes:
    try:
        return base64.b64decode(_str(value, name), validate=True)
    except binascii.Error as error:
        raise TransferError(f"{name} must be base64: {error}") from error


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
