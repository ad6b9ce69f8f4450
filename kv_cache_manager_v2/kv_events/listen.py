"""``python -m kv_cache_manager_v2 events-listen ENDPOINT``: print the KV event batches a publisher sends,
decoded, and report gaps in their sequence numbers (replayed when ``--replay`` names the replay endpoint) and
publisher restarts (numbering from 0 again)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, NoReturn, Sequence, SupportsFloat, SupportsIndex, TextIO

import zmq
from mypy_extensions import mypyc_attr

from .._base.validation import as_bounded_float, as_int
from .subscriber import KEPT_RECORDS, MAX_TIMEOUT_MS, EventSubscriber, ReceivedBatch, Record, replay_endpoint_error
from .wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, WireEvent

# --timeout in seconds, at most the subscriber's longest wait.
MAX_TIMEOUT_S: float = MAX_TIMEOUT_MS / 1000
# How long a listener given ``check_output`` waits for a batch between two checks: ``events-listen | head`` stops
# within this of its reader leaving, not at its first write after (never, from an idle publisher).
OUTPUT_CHECK_MS: int = 500


@mypyc_attr(native_class=False)  # a subclass of a Python class: a Python class in compiled mode too
class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line and exit status 2, like every other command's (``cli/parsing.py``, a layer
    above this one)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m kv_cache_manager_v2 events-listen",
        description="Subscribe to vLLM-format KV events (ZMQ PUB, msgpack) and print each batch decoded, with a "
        "line for each gap (batches missed), publisher restart and skipped message; runs until --count batches, "
        "--timeout seconds without one, or Ctrl-C.",
        epilog="Exit status: 0 when it stopped (with --replay, whatever the replays recovered: each gap line says "
        "how many); 1 when batches were missed and no --replay was given to recover them; 2 on a usage error (an endpoint ZeroMQ "
        "cannot use included); 130 when interrupted (Ctrl-C); 141, without a word, when the output's reader left "
        "early (| head).",
    )
    parser.add_argument("endpoint", help="the publisher's endpoint, e.g. tcp://127.0.0.1:5557 or ipc:///tmp/kv")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    parser.add_argument("--replay", metavar="ENDPOINT", default=None, help="the publisher's replay endpoint")
    parser.add_argument("--count", type=int, default=None, help="stop after this many batches (default: no limit)")
    parser.add_argument("--timeout", type=float, default=None, help="stop after this many seconds without a batch "
                        "(default: no limit)")
    return parser


def _hash_text(block_hash: BlockHash | None) -> str:
    """An int as it is, a byte digest in hex (vLLM's sha256 hashes)."""
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


def _hashes_text(block_hashes: Sequence[BlockHash]) -> str:
    return "[" + ", ".join(_hash_text(block_hash) for block_hash in block_hashes) + "]"


def describe(event: WireEvent) -> str:
    """One line per event: its type and fields."""
    if isinstance(event, BlockStored):
        window = "" if event.kv_cache_spec_sliding_window is None else f" window={event.kv_cache_spec_sliding_window}"
        return (
            f"BlockStored group={event.group_idx} kind={event.kv_cache_spec_kind}{window} medium={event.medium} "
            f"hashes={_hashes_text(event.block_hashes)} parent={_hash_text(event.parent_block_hash)} "
            f"block_size={event.block_size} "
            f"lora_id={event.lora_id} lora_name={event.lora_name} tokens={list(event.token_ids)} "
            f"extra_keys={None if event.extra_keys is None else list(event.extra_keys)}"
        )
    if isinstance(event, BlockRemoved):
        return f"BlockRemoved group={event.group_idx} medium={event.medium} hashes={_hashes_text(event.block_hashes)}"
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    raise TypeError(f"not a wire event: {event!r}")


def _since(records: list[Record], new: int, what: str, out: TextIO) -> list[Record]:
    """The ``new`` latest of ``records``, after a line counting those the subscriber no longer keeps."""
    kept = records[len(records) - min(new, len(records)) :] if new > 0 else []
    if new > len(kept):
        print(f"{new - len(kept)} earlier {what} not kept (a subscriber keeps the latest {KEPT_RECORDS})", file=out)
    return kept


def _receive(
    subscriber: EventSubscriber, timeout_ms: int | None, check_output: Callable[[], None] | None
) -> ReceivedBatch | None:
    """``subscriber.receive(timeout_ms)`` (None: no limit), waiting at most ``OUTPUT_CHECK_MS`` at a time with
    ``check_output`` (which raises to stop the listener) called before each wait."""
    if check_output is None:
        return subscriber.receive(timeout_ms)
    deadline = -1.0 if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    while True:
        check_output()
        wait_ms = OUTPUT_CHECK_MS
        if deadline >= 0:
            wait_ms = min(wait_ms, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
        received = subscriber.receive(wait_ms)
        if received is not None or (deadline >= 0 and time.monotonic() >= deadline):
            return received


def _within_timeout(seconds: float) -> bool:
    return 0.0 <= seconds <= MAX_TIMEOUT_S


def listen(
    subscriber: EventSubscriber,
    count: SupportsIndex | None,
    timeout_s: SupportsFloat | None,
    out: TextIO,
    check_output: Callable[[], None] | None = None,
) -> int:
    """Print batches until ``count`` of them (None: no limit; ``ValueError`` below 1, as ``--count``) or
    ``timeout_s`` of silence (None: no limit; ``ValueError`` outside 0 to ``MAX_TIMEOUT_S``, NaN included,
    ``TypeError`` for a non-number); the number printed. ``check_output`` (the command line's: raises
    ``BrokenPipeError`` once the output's reader left) is called at least every ``OUTPUT_CHECK_MS`` while
    waiting."""
    limit = None if count is None else as_int(count, "count")
    if limit is not None and limit < 1:  # as the command line's --count: 0 would print nothing
        raise ValueError(f"count must be None or >= 1, got {limit}")
    timeout_ms = None
    if timeout_s is not None:
        seconds = as_bounded_float(timeout_s, "timeout_s", f"[0, {MAX_TIMEOUT_S:,.0f}]", _within_timeout)
        timeout_ms = int(seconds * 1000)
    printed = 0
    gaps = 0
    restarts = 0
    skipped = 0
    while limit is None or printed < limit:
        received = _receive(subscriber, timeout_ms, check_output)
        for reason in _since(subscriber.skipped, subscriber.num_skipped - skipped, "skipped messages", out):
            print(f"skipped: {reason}", file=out)
        skipped = subscriber.num_skipped
        if received is None:
            break
        for gap in _since(subscriber.gaps, subscriber.num_gaps - gaps, "gaps", out):
            print(
                f"gap: batches {gap.first_missing}..{gap.next_received - 1} missed, {gap.recovered} replayed",
                file=out,
            )
        gaps = subscriber.num_gaps
        for restart in _since(subscriber.restarts, subscriber.num_restarts - restarts, "restarts", out):
            print(f"restart: the publisher began again at batch {restart.first_seq} after {restart.previous_seq}", file=out)
        restarts = subscriber.num_restarts
        batch = received.batch
        origin = " (replayed)" if received.replayed else ""
        print(
            f"batch seq={received.seq}{origin} ts={batch.ts:.6f} dp_rank={batch.data_parallel_rank} "
            f"events={len(batch.events)}",
            file=out,
        )
        for event in batch.events:
            print(f"  {describe(event)}", file=out)
        out.flush()
        printed += 1
    return printed


def _check_replay_endpoint(endpoint: str, parser: argparse.ArgumentParser) -> None:
    """``--replay bogus`` as a usage error naming the option (the subscriber's own check names its argument)."""
    error = replay_endpoint_error(endpoint)
    if error is not None:
        parser.error(f"--replay {endpoint!r}: {error}")


def main(argv: Sequence[str] | None = None, check_output: Callable[[], None] | None = None) -> int:
    """``events-listen``'s exit status; ``check_output``: see ``listen`` (``__main__`` passes the command line's
    ``stop_if_reader_left``, a layer above this one)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.count is not None and args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    if args.timeout is not None and not 0.0 <= args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        parser.error(f"--timeout must be seconds from 0 to {MAX_TIMEOUT_S:,.0f}, got {args.timeout}")
    if args.replay is not None:
        _check_replay_endpoint(str(args.replay), parser)
    try:
        subscriber = EventSubscriber(str(args.endpoint), str(args.topic), args.replay)
    except zmq.ZMQError as error:  # an endpoint ZMQ cannot parse, bind or connect
        parser.error(f"endpoint {args.endpoint!r}: {error}")
    try:
        listen(subscriber, args.count, args.timeout, sys.stdout, check_output)
    except KeyboardInterrupt:
        print("events-listen: interrupted", file=sys.stderr)  # as every command of the package's command line
        return 130
    finally:
        subscriber.close()
    return 1 if subscriber.num_gaps and args.replay is None else 0
