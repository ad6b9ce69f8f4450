"""Command line: ``python -m kv_cache_manager_v2 simulate`` — the serving simulator (SPEC §10).

The loop lives in ``simulator.py`` and the tables, JSON and plot in ``report.py``; this module parses flags,
shows progress (a rich progress bar on stderr, or plain lines without rich) and prints the report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Protocol, Sequence, cast

from ._events import KVEvent
from ._manager import KVCacheManager
from ._memory import cuda_device_available
from .models.generate_cli import add_generate_parser, run_generate
from .presets import DEFAULT_PRESET, PRESET_NAMES
from .mooncake_trace import TraceFormatError
from .report import (
    describe_layout,
    print_tables,
    result_json,
    summary_tables,
    sweep_json,
    sweep_table,
    write_plot,
    write_sweep_plot,
)
from .reuse_sources import EventForward
from .simulator import (
    SimulationInterrupted,
    SimulationResult,
    SimulationSetupError,
    SimulatorOptions,
    Workload,
    build_config,
    build_workload,
    byte_divisor,
    resolve_backend,
    simulate,
)

if TYPE_CHECKING:
    from .kv_events import KVEventsPublisher

DEFAULTS = SimulatorOptions()
# Not ``__doc__``: compiled by mypyc, a module's ``__doc__`` reads as None.
DESCRIPTION = (
    "kv_cache_manager_v2 command line; `simulate` runs the serving simulator (SPEC §10), `generate` a real model "
    "(SPEC §12)."
)
# The seeded workload holds about 25 KB per request (100,000 requests: 2.4 GB, built in ~17 s); a larger run is a
# trace replay (--trace), which builds each request's tokens only while it runs.
MAX_REQUESTS = 100_000
# typical_step lists --max-batch caches; far past any real engine's batch, planning alone would take minutes.
MAX_BATCH = 65_536
SIMULATE_EPILOG = (
    "Exit status: 0 when the run finished; 1 when no request could be served (every one was rejected: the GPU "
    "quota cannot hold a single request alone, the reason is printed); 2 on a usage error (one line on stderr "
    "naming the flag and its value, before any work starts); 130 when interrupted (Ctrl-C), after printing the "
    "figures gathered so far."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kv_cache_manager_v2", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    simulate_parser = commands.add_parser(
        "simulate",
        help="run a continuous-batching serving simulation on a model preset",
        description="A continuous-batching serving loop over a seeded multi-turn workload, with the FakeEngine "
        "checking every page's content on every step; ends with a table of hit rates, memory, data movement, "
        "preemptions and manager CPU time.",
        epilog=SIMULATE_EPILOG,
    )
    add = simulate_parser.add_argument
    add("--preset", choices=PRESET_NAMES, default=DEFAULT_PRESET, help="model preset (default %(default)s)")
    add(
        "--requests",
        type=int,
        default=None,
        help=f"requests in the workload, 1 to {MAX_REQUESTS:,} (default {DEFAULTS.num_requests})",
    )
    add("--seed", type=int, default=DEFAULTS.seed, help="workload seed (default %(default)s)")
    add("--gpu-mib", type=int, default=DEFAULTS.gpu_mib, help="GPU tier quota in MiB (default %(default)s)")
    add("--host-mib", type=int, default=DEFAULTS.host_mib, help="host tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-mib", type=int, default=DEFAULTS.disk_mib, help="disk tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-dir", default=None, help="directory for the disk tier's files (default: a temporary directory)")
    add("--tokens-per-block", type=int, default=DEFAULTS.tokens_per_block, help="default %(default)s")
    add(
        "--max-batch",
        type=int,
        default=DEFAULTS.max_batch,
        help=f"most running requests, at most {MAX_BATCH:,} (default %(default)s)",
    )
    add("--chunk", type=int, default=DEFAULTS.chunk, help="prefill tokens per request per step (default %(default)s)")
    add(
        "--scratch",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.scratch,
        help="SWA scratch reuse for prefill chunks (KVCacheManagerConfig.enable_swa_scratch_reuse); it saves "
        "slots only for chunks longer than the window (gemma: 1,024), e.g. with --chunk 2048",
    )
    add("--ssm-interval", type=int, default=DEFAULTS.ssm_interval, help="ssm_reuse_interval in tokens (default %(default)s)")
    add(
        "--batch-admission",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.batch_admission,
        help="admit each step's new requests with one create_kv_cache_batch call",
    )
    add(
        "--backend",
        choices=("auto", "cuda", "cpu"),
        default=DEFAULTS.backend,
        help="auto: cpu while content checks are on (the FakeEngine reads NumPy views), else cuda when CuPy "
        "sees a GPU (default %(default)s)",
    )
    add("--json", action="store_true", help="print one JSON object with every figure instead of the tables")
    add(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="write memory and hit rate over time to a PNG file (matplotlib); checked before the run",
    )
    add("--no-check", action="store_true", help="skip the FakeEngine's content checks (on by default)")
    add("--plain", action="store_true", help="plain-text tables and progress even when rich is installed")
    trace = simulate_parser.add_argument_group(
        "trace replay",
        "Replay a Mooncake-format trace (JSON Lines: timestamp ms, input_length, output_length, hash_ids of "
        "512-token blocks) instead of the seeded workload; the hit rate is compared with the trace's "
        "infinite-cache ideal.",
    )
    add = trace.add_argument
    add("--trace", metavar="FILE.jsonl", default=None, help="the trace to replay")
    add("--trace-limit", metavar="N", type=int, default=None, help="replay only the first N requests")
    add(
        "--trace-speed",
        metavar="X",
        type=float,
        default=None,
        help="compress the trace's time X-fold (arrival step = timestamp / X / 50 ms; default 1)",
    )
    add(
        "--closed-loop",
        action="store_true",
        help="ignore timestamps: every request is there from the start and --max-batch sets the pace",
    )
    add(
        "--bookkeeping",
        action="store_true",
        help="bookkeeping only, for large traces: no content checks, every buffer and quota divided by one "
        "power of two (same slot counts, page copies of a few bytes)",
    )
    add(
        "--sweep-gpu-mib",
        metavar="A,B,C",
        default=None,
        help="run once per GPU quota, without and with the --host-mib host tier; print and (--plot) plot the "
        "hit rate against GPU capacity",
    )
    events = simulate_parser.add_argument_group(
        "KV events",
        "Publish the run's KV events live in vLLM's ZMQ/msgpack format (needs the 'events' extra); watch them with "
        "`python -m kv_cache_manager_v2 events-listen ENDPOINT`.",
    )
    add = events.add_argument
    add("--kv-events", metavar="ENDPOINT", default=None, help="PUB endpoint, e.g. tcp://*:5557 or ipc:///tmp/kv")
    add("--kv-events-topic", metavar="T", default="", help="topic of every message (default: empty)")
    add("--kv-events-replay", metavar="ENDPOINT", default=None, help="ROUTER endpoint answering replay requests")
    add(
        "--kv-events-wait",
        metavar="S",
        type=float,
        default=1.0,
        help="seconds to wait after binding, before the first step, so subscribers can connect (ZMQ drops "
        "what a PUB socket sends before a subscriber has joined; default %(default)s)",
    )
    add_generate_parser(commands)
    return parser


def options_from_args(args: argparse.Namespace) -> SimulatorOptions:
    return SimulatorOptions(
        preset=str(args.preset),
        num_requests=DEFAULTS.num_requests if args.requests is None else int(args.requests),
        seed=int(args.seed),
        gpu_mib=int(args.gpu_mib),
        host_mib=int(args.host_mib),
        disk_mib=int(args.disk_mib),
        disk_dir=None if args.disk_dir is None else str(args.disk_dir),
        tokens_per_block=int(args.tokens_per_block),
        max_batch=int(args.max_batch),
        chunk=int(args.chunk),
        scratch=bool(args.scratch),
        ssm_interval=int(args.ssm_interval),
        batch_admission=bool(args.batch_admission),
        backend=str(args.backend),
        check=not (args.no_check or args.bookkeeping),
        trace=None if args.trace is None else str(args.trace),
        trace_limit=None if args.trace_limit is None else int(args.trace_limit),
        trace_speed=1.0 if args.trace_speed is None else float(args.trace_speed),
        closed_loop=bool(args.closed_loop),
        bookkeeping=bool(args.bookkeeping),
    )


# ----------------------------------------------------------------------------------------------- progress
class _RichProgress(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def add_task(self, description: str, total: float, **fields: object) -> int: ...

    def update(self, task_id: int, **kwargs: object) -> None: ...


class _RichProgressType(Protocol):
    def __call__(self, *columns: object, **kwargs: object) -> _RichProgress: ...

    def get_default_columns(self) -> tuple[object, ...]: ...


class _RichConsoleType(Protocol):
    def __call__(self, **kwargs: object) -> object: ...


class _ColumnType(Protocol):
    def __call__(self, *args: object) -> object: ...


class Progress:
    """Requests done out of the total: a rich progress bar on stderr, or a plain line every 10% (without rich,
    with --plain, or when stderr is not a terminal: a bar there shows nothing and leaves a blank line)."""

    def __init__(self, total: int, plain: bool, label: str = "simulating") -> None:
        self.total = total
        self.label = label
        self.last_tenth = -1
        self.bar: _RichProgress | None = None
        self.task = 0
        if plain:
            return
        try:
            progress_module = importlib.import_module("rich.progress")
            console_type = cast(_RichConsoleType, getattr(importlib.import_module("rich.console"), "Console"))
        except ImportError:
            return
        console = console_type(stderr=True)
        if not getattr(console, "is_terminal"):
            return
        progress_type = cast(_RichProgressType, getattr(progress_module, "Progress"))
        count_column = cast(_ColumnType, getattr(progress_module, "MofNCompleteColumn"))
        text_column = cast(_ColumnType, getattr(progress_module, "TextColumn"))
        self.bar = progress_type(
            *progress_type.get_default_columns(),
            count_column(),
            text_column("{task.fields[detail]}"),
            console=console,
            transient=True,
        )

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, detail="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, detail=f"step {step}")
            return
        tenth = done * 10 // max(1, total)
        if tenth != self.last_tenth:
            self.last_tenth = tenth
            print(f"simulate: {self.label}: {done}/{total} requests done, step {step}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- commands
def _print_layout(options: SimulatorOptions, manager: KVCacheManager) -> None:
    print(f"preset {options.preset}: planned layout")
    divisor = byte_divisor(options)
    if divisor > 1:
        print(f"  bookkeeping only: every buffer and quota divided by {divisor:,} (the sizes below); same slot counts")
    for line in describe_layout(manager):
        print(f"  {line}")
    sys.stdout.flush()


# SimulatorOptions / KVCacheManagerConfig field -> the flag that sets it (for error messages).
FLAGS = {
    "num_requests": "--requests",
    "gpu_mib": "--gpu-mib",
    "host_mib": "--host-mib",
    "disk_mib": "--disk-mib",
    "max_batch": "--max-batch",
    "chunk": "--chunk",
    "KVCacheManagerConfig.tokens_per_block": "--tokens-per-block",
    "tokens_per_block": "--tokens-per-block",
    "KVCacheManagerConfig.ssm_reuse_interval": "--ssm-interval",
    "trace_limit": "--trace-limit",
    "trace_speed": "--trace-speed",
}


def _flag_error(error: ValueError) -> str:
    message = str(error)
    for field, flag in FLAGS.items():
        if message.startswith(field + " "):
            return flag + message[len(field) :]
    return message


def _usage_error(message: str) -> NoReturn:
    """One line on stderr and exit status 2 (argparse's own ``error`` adds a usage line)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _setup_error(error: Exception, options: SimulatorOptions) -> str:
    """A manager that cannot be built from the flags, in the flags' words."""
    if isinstance(error, MemoryError):
        return (
            f"--gpu-mib {options.gpu_mib} / --host-mib {options.host_mib}: the tier quotas cannot be allocated "
            f"on this machine ({error})"
        )
    message = _flag_error(cast(ValueError, error))
    gpu_quota = re.match(r"GpuCacheTierConfig\.quota \d+ ", message)
    if gpu_quota is not None:
        return (
            f"--gpu-mib {options.gpu_mib} is too small: it {message[gpu_quota.end() :]}; raise --gpu-mib or lower "
            "--tokens-per-block"
        )
    return message


def _check_trace_flags(args: argparse.Namespace) -> list[int]:
    """Usage errors among the trace flags; the sweep's GPU quotas (empty without a sweep)."""
    if args.trace is None:
        for flag, value in (("--trace-limit", args.trace_limit), ("--trace-speed", args.trace_speed),
                            ("--closed-loop", args.closed_loop or None)):
            if value is not None:
                _usage_error(f"{flag} needs --trace")
    else:
        if args.requests is not None:
            _usage_error("--requests sets the seeded workload's size; with --trace use --trace-limit")
        if args.closed_loop and args.trace_speed is not None:
            _usage_error("--closed-loop ignores timestamps: drop --trace-speed")
        if not os.path.isfile(str(args.trace)):
            _usage_error(f"--trace {args.trace}: no such file")
    if args.sweep_gpu_mib is None:
        return []
    try:
        sizes = [int(part) for part in str(args.sweep_gpu_mib).split(",")]
    except ValueError:
        _usage_error(f"--sweep-gpu-mib must be comma-separated MiB counts, got {args.sweep_gpu_mib!r}")
    if not sizes or any(size < 1 for size in sizes):
        _usage_error(f"--sweep-gpu-mib must be MiB counts >= 1, got {args.sweep_gpu_mib!r}")
    if args.host_mib <= 0:
        _usage_error("--sweep-gpu-mib compares runs without and with a host tier: give --host-mib > 0")
    return sizes


def _check_plot(path: str) -> None:
    """The plot's file must be a PNG the run can create: found now, not after the whole run."""
    if path == "-":
        _usage_error("--plot -: the plot is a PNG file, not standard output: give a file name ending in .png")
    if os.path.isdir(path):
        _usage_error(f"--plot {path}: is a directory: give a file name ending in .png")
    if not path.lower().endswith(".png"):
        _usage_error(f"--plot {path}: the plot is written as PNG: give a file name ending in .png")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        _usage_error(f"--plot {path}: directory {directory} does not exist")
    if os.path.exists(path):
        if not (os.path.isfile(path) and os.access(path, os.W_OK)):
            _usage_error(f"--plot {path}: not a writable file")
    else:
        try:
            with open(path, "xb"):
                pass
            os.remove(path)
        except OSError as error:
            _usage_error(f"--plot {path}: cannot create the file: {error.strerror}")
    if importlib.util.find_spec("matplotlib") is None:
        _usage_error("--plot needs matplotlib: pip install 'kv_cache_manager_v2[cli]'")


def _check_options(args: argparse.Namespace) -> SimulatorOptions:
    """The options from the flags, every usage error found before any work starts."""
    if args.requests is not None and args.requests > MAX_REQUESTS:
        _usage_error(
            f"--requests {args.requests}: at most {MAX_REQUESTS:,} (the seeded workload holds ~25 KB per request); "
            "replay a trace (--trace) for more"
        )
    if args.max_batch > MAX_BATCH:
        _usage_error(f"--max-batch {args.max_batch}: at most {MAX_BATCH:,}")
    try:
        options = options_from_args(args)
        build_config(options, ".", 1)  # validates the manager config before any work
    except ValueError as error:
        _usage_error(_flag_error(error))
    if args.disk_dir is not None and options.disk_mib == 0:
        _usage_error("--disk-dir needs --disk-mib (the disk tier's quota)")
    if resolve_backend(options) == "cuda" and not cuda_device_available():
        _usage_error(f"--backend {args.backend}: CuPy sees no CUDA device here; use --backend cpu")
    if args.plot:
        _check_plot(str(args.plot))
    _check_kv_events(args)
    return options


def _check_kv_events(args: argparse.Namespace) -> None:
    if args.kv_events is None:
        if args.kv_events_replay is not None or args.kv_events_topic:
            _usage_error("--kv-events-topic and --kv-events-replay need --kv-events ENDPOINT")
        return
    if args.sweep_gpu_mib is not None:
        _usage_error("--kv-events publishes one run; it does not go with --sweep-gpu-mib")
    if not 0.0 <= args.kv_events_wait <= 3600.0:
        _usage_error(f"--kv-events-wait {args.kv_events_wait}: seconds from 0 to 3600")
    for module in ("zmq", "msgspec"):
        if importlib.util.find_spec(module) is None:
            _usage_error(f"--kv-events needs the 'events' extra ({module} is missing): pip install '.[events]'")


def run_simulate(args: argparse.Namespace) -> int:
    sweep = _check_trace_flags(args)
    options = _check_options(args)
    start = time.perf_counter()
    try:
        workload = build_workload(options)
    except (TraceFormatError, UnicodeDecodeError) as error:
        _usage_error(f"--trace: {error}")
    if sweep:
        return _run_sweep(args, options, workload, sweep)
    started: list[KVCacheManager] = []

    def on_start(manager: KVCacheManager) -> None:
        started.append(manager)
        if not args.json:
            _print_layout(options, manager)

    publishers: list[KVEventsPublisher] = []
    try:
        try:
            with Progress(len(workload.requests), bool(args.plain)) as progress:
                result: SimulationResult = simulate(
                    options, progress, on_start, workload, _kv_events_hook(args, publishers) if args.kv_events else None
                )
        except SimulationInterrupted as interrupted:
            partial = interrupted.result
            print(
                f"simulate: interrupted at step {partial.steps:,} ({partial.finished:,} of {partial.num_requests:,} "
                "requests finished); the figures so far:",
                file=sys.stderr,
                flush=True,
            )
            _print_result(args, partial, start, interrupted=True)
            return 130
        except (ValueError, MemoryError) as error:
            if started:
                raise  # the manager was built: a failure of the run itself, not of the flags
            _usage_error(_setup_error(error, options))
    finally:
        for publisher in publishers:
            publisher.shutdown()
    if args.plot:
        write_plot(result, str(args.plot))
    _print_result(args, result, start)
    if result.finished == 0 and result.rejected > 0:
        slots = ", ".join(f"{pool.gpu_slots:,}" for pool in result.pool_groups)
        print(
            f"error: no request could be served: all {result.rejected:,} were rejected, each needing more GPU "
            f"slots alone than --gpu-mib {options.gpu_mib} gives ({slots} per pool group); raise --gpu-mib",
            file=sys.stderr,
        )
        return 1
    return 0


def _kv_events_hook(
    args: argparse.Namespace, publishers: list[KVEventsPublisher]
) -> Callable[[KVCacheManager], EventForward]:
    """Makes the run's publisher once the manager exists; it publishes after every step and sends
    ``AllBlocksCleared`` when the run ends (closed by ``run_simulate``)."""
    from .kv_events import KVEventsPublisher

    def start(manager: KVCacheManager) -> EventForward:
        publisher = KVEventsPublisher(manager, str(args.kv_events), args.kv_events_replay, str(args.kv_events_topic))
        publishers.append(publisher)
        print(f"publishing KV events on {publisher.endpoint}", file=sys.stderr, flush=True)
        time.sleep(float(args.kv_events_wait))

        def forward(events: list[KVEvent]) -> None:
            publisher.publish_pending(events)

        return forward

    return start


def _print_result(args: argparse.Namespace, result: SimulationResult, start: float, interrupted: bool = False) -> None:
    if args.json:
        report = result_json(result)
        if interrupted:
            report["interrupted"] = True
        print(json.dumps(report, indent=2))
        return
    print_tables(summary_tables(result), plain=bool(args.plain))
    if args.plot and not interrupted:
        print(f"plot written to {args.plot}")
    print(f"done in {time.perf_counter() - start:.1f} s")


def _run_sweep(args: argparse.Namespace, options: SimulatorOptions, workload: Workload, sizes: list[int]) -> int:
    """One run per (GPU quota, without / with the host tier) on the same workload; a table, JSON or a plot."""
    start = time.perf_counter()
    results: list[SimulationResult] = []
    for gpu_mib in sizes:
        for host_mib in (0, options.host_mib):
            point = options.with_tiers(gpu_mib, host_mib)
            label = f"GPU {gpu_mib:,} MiB, host {host_mib:,} MiB"
            try:
                build_config(point, ".", 1)
                with Progress(len(workload.requests), bool(args.plain), label) as progress:
                    results.append(simulate(point, progress, None, workload))
            except (ValueError, SimulationSetupError) as error:
                _usage_error(f"--sweep-gpu-mib {gpu_mib}: {_flag_error(error)}")
    if args.plot:
        write_sweep_plot(results, str(args.plot))
    if args.json:
        print(json.dumps(sweep_json(results), indent=2))
    else:
        print_tables([sweep_table(results)], plain=bool(args.plain))
        if args.plot:
            print(f"plot written to {args.plot}")
        print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "simulate":
        try:
            return run_simulate(args)
        except KeyboardInterrupt:  # before the first step or after the last: nothing to summarise
            print("simulate: interrupted", file=sys.stderr)
            return 130
    if args.command == "generate":
        return run_generate(args, parser)
    return 2
