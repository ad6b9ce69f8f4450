"""``python -m kv_cache_manager_v2 simulate`` — the serving simulator; ``__main__.py`` dispatches here.

The flags and their checks live in ``flags.py``, the loop in ``scheduler.py`` (run by ``simulator.py``), the
tables and JSON in ``report.py`` and the plots in ``plot.py``; this module shows progress (a rich progress bar on
a terminal, else plain lines), runs the simulation(s) and prints or writes the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Callable

from .. import KVCacheManager, KVEvent
from .._base.startup import INTERRUPTED_STATUS
from ..cli.parsing import usage_error
from ..cli.streams import OUTPUT_FAILED_STATUS, stop_if_reader_left
from ..cli.tables import print_tables, render_plain
from ..cli.whole_files import write_whole
from .flags import (
    DEFAULT_KV_EVENTS_WAIT, SAME_WORKLOAD_SWEEPS, check_options, check_sweep, check_trace_flags, flag_error,
)
from .mooncake_trace import TraceFormatError
from .options import TYPICAL_PERCENTILE, SimulatorOptions, build_config, byte_divisor, typical_lengths
from .plot import write_plot, write_sweep_plot
from .report import describe_layout, result_json, summary_tables, sweep_json, sweep_table
from .result import SimulationInterrupted, SimulationResult
from .reuse_sources import EventForward
from .scheduler import Workload
from .simulator import build_workload, simulate

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

    from ..kv_events import KVEventsPublisher

# Without a terminal (a log file, CI), a progress line at least this often, besides one per tenth of the requests.
PLAIN_PROGRESS_SECONDS = 10.0
# What --output-dir holds after a run (plot.png only with matplotlib).
OUTPUT_DIR_FILES = ("result.json", "summary.txt", "plot.png")
# How often a run asks whether its output's reader left (``| head``): a poll costs a system call, a step may not.
READER_CHECK_SECONDS = 0.2


class Progress:
    """Requests finished (and rejected) out of the total: a rich progress bar on stderr, or plain lines (without
    rich, with --plain, or when stderr is not a terminal) at every tenth of the requests and at least every
    ``PLAIN_PROGRESS_SECONDS``. The step shown is the simulated clock, the table's step count at the end. Every
    ``READER_CHECK_SECONDS`` it stops the run (``BrokenPipeError``) if the output's reader left."""

    def __init__(self, total: int, plain: bool, label: str = "simulating") -> None:
        self.total = total
        self.label = label
        self.last_tenth: int = -1
        self.last_line: float = time.monotonic()
        self.last_reader_check: float = self.last_line
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        if plain:
            return
        try:
            from rich.console import Console
            from rich.progress import MofNCompleteColumn, TextColumn
            from rich.progress import Progress as Bar
        except ImportError:
            return
        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self.bar = Bar(
            *Bar.get_default_columns(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
            console=console, transient=True,
        )

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, detail="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, finished: int, rejected: int, total: int, step: int) -> None:
        now = time.monotonic()
        if now - self.last_reader_check >= READER_CHECK_SECONDS:
            self.last_reader_check = now
            stop_if_reader_left()
        detail = f"{rejected:,} rejected, step {step:,}" if rejected else f"step {step:,}"
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=finished + rejected, detail=detail)
            return
        tenth = (finished + rejected) * 10 // max(1, total)
        if tenth != self.last_tenth or now - self.last_line >= PLAIN_PROGRESS_SECONDS:
            self.last_tenth = tenth
            self.last_line = now
            print(f"simulate: {self.label}: {finished:,}/{total:,} requests finished, {detail}", file=sys.stderr,
                  flush=True)


# ---------------------------------------------------------------------------------------------- commands
def _print_layout(options: SimulatorOptions, manager: KVCacheManager) -> None:
    print(f"{options.model_name}: planned layout")
    divisor = byte_divisor(options)
    if divisor > 1:
        print(f"  bookkeeping only: every buffer and quota divided by {divisor:,} (the sizes below); same slot counts")
    for line in describe_layout(manager):
        print(f"  {line}")
    sys.stdout.flush()


