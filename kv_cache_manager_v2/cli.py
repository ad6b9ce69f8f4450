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
import sys
import time
from functools import partial
from typing import Protocol, Sequence, cast

from ._manager import KVCacheManager
from .models.generate_cli import add_generate_parser, run_generate
from .presets import DEFAULT_PRESET, PRESET_NAMES
from .report import describe_layout, print_tables, result_json, summary_tables, write_plot
from .simulator import SimulationResult, SimulationSetupError, SimulatorOptions, build_config, simulate

DEFAULTS = SimulatorOptions()
# Not ``__doc__``: compiled by mypyc, a module's ``__doc__`` reads as None.
DESCRIPTION = (
    "kv_cache_manager_v2 command line; `simulate` runs the serving simulator (SPEC §10), `generate` a real model "
    "(SPEC §12)."
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
    )
    add = simulate_parser.add_argument
    add("--preset", choices=PRESET_NAMES, default=DEFAULT_PRESET, help="model preset (default %(default)s)")
    add("--requests", type=int, default=DEFAULTS.num_requests, help="requests in the workload (default %(default)s)")
    add("--seed", type=int, default=DEFAULTS.seed, help="workload seed (default %(default)s)")
    add("--gpu-mib", type=int, default=DEFAULTS.gpu_mib, help="GPU tier quota in MiB (default %(default)s)")
    add("--host-mib", type=int, default=DEFAULTS.host_mib, help="host tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-mib", type=int, default=DEFAULTS.disk_mib, help="disk tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-dir", default=None, help="directory for the disk tier's files (default: a temporary directory)")
    add("--tokens-per-block", type=int, default=DEFAULTS.tokens_per_block, help="default %(default)s")
    add("--max-batch", type=int, default=DEFAULTS.max_batch, help="most running requests (default %(default)s)")
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
    add("--plot", metavar="FILE.png", default=None, help="write memory and hit rate over time to a PNG (matplotlib)")
    add("--no-check", action="store_true", help="skip the FakeEngine's content checks (on by default)")
    add("--plain", action="store_true", help="plain-text tables and progress even when rich is installed")
    add_generate_parser(commands)
    return parser


def options_from_args(args: argparse.Namespace) -> SimulatorOptions:
    return SimulatorOptions(
        preset=str(args.preset),
        num_requests=int(args.requests),
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
        check=not args.no_check,
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
    """Requests done out of the total: a rich progress bar on stderr, or a plain line every 10%."""

    def __init__(self, total: int, plain: bool) -> None:
        self.total = total
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
        progress_type = cast(_RichProgressType, getattr(progress_module, "Progress"))
        count_column = cast(_ColumnType, getattr(progress_module, "MofNCompleteColumn"))
        text_column = cast(_ColumnType, getattr(progress_module, "TextColumn"))
        self.bar = progress_type(
            *progress_type.get_default_columns(),
            count_column(),
            text_column("{task.fields[detail]}"),
            console=console_type(stderr=True),
            transient=True,
        )

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("simulating", total=self.total, detail="")
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
            print(f"simulate: {done}/{total} requests done, step {step}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- commands
def _print_layout(options: SimulatorOptions, manager: KVCacheManager) -> None:
    print(f"preset {options.preset}: planned layout")
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
}


def _flag_error(error: ValueError) -> str:
    message = str(error)
    for field, flag in FLAGS.items():
        if message.startswith(field + " "):
            return flag + message[len(field) :]
    return message


def run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        options = options_from_args(args)
        build_config(options, ".", 1)  # validates the manager config before any work
    except ValueError as error:
        parser.error(_flag_error(error))
    if args.disk_dir is not None and options.disk_mib == 0:
        parser.error("--disk-dir needs --disk-mib (the disk tier's quota)")
    if args.plot:
        directory = os.path.dirname(os.path.abspath(str(args.plot)))
        if not os.path.isdir(directory):
            parser.error(f"--plot {args.plot}: directory {directory} does not exist")
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install 'kv_cache_manager_v2[cli]'")
    start = time.perf_counter()
    on_start = None if args.json else partial(_print_layout, options)
    try:
        with Progress(options.num_requests, bool(args.plain)) as progress:
            result: SimulationResult = simulate(options, progress, on_start)
    except SimulationSetupError as error:
        parser.error(str(error))
    if args.plot:
        write_plot(result, str(args.plot))
    if args.json:
        print(json.dumps(result_json(result), indent=2))
    else:
        print_tables(summary_tables(result), plain=bool(args.plain))
        if args.plot:
            print(f"plot written to {args.plot}")
        print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return run_simulate(args, parser)
    if args.command == "generate":
        return run_generate(args, parser)
    return 2
