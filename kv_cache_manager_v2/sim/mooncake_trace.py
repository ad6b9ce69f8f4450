"""Mooncake-format request traces (FAST'25 release): loading, token synthesis, and the trace's ideal hit rate.

A trace is JSON Lines, one request per line: ``timestamp`` (ms, from 0 or since the Unix epoch: arrivals count
from the first request), ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token block of the
input (the last block cut to ``input_length``). Equal ids at equal positions are equal content, so they mean a
shared prefix. Nothing here imports the manager.

Tokens are made up deterministically: position ``j`` of a block with hash id ``h`` is token ``h * 512 + j``, so
equal ids give equal tokens and different ids differ at every position; output tokens are numbered from just
past the largest prompt token, unique per request. Tokens are built only when the simulator admits a request
(``token_ids``): a whole trace as lists would not fit in memory (the synthetic trace alone holds 61 M tokens).
"""

from __future__ import annotations

import json
import math
from array import array
from fractions import Fraction
from typing import Final, Sequence

from .._base.validation import as_positive_int

HASH_BLOCK_TOKENS: Final = 512
# Trace time one scheduler step stands for (a forward pass of a chunked-prefill + decode batch).
STEP_MS: Final = 50
# Upper bounds of a line's fields. Without them a huge number passes the checks and fails much later, far from the
# line: as an OverflowError turning a timestamp into a step, or as a GPU tier "too small" for one request.
# 2**24 tokens is ~88x the synthetic trace's longest prompt and beyond any model's context window today.
MAX_REQUEST_TOKENS: Final = 2**24
# Timestamps are milliseconds, from 0 (the FAST'25 release) or since the Unix epoch (~1.7e12 in 2024: production
# logs, converted Azure or BurstGPT traces). 10**13 ms is the year 2286: a trace stamped in microseconds or
# nanoseconds is refused at its first line, not replayed as centuries.
MAX_TIMESTAMP_MS: Final = 10**13
# Arrival steps count from the first request, so the span bounds them (2 * 10**10 steps at 1x): 10**12 ms is ~32
# years of trace time (the synthetic trace spans 17 minutes).
MAX_TRACE_SPAN_MS: Final = 10**12
# Token ids are hash_id * 512 + position (outputs numbered after the largest): 2**40 keeps them within int64.
MAX_HASH_ID: Final = 2**40
# A number with more digits than this is above every bound; it is not converted (Python refuses > 4300 digits).
_MAX_DIGITS: Final = 20
# --trace-speed: beyond a million times either way the arrivals collapse onto step 0 (use --closed-loop) or
# spread over more steps than a run can take; the bounds also keep timestamp / speed a finite float.
MIN_TRACE_SPEED: Final = 1e-6
MAX_TRACE_SPEED: Final = 1e6
# What a timestamp above MAX_TIMESTAMP_MS is told: the unit it must be in.
_TIMESTAMP_UNIT: Final = " (milliseconds: the year 2286 since the Unix epoch)"
# The fields of a trace line, in the FAST'25 release's order.
FIELDS: Final = ("timestamp", "input_length", "output_length", "hash_ids")
# Compressed files by their first bytes: the format and the command that decompresses one.
COMPRESSED: Final = (
    (b"\x1f\x8b", "gzip", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"), (b"BZh", "bzip2", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
)


class TraceFormatError(ValueError):
    """A line of a trace file is not a valid Mooncake request (the message names the file and line)."""


class MooncakeRequest:
    """One trace request as the simulator replays it; ``token_ids()`` builds its prompt and output tokens.

    ``output_start`` is the first of this request's ``output_length`` output token ids (unique in the trace).
    ``parent_id`` is always None: the format has no conversation links (shared prefixes are in the hash ids).
    ``hash_ids`` is an ``array('q')`` and the attributes are slots: as lists and a ``__dict__`` the requests of a
    200k-request trace held 330 MB for the whole run, now about 90 MB (see ``load_mooncake_trace``).
    """

    __slots__ = (
        "request_id", "timestamp_ms", "input_length", "hash_ids", "output_start", "arrival_step", "parent_id",
        "shared_prefix_length", "_output_length",
    )

    def __init__(
        self,
        request_id: int,
        timestamp_ms: int,
        input_length: int,
        output_length: int,
        hash_ids: array[int],
        output_start: int,
        arrival_step: int,
    ) -> None:
        self.request_id: int = request_id
        self.timestamp_ms: int = timestamp_ms
        self.input_length: int = input_length
        self.hash_ids: array[int] = hash_ids
        self.output_start: int = output_start
        self.arrival_step: int = arrival_step
        self.parent_id: int | None = None
        self.shared_prefix_length: int = 0  # shared prefixes are hash ids, not declared: chunk-end snapshots serve
        self._output_length = output_length

    @property
    def prompt_length(self) -> int:
        return self.input_length

    @property
    def output_length(self) -> int:
        return self._output_length

    def token_ids(self) -> list[int]:
        """The prompt (``input_length`` tokens from the hash ids), then the output tokens."""
        tokens: list[int] = []
        remaining = self.input_length
        for hash_id in self.hash_ids:
            first = hash_id * HASH_BLOCK_TOKENS
            tokens.extend(range(first, first + min(HASH_BLOCK_TOKENS, remaining)))
            remaining -= HASH_BLOCK_TOKENS
        tokens.extend(range(self.output_start, self.output_start + self._output_length))
        return tokens

    def __repr__(self) -> str:
        return (
            f"MooncakeRequest(id={self.request_id}, timestamp_ms={self.timestamp_ms}, "
            f"input_length={self.input_length}, output_length={self._output_length}, "
            f"hash_blocks={len(self.hash_ids)}, arrival_step={self.arrival_step})"
        )


class _LongNumber:
    """An integer of the trace too long to convert: it only names its length in the error of its field."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))
        self.negative = text.startswith("-")

    def __repr__(self) -> str:
        return f"a {self.digits}-digit {'negative ' if self.negative else ''}integer"


def _parse_int(text: str) -> int | _LongNumber:
    return _LongNumber(text) if len(text) > _MAX_DIGITS else int(text)


def _present(record: dict[str, object], key: str, where: str) -> object:
    """``record[key]``; a missing key was reported as "got None", the same words as a JSON null."""
    if key not in record:
        raise TraceFormatError(f"{where}: no {key} (a Mooncake trace line holds {', '.join(FIELDS)})")
    return record[key]


def _field(record: dict[str, object], key: str, minimum: int, maximum: int, where: str, unit: str = "") -> int:
    """``record[key]``, an integer in [minimum, maximum]; ``unit`` follows the upper bound in its error."""
    value = _present(record, key, where)
    if isinstance(value, _LongNumber):
        bound = f">= {minimum}" if value.negative else f"<= {maximum:,}{unit}"
        raise TraceFormatError(f"{where}: {key} must be {bound}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(f"{where}: {key} must be >= {minimum}, got {value}")
    if value > maximum:
        raise TraceFormatError(f"{where}: {key} must be <= {maximum:,}{unit}, got {value:,}")
    return value


def _deepest_field(line: str) -> str:
    """The top-level key whose value nests deepest (only read after the decoder gave up on the nesting)."""
    depth = deepest = 0
    key = found = ""
    text_start = -1
    escaped = False
    for position, char in enumerate(line):
        if text_start >= 0:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                if depth == 1:
                    key = line[text_start + 1 : position]
                text_start = -1
        elif char == '"':
            text_start = position
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, found = depth, key
        elif char in "]}":
            depth -= 1
    return found


def _refuse_compressed(first_line: bytes, path: str) -> None:
    """A compressed trace (as traces are often shipped) was "not UTF-8 (byte 0x8b at column 2)"."""
    for magic, format_name, command in COMPRESSED:
        if first_line.startswith(magic):
            raise TraceFormatError(f"{path}: {format_name}-compressed: decompress it first ({command} {path})")


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"{where}: not UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A key given twice is ambiguous: json keeps the last value silently, other readers of the trace the first."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise TraceFormatError(f"the key {key!r} appears twice in one object (which value counts is ambiguous)")
            seen.add(key)
    return record


def _decode(line: str, where: str) -> dict[str, object]:
    if line.startswith("\ufeff"):  # json's words for it were "Unexpected UTF-8 BOM (decode using utf-8-sig)"
        raise TraceFormatError(f"{where}: not JSON (a byte order mark at column 1: save the file as UTF-8 without one)")
    try:
        record: object = json.loads(line, parse_int=_parse_int, object_pairs_hook=_unique_keys)
    except TraceFormatError as duplicate:  # its own name: compiled, one name in two except clauses has one type
        raise TraceFormatError(f"{where}: {duplicate}") from None
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"{where}: not JSON ({error.msg.removesuffix(' at')} at column {error.colno})") from None
    except RecursionError:
        field = _deepest_field(line)
        raise TraceFormatError(f"{where}: {field or 'the line'} is nested too deeply") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def load_mooncake_trace(
    path: str, limit: int | None = None, speed: float = 1.0, closed_loop: bool = False
) -> list[MooncakeRequest]:
    """The first ``limit`` requests (all when None) of a Mooncake JSONL trace, in file order.

    Arrival steps count from the first request: ``floor((timestamp_ms - first) / speed / STEP_MS)`` (``speed`` > 1
    compresses the trace's time; ``first`` is the first request's timestamp, so a log stamped in Unix-epoch ms
    starts at step 0 like a trace stamped from 0), or 0 for every request when ``closed_loop`` (the scheduler's
    batch limit alone sets the pace). Raises ``TraceFormatError`` naming the file and line for anything malformed:
    bad JSON, a missing or negative field, ``hash_ids`` that do not cover ``input_length`` in 512-token blocks,
    timestamps going backwards or more than ``MAX_TRACE_SPAN_MS`` after the first.
    """
    if limit is not None:
        limit = as_positive_int(limit, "limit")
    # Exact arithmetic on the decimal speed (a float's str() is its shortest round-trip form, what was typed):
    # float division put 4,840 ms at 1.1x (step 88 exactly) into step 87.
    speed_numerator, speed_denominator = Fraction(str(check_trace_speed(speed, "speed"))).as_integer_ratio()
    step_numerator = STEP_MS * speed_numerator
    requests: list[MooncakeRequest] = []
    largest_hash_id = 0
    first_timestamp = last_timestamp = -1
    with open(path, "rb") as lines:  # bytes: a line that is not UTF-8 is named like any other malformed line
        for number, raw in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            if number == 1:
                _refuse_compressed(raw, path)
            record = _decode(_text(raw, where), where)
            timestamp = _field(record, "timestamp", 0, MAX_TIMESTAMP_MS, where, _TIMESTAMP_UNIT)
            input_length = _field(record, "input_length", 1, MAX_REQUEST_TOKENS, where)
            output_length = _field(record, "output_length", 1, MAX_REQUEST_TOKENS, where)
            hash_ids = _hash_ids(_present(record, "hash_ids", where), where)
            blocks = -(-input_length // HASH_BLOCK_TOKENS)
            if len(hash_ids) != blocks:
                raise TraceFormatError(
                    f"{where}: input_length {input_length} needs {blocks} hash ids of {HASH_BLOCK_TOKENS}-token "
                    f"blocks, got {len(hash_ids)}"
                )
            if timestamp < last_timestamp:
                raise TraceFormatError(f"{where}: timestamp {timestamp} is before the previous line's {last_timestamp}")
            if first_timestamp < 0:
                first_timestamp = timestamp
            if timestamp - first_timestamp > MAX_TRACE_SPAN_MS:
                raise TraceFormatError(
                    f"{where}: timestamp {timestamp:,} is {timestamp - first_timestamp:,} ms after the first "
                    f"request's {first_timestamp:,}: a trace spans at most {MAX_TRACE_SPAN_MS:,} ms (~32 years)"
                )
            last_timestamp = timestamp
            largest_hash_id = max(largest_hash_id, max(hash_ids))
            arrival = 0 if closed_loop else (timestamp - first_timestamp) * speed_denominator // step_numerator
            requests.append(
                MooncakeRequest(len(requests), timestamp, input_length, output_length, hash_ids, 0, arrival)
            )
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    next_output = (largest_hash_id + 1) * HASH_BLOCK_TOKENS
    for request in requests:  # outputs are numbered past every prompt token of the trace
        request.output_start = next_output
        next_output += request.output_length
    return requests


def trace_step_ms(speed: float, closed_loop: bool) -> float | None:
    """The trace time one step stands for (``STEP_MS / speed``), which maps a run's steps back to the trace's clock;
    None with ``closed_loop``, whose arrivals ignore the timestamps."""
    return None if closed_loop else STEP_MS / speed


def check_trace_speed(speed: object, name: str) -> float:
    """``speed`` as a float in [MIN_TRACE_SPEED, MAX_TRACE_SPEED]; ValueError naming ``name`` otherwise."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0.0 or speed == math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {speed!r}")
    if not MIN_TRACE_SPEED <= speed <= MAX_TRACE_SPEED:
        raise ValueError(f"{name} must be between {MIN_TRACE_SPEED:g} and {MAX_TRACE_SPEED:g}, got {speed!r}")
    return float(speed)