def _setup_error(error: ValueError | MemoryError | OSError, options: SimulatorOptions, workload: Workload) -> str:
    """A manager that cannot be built from the flags, in the flags' words (the pools are planned for the
    workload's lengths: --output-len 10,100000000 made the quota look too small without a word of it)."""
    if isinstance(error, OSError):  # the disk tier's directory or filesystem
        return f"--disk-dir / --disk-mib {options.disk_mib}: {error}"
    if isinstance(error, MemoryError):
        return (
            f"--gpu-mib {options.gpu_mib} / --host-mib {options.host_mib}: the tier quotas cannot be allocated "
            f"on this machine ({error})"
        )
    message = flag_error(error)
    gpu_quota = re.match(r"GpuCacheTierConfig\.quota \d+ ", message)
    if gpu_quota is not None:
        (middle,) = typical_lengths([request.prompt_length + request.output_length for request in workload.requests], 1)
        lengths = "the trace's lengths" if options.trace is not None else "--max-prompt-len, --output-len"
        return (
            f"--gpu-mib {options.gpu_mib} is too small: it {message[gpu_quota.end() :]}; raise --gpu-mib, lower "
            f"--tokens-per-block or shorten the requests (the pools are planned for their lengths up to the "
            f"{TYPICAL_PERCENTILE}th percentile, median {middle:,} tokens: "
            f"{lengths})"
        )
    return message