def _hash_ids(value: object, where: str) -> array[int]:
    """The ids as 8 bytes each (a list held an int object and a pointer per id: 40 bytes)."""
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers, got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_HASH_ID:
            raise TraceFormatError(f"{where}: hash_ids must hold integers in [0, 2**40], got {item!r}")
    return array("q", value)


class _HashTrie:
    """The hash-id trie of the prompts seen so far, flat: one dict entry per node keyed by its parent node and its
    block's hash id in one integer (an object and a dict per node took about three times the memory; a long
    trace's ideal holds one node per distinct block). ``cached[node]`` is the most tokens of that block any
    earlier prompt had (512 unless all were cut short), ``first[node]`` the request that brought it; node 0 is the
    root."""

    def __init__(self) -> None:
        self.nodes: dict[int, int] = {}
        self.cached: array[int] = array("H", [0])
        self.first: array[int] = array("i", [-1])

    def child(self, node: int, hash_id: int) -> int:
        """The child of ``node`` for ``hash_id``, or -1."""
        return self.nodes.get(node * (MAX_HASH_ID + 1) + hash_id, -1)

    def add(self, node: int, hash_id: int, tokens: int, request: int) -> int:
        """The child of ``node`` for ``hash_id`` (made for ``request`` if missing), now holding at least ``tokens``
        tokens."""
        key = node * (MAX_HASH_ID + 1) + hash_id
        child = self.nodes.get(key, -1)
        if child < 0:
            child = self.nodes[key] = len(self.cached)
            self.cached.append(tokens)
            self.first.append(request)
        elif self.cached[child] < tokens:
            self.cached[child] = tokens
        return child