def run_simulate(args: argparse.Namespace) -> int:
    sizes = check_trace_flags(args)
    options = check_options(args)
    _check_output_dir_files(args)
    sweep = check_sweep(args, options) if args.sweep is not None else None
    capacities = _capacity_points(options, sizes)
    start = time.perf_counter()
    workload = _load_workload(options)
    if capacities:
        values = [str(point.gpu_mib) for point in capacities]
        return _run_sweep(args, "capacity (GPU MiB)", values, capacities, workload)
    if sweep is not None:
        flag, values, points = sweep
        shared = workload if flag.removeprefix("--") in SAME_WORKLOAD_SWEEPS else None
        return _run_sweep(args, flag, values, points, shared)
    started: list[KVCacheManager] = []

    def on_start(manager: KVCacheManager) -> None:
        started.append(manager)
        if args.json != "-":
            _print_layout(options, manager)

    publishers: list[KVEventsPublisher] = []
    try:
        try:
            with Progress(len(workload.requests), bool(args.plain)) as progress:
                result: SimulationResult = simulate(
                    options, progress, on_start, workload, _kv_events_hook(args, publishers) if args.kv_events else None
                )
            if args.compare_no_reuse:
                baseline = dataclasses.replace(options, reuse=False)
                with Progress(len(workload.requests), bool(args.plain), "without prefix reuse") as progress:
                    try:
                        result.no_reuse = simulate(baseline, progress, None, workload)
                    except SimulationInterrupted as interrupted:
                        # The run with reuse is complete: its figures, not the baseline's partial ones as if they
                        # were the run's (they were: 0 finished, hit rate 0).
                        shown = "the run with reuse, complete"
                        _interrupted(interrupted.result, " of the run without prefix reuse", shown)
                        return _print_result(args, result, start, interrupted=shown)
        except SimulationInterrupted as interrupted:
            shown = "the figures so far"
            _interrupted(interrupted.result, "", shown)
            return _print_result(args, interrupted.result, start, interrupted=shown)
        except (ValueError, MemoryError, OSError) as error:
            if started:
                raise  # the manager was built: a failure of the run itself, not of the flags
            usage_error(_setup_error(error, options, workload))
    finally:
        for publisher in publishers:
            publisher.shutdown()
    status = _print_result(args, result, start)
    if status != 0:
        return status
    if result.finished == 0 and result.rejected > 0:
        slots = ", ".join(f"{pool.gpu_slots:,}" for pool in result.pool_groups)
        print(
            f"error: no request could be served: all {result.rejected:,} were rejected, each needing more GPU "
            f"slots alone than --gpu-mib {options.gpu_mib} gives ({slots} per pool group); raise --gpu-mib",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_output_dir_files(args: argparse.Namespace) -> None:
    """A file ``--output-dir`` writes that is a directory there is a usage error before the run, as ``--json FILE``
    is (the run went to its end, then "cannot write DIR/result.json (Is a directory)", status 1)."""
    for name in OUTPUT_DIR_FILES if args.output_dir is not None else ():
        path = os.path.join(str(args.output_dir), name)
        if os.path.isdir(path):
            usage_error(f"--output-dir {args.output_dir}: {path} is a directory, where the run writes its {name}")


def _capacity_points(options: SimulatorOptions, sizes: list[int]) -> list[SimulatorOptions]:
    """``--sweep-gpu-mib``'s runs, without and with the host tier, each checked as ``--gpu-mib`` is before any work
    (a quota past 64 bits was a ``ValueError`` traceback once the trace had loaded)."""
    points: list[SimulatorOptions] = []
    for size in sizes:
        for host in (0, options.host_mib):
            try:
                point = options.with_tiers(size, host)
                build_config(point, ".", ())
            except ValueError as error:
                usage_error(f"--sweep-gpu-mib {size}: {flag_error(error)}")
            points.append(point)
    return points


def _load_workload(options: SimulatorOptions) -> Workload:
    """The run's workload; a trace that is malformed or cannot be read (a file only root may read, an I/O error)
    is a usage error naming ``--trace`` (an unreadable one was a ``PermissionError`` / ``OSError`` traceback)."""
    try:
        return build_workload(options)
    except TraceFormatError as error:
        usage_error(f"--trace: {error}")
    except OSError as error:
        if options.trace is None:
            raise
        usage_error(f"--trace {options.trace}: cannot read it ({error.strerror or error})")


def _interrupted(partial: SimulationResult, during: str, shown: str) -> None:
    print(
        f"simulate: interrupted at step {partial.steps:,}{during} ({partial.finished:,} of {partial.num_requests:,} "
        f"requests finished); {shown}:",
        file=sys.stderr,
        flush=True,
    )


def _kv_events_hook(
    args: argparse.Namespace, publishers: list[KVEventsPublisher]
) -> Callable[[KVCacheManager], EventForward]:
    """Makes the run's publisher once the manager exists; it publishes after every step and sends
    ``AllBlocksCleared`` when the run ends (closed by ``run_simulate``)."""
    import zmq

    from ..kv_events import KVEventsPublisher

    def start(manager: KVCacheManager) -> EventForward:
        try:
            publisher = KVEventsPublisher(manager, str(args.kv_events), args.kv_events_replay, str(args.kv_events_topic))
        except zmq.ZMQError as error:  # an endpoint ZMQ cannot bind or connect: the flag's error, said in one line
            # ZMQ names the endpoint it refused (addr='...'): a bad --kv-events-replay was blamed on --kv-events.
            replay = args.kv_events_replay is not None and f"addr={args.kv_events_replay!r}" in str(error)
            flag, endpoint = ("--kv-events-replay", args.kv_events_replay) if replay else ("--kv-events", args.kv_events)
            raise ValueError(f"{flag} {endpoint}: {error}") from error
        publishers.append(publisher)
        print(f"publishing KV events on {publisher.endpoint}", file=sys.stderr, flush=True)
        time.sleep(DEFAULT_KV_EVENTS_WAIT if args.kv_events_wait is None else float(args.kv_events_wait))

        def forward(events: list[KVEvent]) -> None:
            publisher.publish_pending(events)

        return forward

    return start


def _text_writer(text: str) -> Callable[[str], None]:
    def write(path: str) -> None:
        # A file name that is not UTF-8 (Linux allows any bytes: --trace $'t\xff.jsonl') is in the tables as
        # Python decodes it, with a surrogate: summary.txt raised UnicodeEncodeError after the whole run. It is
        # written with the name's own bytes, as a terminal shows it.
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as file:
            file.write(text)

    return write


def _outputs(
    args: argparse.Namespace, report: dict[str, object], tables: str, plot: Callable[[str], None]
) -> tuple[list[str], str | None]:
    """Write what --json FILE, --plot and --output-dir ask for, each file whole or not at all; the paths written
    and, when one could not be (``OSError``), the error line naming its flag (the files after it are not tried)."""
    report_text = json.dumps(report, indent=2) + "\n"
    files: list[tuple[str, str, Callable[[str], None]]] = []
    if args.json not in (None, "-"):
        files.append(("--json", str(args.json), _text_writer(report_text)))
    if args.plot:
        files.append(("--plot", str(args.plot), plot))
    if args.output_dir is not None:
        directory = str(args.output_dir)
        report_file, summary_file, plot_file = (os.path.join(directory, name) for name in OUTPUT_DIR_FILES)
        files.append(("--output-dir", report_file, _text_writer(report_text)))
        files.append(("--output-dir", summary_file, _text_writer(tables + "\n")))
        if importlib.util.find_spec("matplotlib") is not None:
            files.append(("--output-dir", plot_file, plot))
    written: list[str] = []
    for flag, path, write in files:
        try:
            if flag == "--output-dir":
                os.makedirs(str(args.output_dir), exist_ok=True)
            write_whole(path, write)
        except OSError as error:
            return written, f"error: {flag}: cannot write {path} ({error.strerror or error}); it was not written"
        written.append(path)
    return written, None


def _report_outputs(written: list[str], failure: str | None, to_stdout: bool) -> int:
    """The files written (on stdout unless it holds the JSON report), then the failure if any: its status."""
    if to_stdout:
        for path in written:
            print(f"written: {path}")
    if failure is None:
        return 0
    print(failure, file=sys.stderr)
    return OUTPUT_FAILED_STATUS


def _print_result(
    args: argparse.Namespace, result: SimulationResult, start: float, interrupted: str | None = None
) -> int:
    """The tables (or --json's report) and the files asked for; an interrupted run (``interrupted``: what its
    figures are) writes no file and ends its stdout saying so, not "done" (stdout kept alone looked complete)."""
    report = result_json(result)
    if interrupted is not None:
        report["interrupted"] = True
    tables = summary_tables(result)
    written: list[str] = []
    failure: str | None = None
    if interrupted is None:
        written, failure = _outputs(args, report, render_plain(tables), lambda path: write_plot(result, path))
    if args.json == "-":
        print(json.dumps(report, indent=2))
        status = _report_outputs(written, failure, False)
        return status if interrupted is None else INTERRUPTED_STATUS
    print_tables(tables, plain=bool(args.plain))
    status = _report_outputs(written, failure, True)
    elapsed = time.perf_counter() - start
    if interrupted is None:
        print(f"done in {elapsed:.1f} s")
        return status
    unwritten = [flag for flag, value in (("--json", args.json), ("--plot", args.plot), ("--output-dir", args.output_dir))
                 if value is not None]
    print(f"interrupted after {elapsed:.1f} s, not a finished run: {interrupted}"
          + (f"; nothing written for {', '.join(unwritten)}" if unwritten else ""))
    return INTERRUPTED_STATUS


def _run_sweep(
    args: argparse.Namespace, parameter: str, values: list[str], points: list[SimulatorOptions], workload: Workload | None
) -> int:
    """One run per point on the same workload (or each point's own); a table, JSON or a plot."""
    start = time.perf_counter()
    results: list[SimulationResult] = []
    for value, point in zip(values, points):
        capacity = parameter.startswith("capacity")
        label = f"GPU {point.gpu_mib:,} MiB, host {point.host_mib:,} MiB" if capacity else f"{parameter} {value}"
        runs = workload
        started: list[KVCacheManager] = []
        try:
            build_config(point, ".", ())
            if runs is None:
                runs = _load_workload(point)
            with Progress(len(runs.requests), bool(args.plain), label) as progress:
                results.append(simulate(point, progress, started.append, runs))
        except (ValueError, MemoryError, OSError) as error:
            if started:
                raise  # the manager was built: a failure of the run itself, not of the flags (as in a single run)
            # The single run's words for a point's manager that cannot be built: a MemoryError or a quota too
            # small for the requests were a traceback or the config's field names.
            point_flag = f"--sweep {parameter[2:]}={value}"
            if capacity:
                point_flag = f"--sweep-gpu-mib {value} (host {point.host_mib:,} MiB)"
            usage_error(f"{point_flag}: {flag_error(error) if runs is None else _setup_error(error, point, runs)}")
        except SimulationInterrupted:  # the points finished so far, as a single run prints its figures so far
            print(f"simulate: interrupted during {label}; the {len(results):,} points finished:", file=sys.stderr,
                  flush=True)
            done = values[: len(results)]
            if args.json == "-":
                print(json.dumps({**sweep_json(parameter, done, results), "interrupted": True}, indent=2))
            else:
                if results:
                    print_tables([sweep_table(parameter, done, results)], plain=bool(args.plain))
                print(f"interrupted after {time.perf_counter() - start:.1f} s, not a finished sweep: the "
                      f"{len(results):,} points finished; nothing written")
            return 130
    report = sweep_json(parameter, values, results)
    table = sweep_table(parameter, values, results)
    numbers = [float(point.gpu_mib) if parameter.startswith("capacity") else float(value) for value, point in zip(values, points)]
    written, failure = _outputs(
        args, report, render_plain([table]), lambda path: write_sweep_plot(parameter, numbers, results, path)
    )
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return _report_outputs(written, failure, False)
    print_tables([table], plain=bool(args.plain))
    status = _report_outputs(written, failure, True)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return status