class IdealReuse:
    """Per request, what an infinite cache serving one request at a time lets it reuse (``reusable`` tokens) and
    the earliest earlier request its longest cached prefix came from (``donor``, -1 when nothing is reusable): the
    simulator tells from it which followers came while their donor was still running."""

    def __init__(self, reusable: array[int], donor: array[int]) -> None:
        self.reusable: array[int] = reusable
        self.donor: array[int] = donor

    def hit_rate(self, requests: Sequence[MooncakeRequest], served: Sequence[bool] | None = None) -> float:
        """Reusable over prompt tokens of the ``served`` requests (default: all)."""
        reused_tokens = 0
        prompt_tokens = 0
        for index, request in enumerate(requests):
            if served is None or served[index]:
                prompt_tokens += request.input_length
                reused_tokens += self.reusable[index]
        return reused_tokens / prompt_tokens if prompt_tokens else 0.0


def ideal_hit_rate(
    requests: Sequence[MooncakeRequest],
    tokens_per_block: int,
    partial_reuse: bool = True,
    served: Sequence[bool] | None = None,
) -> float:
    """Fraction of prompt tokens an infinite prefix cache with the manager's reuse rules would serve.

    Requests are served one at a time in trace order. A finished request has computed (and committed) its prompt
    and all its output tokens but the last; the cache keeps them in blocks of ``tokens_per_block`` tokens, the
    last one possibly short. Output tokens are unique, so what later requests can match is earlier prompts. A
    request reuses its longest prefix found in the cache: whole full blocks whose whole prefix matches, plus, with
    ``partial_reuse``, the leading tokens it shares with one more cached block, full or short (copy-on-write);
    and at most ``prompt_length - 1`` tokens, because the engine computes at least the last prompt token. So
    with ``C`` the longest common prefix with any earlier prompt, a request reuses ``min(C, prompt_length - 1)``
    tokens, rounded down to whole blocks without partial reuse.

    Computed on hash ids (tokens of equal ids are equal, of different ids differ everywhere), never on tokens.
    The trace README's figure (64.0% for the synthetic trace) is different: the share of 512-token *blocks*
    whose hash id was seen before (``hash_block_hit_rate``), which weighs a short last block like a full one
    and counts a request's whole prompt.

    ``served`` (one flag per request) counts only the served requests, like the measured rate; every request still
    fills the cache (a request rejected mid-run may have committed blocks that others reused).
    """
    return ideal_reuse(requests, tokens_per_block, partial_reuse).hit_rate(requests, served)


def ideal_reuse(requests: Sequence[MooncakeRequest], tokens_per_block: int, partial_reuse: bool = True) -> IdealReuse:
    """Each request's reuse in ``ideal_hit_rate``'s infinite cache, and where it came from."""
    tokens_per_block = as_positive_int(tokens_per_block, "tokens_per_block")
    trie = _HashTrie()
    reusable_tokens: array[int] = array("q")
    donors: array[int] = array("i")
    for index, request in enumerate(requests):
        length = request.input_length
        common = 0  # tokens shared with the cache, block by block
        node = deepest = 0
        for position, hash_id in enumerate(request.hash_ids):
            child = trie.child(node, hash_id)
            if child < 0:
                break
            block_length = min(HASH_BLOCK_TOKENS, length - position * HASH_BLOCK_TOKENS)
            cached = trie.cached[child]
            common += min(block_length, cached)
            deepest = child
            if cached < HASH_BLOCK_TOKENS or block_length < HASH_BLOCK_TOKENS:
                break
            node = child
        reusable = min(common, length - 1)
        if not partial_reuse:
            reusable -= reusable % tokens_per_block
        reusable_tokens.append(reusable)
        donors.append(trie.first[deepest] if reusable > 0 else -1)
        node = 0  # the whole prompt is cached now (output_length >= 1: every prompt token was computed)
        for position, hash_id in enumerate(request.hash_ids):
            node = trie.add(node, hash_id, min(HASH_BLOCK_TOKENS, length - position * HASH_BLOCK_TOKENS), index)
    return IdealReuse(reusable_tokens, donors)


def hash_block_hit_rate(requests: Sequence[MooncakeRequest]) -> float:
    """Share of the trace's 512-token blocks whose hash id an earlier request already had (the figure trace
    READMEs quote: every block counts once, a short last block like a full one)."""
    seen: set[int] = set()
    hits = 0
    total = 0
    for request in requests:
        for hash_id in request.hash_ids:
            total += 1
            if hash_id in seen:
                hits += 1
        seen.update(request.hash_ids)
    return hits / total if total else 0.0
