"""The ``simulate`` subcommand's flags: the parser, and every usage check made before any work starts.

A usage error is one line on stderr naming the flag and its value, and exit status 2 (``usage_error``); the
parser's own errors (a non-number, an unknown flag) take the same form (``cli/parsing.py``'s ``OneLineParser``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import sys
import tempfile
from typing import Any

from .._storage.memory import cuda_device_available
from ..cli.parsing import usage_error
from .model_flags import add_model_flags, check_layer_flags, check_layer_sweep, model_from_args
from .options import MAX_CHUNK, SimulatorOptions, build_config, resolve_backend
from .presets import DEFAULT_PRESET, PRESET_NAMES
from .workload import MAX_MEAN_ARRIVAL_GAP
from .workload_size import MAX_REQUESTS

DEFAULTS = SimulatorOptions()
# typical_step lists --max-batch caches; far past any real engine's batch, planning alone would take minutes.
MAX_BATCH = 65_536
DEFAULT_KV_EVENTS_WAIT = 1.0  # seconds --kv-events waits after binding when --kv-events-wait is not given
SIMULATE_EPILOG = (
    "Exit status: 0 when the run finished; 1 when no request could be served (every one was rejected: the GPU quota "
    "cannot hold a single request alone, the reason is printed) or an output could not be written (a full disk: one "
    "line names it; a file is written whole or not at all); 2 on a usage error (one line on stderr naming the flag "
    "and its value, before any work starts); 130 when interrupted (Ctrl-C or SIGTERM), after printing the figures "
    "gathered so far (before the run: one line); 141, without a word, when the output's reader left early (| head)."
)
# --sweep PARAM=...: the flag's name -> the option it sets; values are ints unless listed in FLOAT_SWEEPS.
SWEEPS = {
    "gpu-mib": "gpu_mib", "host-mib": "host_mib", "disk-mib": "disk_mib", "max-batch": "max_batch", "chunk": "chunk",
    "tokens-per-block": "tokens_per_block", "ssm-interval": "ssm_interval", "requests": "num_requests", "seed": "seed",
    "max-prompt-len": "max_prompt_length", "turns": "max_turns", "shared-prefixes": "num_system_prompts",
    "arrival-rate": "mean_arrival_gap",
}
FLOAT_SWEEPS = ("arrival-rate",)
# Sweeps whose points share one workload (the others change the requests or their ideal hit rate).
SAME_WORKLOAD_SWEEPS = ("gpu-mib", "host-mib", "disk-mib", "max-batch", "ssm-interval")
# Sweeps that shape the seeded workload alone: over a replayed trace every point would be the same run.
SEEDED_WORKLOAD_SWEEPS = ("requests", "seed", "max-prompt-len", "turns", "shared-prefixes", "arrival-rate")
# SimulatorOptions / workload / KVCacheManagerConfig field -> the flag that sets it (for error messages).
FLAGS = {
    "KVCacheManagerConfig.tokens_per_block": "--tokens-per-block",
    "KVCacheManagerConfig.ssm_reuse_interval": "--ssm-interval", "num_requests": "--requests", "gpu_mib": "--gpu-mib",
    "host_mib": "--host-mib", "disk_mib": "--disk-mib", "max_batch": "--max-batch", "chunk": "--chunk",
    "prefill_chunk": "--chunk", "tokens_per_block": "--tokens-per-block", "trace_limit": "--trace-limit",
    "trace_speed": "--trace-speed", "max_prompt_length": "--max-prompt-len", "user_length": "--user-len",
    "long_user_length": "--long-user-len", "long_user_fraction": "--long-user-fraction",
    "output_length": "--output-len", "long_output_length": "--long-output-len",
    "long_output_fraction": "--long-output-fraction", "max_turns": "--turns", "num_system_prompts": "--shared-prefixes",
    "system_prompt_length": "--shared-prefix-len", "system_prompt_fraction": "--shared-prefix-fraction",
    "num_layers": "--layers", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim", "window": "--window",
    "full_every": "--full-every", "attention_every": "--attention-every",
}


def flag_error(error: Exception) -> str:
    """An option's error message in the flags' words."""
    message = str(error)
    for field, flag in FLAGS.items():
        message = re.sub(rf"(?<![\w.]){re.escape(field)}\b", flag, message)
    return message


def add_simulate_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """The ``simulate`` subcommand and its flags (``__main__.py`` puts it beside the others)."""
    simulate_parser = commands.add_parser(
        "simulate",
        help="run a continuous-batching serving simulation: a model preset or shape, a seeded workload or a trace",
        description="A continuous-batching serving loop over a seeded multi-turn workload or a replayed trace "
        "(--trace), on a model preset or a custom shape (--layers), with the FakeEngine "
        "checking every page's content on every step; describes the workload, then ends with a table of hit "
        "rates, memory, data movement, preemptions and the time spent inside the manager's calls.",
        epilog=SIMULATE_EPILOG,
    )
    add = simulate_parser.add_argument
    add("--preset", choices=PRESET_NAMES, default=None, help="model preset: llama: 32 full-attention layers "
        "(Llama-3-8B-like); gemma: 24 layers, a full-attention layer after every five with a 1,024-token sliding "
        "window (Gemma-like); hybrid-ssm: 4 full-attention layers among 24 Mamba-2 layers (Nemotron-H-like); fp16 K and V "
        f"(default {DEFAULT_PRESET})")
    add("--requests", type=int, default=None,
        help=f"requests in the seeded workload, 1 to {MAX_REQUESTS:,} (default {DEFAULTS.num_requests}; a "
        "trace: --trace-limit)")
    add("--seed", type=int, default=DEFAULTS.seed, help="workload seed (default %(default)s)")
    add("--gpu-mib", type=int, default=DEFAULTS.gpu_mib, help="GPU tier quota in MiB (default %(default)s)")
    add("--host-mib", type=int, default=DEFAULTS.host_mib, help="host tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-mib", type=int, default=DEFAULTS.disk_mib, help="disk tier quota in MiB, 0: none (default %(default)s)")
    add("--disk-dir", default=None, help="the disk tier's directory, its parent existing (default: a temporary one)")
    add("--tokens-per-block", type=int, default=DEFAULTS.tokens_per_block,
        help="tokens per block, the unit of paging and prefix reuse (default %(default)s)")
    add("--max-batch", type=int, default=DEFAULTS.max_batch,
        help=f"most running requests, at most {MAX_BATCH:,} (default %(default)s)")
    add("--chunk", type=int, default=DEFAULTS.chunk,
        help=f"prefill tokens per request per step, at most {MAX_CHUNK:,} (default %(default)s)")
    add("--scratch", action=argparse.BooleanOptionalAction, default=DEFAULTS.scratch,
        help="SWA scratch reuse for prefill chunks (KVCacheManagerConfig.enable_swa_scratch_reuse), on a model with "
        "sliding-window layers; it saves slots only for chunks longer than the window (gemma: 1,024), e.g. with "
        "--chunk 2048")
    add("--ssm-interval", type=int, default=DEFAULTS.ssm_interval,
        help="ssm_reuse_interval in tokens, on a model with SSM layers (default %(default)s)")
    add("--mamba-save-last-snapshot", action=argparse.BooleanOptionalAction, default=DEFAULTS.last_snapshot,
        help="on a model with SSM layers, also snapshot their states where each prompt's last full block ends (a "
        "prefill chunk stops there), so the next turn of a conversation resumes from its prompt's end "
        "(KVCacheManagerConfig.mamba_save_last_snapshot; 0 for --ssm-interval then turns periodic snapshots off)")
    add("--batch-admission", action=argparse.BooleanOptionalAction, default=DEFAULTS.batch_admission,
        help="admit each step's new requests with one create_kv_cache_batch call")
    add("--backend", choices=("auto", "cuda", "cpu"), default=DEFAULTS.backend,
        help="auto: cpu while content checks are on (each check reads pages back to the host: faster on cpu; "
        "--backend cuda checks on the GPU), else cuda when CuPy sees a GPU (default %(default)s)")
    add("--no-check", action="store_true", help="skip the FakeEngine's content checks (on by default)")
    add("--compare-no-reuse", action="store_true",
        help="run the same workload again with prefix reuse off (every request in a reuse scope of its own) and "
        "show what caching saved: computed tokens, steps, manager time")
    _add_output_flags(simulate_parser)
    _add_workload_flags(simulate_parser)
    add_model_flags(simulate_parser)
    _add_trace_flags(simulate_parser)
    _add_event_flags(simulate_parser)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    add = group.add_argument
    add("--json", metavar="FILE", nargs="?", const="-", default=None,
        help="every figure and the per-step timeline as one JSON object: alone, on stdout instead of the tables; "
        "with FILE, written there (the tables are printed too)")
    add("--plot", metavar="FILE.png", default=None,
        help="write memory (GPU, host, disk), preemptions and hit rate over time to a PNG file (matplotlib); "
        "checked before the run")
    add("--output-dir", metavar="DIR", default=None,
        help="write result.json, summary.txt and (with matplotlib) plot.png into DIR (created if missing)")
    add("--plain", action="store_true", help="plain-text tables and progress even when rich is installed")
    add("--sweep", metavar="PARAM=V1,V2,...", default=None, action="append",
        help="one run per value of one parameter, a table (and --plot) of the results; PARAM is one of "
        + ", ".join(SWEEPS))


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "workload shape", "The seeded workload: chats of several turns (each turn's prompt is the previous turn's "
        "prompt and answer plus new user tokens), some opening with a shared system prompt.")
    add = group.add_argument
    add("--max-prompt-len", type=int, default=DEFAULTS.max_prompt_length,
        help="longest prompt in tokens (default %(default)s)")
    for flag, field, what in (
        ("--user-len", "user_length", "new user tokens per turn"),
        ("--long-user-len", "long_user_length", "new user tokens of a long turn"),
        ("--output-len", "output_length", "generated tokens per turn"),
        ("--long-output-len", "long_output_length", "generated tokens of a long answer"),
        ("--shared-prefix-len", "system_prompt_length", "tokens of each shared system prompt"),
    ):
        low, high = getattr(DEFAULTS, field)
        add(flag, metavar="MIN,MAX", default=None, help=f"{what}, drawn uniformly (default {low},{high})")
    add("--long-user-fraction", type=float, default=DEFAULTS.long_user_fraction,
        help="share of long user turns (default %(default)s)")
    add("--long-output-fraction", type=float, default=DEFAULTS.long_output_fraction,
        help="share of long answers (default %(default)s)")
    add("--turns", type=int, default=DEFAULTS.max_turns, help="most turns per chat, drawn uniformly (default %(default)s)")
    add("--shared-prefixes", type=int, default=DEFAULTS.num_system_prompts,
        help="shared system prompts, 0: none (default %(default)s)")
    add("--shared-prefix-fraction", type=float, default=DEFAULTS.system_prompt_fraction,
        help="share of chats opening with a shared system prompt (default %(default)s)")
    add("--arrival-rate", type=float, default=1.0 / DEFAULTS.mean_arrival_gap,
        help="new chats per step on average (Poisson, with bursts); inf: all at step 0 (default %(default)s)")


def _add_trace_flags(parser: argparse.ArgumentParser) -> None:
    trace = parser.add_argument_group(
        "trace replay",
        "Replay a Mooncake-format trace (JSON Lines: timestamp ms, from 0 or since the Unix epoch, input_length, "
        "output_length, hash_ids of 512-token blocks) instead of the seeded workload, from its first request; the "
        "hit rate is compared with the trace's infinite-cache ideal.",
    )
    add = trace.add_argument
    add("--trace", metavar="FILE.jsonl", default=None, help="the trace to replay")
    add("--trace-limit", metavar="N", type=int, default=None, help="replay only the first N requests")
    add("--trace-speed", metavar="X", type=float, default=None,
        help="compress the trace's time X-fold (arrival step = (timestamp - the first request's) / X / 50 ms; "
        "default 1)")
    add("--closed-loop", action="store_true",
        help="ignore timestamps: every request is there from the start and --max-batch sets the pace")
    add("--bookkeeping", action="store_true",
        help="bookkeeping only, for large traces: no content checks, every buffer and quota divided by one "
        "power of two (same slot counts, page copies of a few bytes)")
    add("--sweep-gpu-mib", metavar="A,B,C", default=None,
        help="run once per GPU quota, without and with the --host-mib host tier; print and (--plot) plot the "
        "hit rate against GPU capacity")


def _add_event_flags(parser: argparse.ArgumentParser) -> None:
    events = parser.add_argument_group(
        "KV events",
        "Publish the run's KV events live in vLLM's ZMQ/msgpack format (needs the 'events' extra); watch them with "
        "`python -m kv_cache_manager_v2 events-listen ENDPOINT`.",
    )
    add = events.add_argument
    add("--kv-events", metavar="ENDPOINT", default=None, help="PUB endpoint, e.g. tcp://*:5557 or ipc:///tmp/kv")
    add("--kv-events-topic", metavar="T", default="", help="topic of every message (default: empty)")
    add("--kv-events-replay", metavar="ENDPOINT", default=None, help="ROUTER endpoint answering replay requests")
    add("--kv-events-wait", metavar="S", type=float, default=None,
        help="seconds to wait after binding, before the first step, so subscribers can connect (ZMQ drops "
        f"what a PUB socket sends before a subscriber has joined; default {DEFAULT_KV_EVENTS_WAIT:g})")


# ------------------------------------------------------------------------------------------------ checks
def _pair(args: argparse.Namespace, name: str) -> tuple[int, int] | None:
    text = getattr(args, name)
    if text is None:
        return None
    flag = "--" + name.replace("_", "-")
    match = re.fullmatch(r"\s*(-?\d+)\s*,\s*(-?\d+)\s*", str(text))
    if match is None:
        usage_error(f"{flag} {text}: give MIN,MAX token counts, e.g. 16,256")
    return int(match.group(1)), int(match.group(2))


def _check_arrival_rate(given: str, rate: float) -> None:
    if not 1.0 / MAX_MEAN_ARRIVAL_GAP <= rate:  # also NaN
        usage_error(
            f"{given}: give new chats per step from {1.0 / MAX_MEAN_ARRIVAL_GAP:g} (a chat every "
            f"{MAX_MEAN_ARRIVAL_GAP:,.0f} steps) to inf (all at once)"
        )


def options_from_args(args: argparse.Namespace) -> SimulatorOptions:
    """The options the flags give (``ValueError`` naming a field when they make no run)."""
    _check_arrival_rate(f"--arrival-rate {args.arrival_rate}", args.arrival_rate)
    return SimulatorOptions(
        preset=DEFAULT_PRESET if args.preset is None else str(args.preset),
        model=model_from_args(args),
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
        last_snapshot=bool(args.mamba_save_last_snapshot),
        batch_admission=bool(args.batch_admission),
        backend=str(args.backend),
        check=not (args.no_check or args.bookkeeping),
        max_prompt_length=int(args.max_prompt_len),
        user_length=_pair(args, "user_len") or DEFAULTS.user_length,
        long_user_length=_pair(args, "long_user_len") or DEFAULTS.long_user_length,
        output_length=_pair(args, "output_len") or DEFAULTS.output_length,
        long_output_length=_pair(args, "long_output_len") or DEFAULTS.long_output_length,
        system_prompt_length=_pair(args, "shared_prefix_len") or DEFAULTS.system_prompt_length,
        long_output_fraction=float(args.long_output_fraction),
        long_user_fraction=float(args.long_user_fraction),
        max_turns=int(args.turns),
        num_system_prompts=int(args.shared_prefixes),
        system_prompt_fraction=float(args.shared_prefix_fraction),
        mean_arrival_gap=0.0 if math.isinf(args.arrival_rate) else 1.0 / float(args.arrival_rate),
        trace=None if args.trace is None else str(args.trace),
        trace_limit=None if args.trace_limit is None else int(args.trace_limit),
        trace_speed=1.0 if args.trace_speed is None else float(args.trace_speed),
        closed_loop=bool(args.closed_loop),
        bookkeeping=bool(args.bookkeeping),
    )


def check_trace_flags(args: argparse.Namespace) -> list[int]:
    """Usage errors among the trace flags; the capacity sweep's GPU quotas (empty without one)."""
    if args.trace is None:
        for flag, value in (("--trace-limit", args.trace_limit), ("--trace-speed", args.trace_speed),
                            ("--closed-loop", args.closed_loop or None)):
            if value is not None:
                usage_error(f"{flag} needs --trace")
    else:
        if args.requests is not None:
            usage_error("--requests sets the seeded workload's size; with --trace use --trace-limit")
        ignored = _seeded_workload_flags(args)
        if ignored:
            verb = "shapes" if len(ignored) == 1 else "shape"
            usage_error(f"{', '.join(ignored)} {verb} the seeded workload, which --trace replaces: drop them")
        if args.closed_loop and args.trace_speed is not None:
            usage_error("--closed-loop ignores timestamps: drop --trace-speed")
        if not os.path.exists(str(args.trace)):
            usage_error(f"--trace {args.trace}: no such file")
        if not os.path.isfile(str(args.trace)):
            usage_error(f"--trace {args.trace}: not a regular file (a directory, a device or a pipe): give a JSONL file")
        _check_outputs_spare_the_trace(args)
    if args.sweep_gpu_mib is None:
        return []
    try:
        sizes = [int(part) for part in str(args.sweep_gpu_mib).split(",")]
    except ValueError:
        usage_error(f"--sweep-gpu-mib must be comma-separated MiB counts, got {args.sweep_gpu_mib!r}")
    if not sizes or any(size < 1 for size in sizes):
        usage_error(f"--sweep-gpu-mib must be MiB counts >= 1, got {args.sweep_gpu_mib!r}")
    if args.host_mib <= 0:
        usage_error("--sweep-gpu-mib compares runs without and with a host tier: give --host-mib > 0")
    if len(set(sizes)) < len(sizes):
        usage_error(f"--sweep-gpu-mib {args.sweep_gpu_mib}: a quota given twice")
    if args.gpu_mib != _simulate_defaults()["gpu_mib"]:  # as for --sweep: each run would replace it
        usage_error(f"--sweep-gpu-mib sets --gpu-mib in every run: drop --gpu-mib {args.gpu_mib}")
    return sizes


def _check_outputs_spare_the_trace(args: argparse.Namespace) -> None:
    """``--trace run.json --json run.json`` replaced the trace with the run's report, after the whole run."""
    outputs = [("--json", args.json), ("--plot", args.plot)]
    if args.output_dir is not None:
        outputs += [("--output-dir", os.path.join(str(args.output_dir), name))
                    for name in ("result.json", "summary.txt", "plot.png")]
    for flag, path in outputs:
        if path not in (None, "-") and os.path.exists(str(path)) and os.path.samefile(str(path), str(args.trace)):
            usage_error(f"{flag} {path}: that is the --trace file, which the run would overwrite: give another path")


def _seeded_workload_flags(args: argparse.Namespace) -> list[str]:
    """The seeded workload's flags given another value than their default: a replayed trace ignored them
    without a word (``--trace T --seed 5 --user-len 5,6`` ran the trace as it is)."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--seed", type=int, default=DEFAULTS.seed)
    _add_workload_flags(probe)
    defaults = vars(probe.parse_args([]))
    return ["--" + dest.replace("_", "-") for dest, default in defaults.items() if getattr(args, dest) != default]


def _simulate_defaults() -> dict[str, Any]:
    """Every simulate flag's default, by its argparse name."""
    commands = argparse.ArgumentParser(add_help=False).add_subparsers()
    add_simulate_parser(commands)
    return vars(commands.choices["simulate"].parse_args([]))


def check_output_file(flag: str, path: str, suffix: str) -> None:
    """An output file the run can create, found now and not after the whole run."""
    if path == "-":
        usage_error(f"{flag} -: give a file name ending in {suffix}")
    if os.path.isdir(path):
        usage_error(f"{flag} {path}: is a directory: give a file name ending in {suffix}")
    if not path.lower().endswith(suffix):
        usage_error(f"{flag} {path}: give a file name ending in {suffix}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        usage_error(f"{flag} {path}: directory {directory} does not exist")
    if os.path.exists(path):
        if not (os.path.isfile(path) and os.access(path, os.W_OK)):
            usage_error(f"{flag} {path}: not a writable file")
        return
    try:
        with open(path, "xb"):
            pass
        os.remove(path)
    except OSError as error:
        usage_error(f"{flag} {path}: cannot create the file: {error.strerror}")


def _check_directory(flag: str, path: str) -> None:
    """A directory the run writes in (``--output-dir``, ``--disk-dir``): created if missing, but not its parent."""
    if os.path.exists(path) and not os.path.isdir(path):
        usage_error(f"{flag} {path}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        usage_error(f"{flag} {path}: directory {parent} does not exist")
    # Tried, not asked: os.access answers yes to root for a read-only filesystem (/proc), and the run would end
    # in a traceback after all its work.
    created = not os.path.isdir(path)
    try:
        if created:
            os.mkdir(path)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        usage_error(f"{flag} {path}: not writable: {error.strerror}")
    finally:
        if created and os.path.isdir(path):
            os.rmdir(path)


def check_sweep(args: argparse.Namespace, options: SimulatorOptions) -> tuple[str, list[str], list[SimulatorOptions]]:
    """``--sweep PARAM=V1,V2,...``: the flag, the values as given and one checked options object per value."""
    if len(args.sweep) > 1:  # argparse kept the last one: the others were dropped without a word
        usage_error(f"--sweep {' --sweep '.join(args.sweep)}: one --sweep per command (one parameter varies)")
    text = str(args.sweep[0])
    name, _, values_text = text.partition("=")
    name = name.strip().removeprefix("--")
    if name not in SWEEPS:
        usage_error(f"--sweep {text}: PARAM must be one of {', '.join(SWEEPS)}")
    given = getattr(args, name.replace("-", "_"))
    if given != _simulate_defaults()[name.replace("-", "_")]:  # each point would replace it without a word
        usage_error(f"--sweep {text} sets --{name} in every run: drop --{name} {given}")
    if args.sweep_gpu_mib is not None:
        usage_error("--sweep and --sweep-gpu-mib are two sweeps: give one")
    check_layer_sweep(args, options, text, SWEEPS[name])
    if options.trace is not None and name in SEEDED_WORKLOAD_SWEEPS:
        usage_error(f"--sweep {text}: --{name} shapes the seeded workload, which --trace replaces; sweep one of "
                    f"{', '.join(sweep for sweep in SWEEPS if sweep not in SEEDED_WORKLOAD_SWEEPS)}")
    values = [value.strip() for value in values_text.split(",") if value.strip()]
    if not values:
        usage_error(f"--sweep {text}: give PARAM=V1,V2,... with at least one value")
    points: list[SimulatorOptions] = []
    numbers: list[float] = []
    for value in values:
        try:
            number = float(value) if name in FLOAT_SWEEPS else int(value)
        except ValueError:
            usage_error(f"--sweep {text}: {value!r} is not {'a number' if name in FLOAT_SWEEPS else 'an integer'}")
        if number in numbers:  # a second run of the same point
            usage_error(f"--sweep {text}: {value} twice")
        numbers.append(number)
        if name == "arrival-rate":
            _check_arrival_rate(f"--sweep {text}: --arrival-rate {value}", number)
            number = 0.0 if math.isinf(number) else 1.0 / number
        try:
            change: dict[str, Any] = {SWEEPS[name]: number}  # the swept field, by name
            point = dataclasses.replace(options, **change)
            build_config(point, ".", ())
        except ValueError as error:
            usage_error(f"--sweep {name}={value}: {flag_error(error)}")
        points.append(point)
    return "--" + name, values, points


def check_options(args: argparse.Namespace) -> SimulatorOptions:
    """The options from the flags, every usage error found before any work starts."""
    if args.max_batch > MAX_BATCH:
        usage_error(f"--max-batch {args.max_batch}: at most {MAX_BATCH:,}")
    try:
        options = options_from_args(args)
        check_layer_flags(args, options)  # before the config's checks of those flags, which assume they apply
        build_config(options, ".", ())  # validates the manager config before any work
    except ValueError as error:
        usage_error(flag_error(error))
    if args.disk_dir is not None and options.disk_mib == 0:
        usage_error("--disk-dir needs --disk-mib (the disk tier's quota)")
    if args.disk_dir is not None:
        _check_directory("--disk-dir", str(args.disk_dir))
    if resolve_backend(options) == "cuda" and not cuda_device_available():
        usage_error(f"--backend {args.backend}: CuPy sees no CUDA device here; use --backend cpu")
    if args.plot:
        check_output_file("--plot", str(args.plot), ".png")
        if importlib.util.find_spec("matplotlib") is None:
            usage_error("--plot needs matplotlib: pip install 'kv_cache_manager_v2[cli]'")
    if args.json not in (None, "-"):
        check_output_file("--json", str(args.json), ".json")
    if args.output_dir is not None:
        _check_directory("--output-dir", str(args.output_dir))
    if args.compare_no_reuse and (args.sweep is not None or args.sweep_gpu_mib is not None):
        usage_error("--compare-no-reuse compares one run: drop the sweep")
    _check_kv_events(args)
    return options


def _check_kv_events(args: argparse.Namespace) -> None:
    if args.kv_events is None:
        if args.kv_events_replay is not None or args.kv_events_topic or args.kv_events_wait is not None:
            usage_error("--kv-events-topic, --kv-events-replay and --kv-events-wait need --kv-events ENDPOINT")
        return
    sweep = "--sweep-gpu-mib" if args.sweep_gpu_mib is not None else "--sweep" if args.sweep is not None else None
    if sweep is not None:
        usage_error(f"--kv-events publishes one run; it does not go with {sweep}")
    if args.kv_events_wait is not None and not 0.0 <= args.kv_events_wait <= 3600.0:  # also NaN
        usage_error(f"--kv-events-wait {args.kv_events_wait}: seconds from 0 to 3600")
    for module in ("zmq", "msgspec"):
        if importlib.util.find_spec(module) is None:
            usage_error(f"--kv-events needs the 'events' extra ({module} is missing): pip install '.[events]'")
    from ..kv_events.publisher import check_tcp_port  # imports zmq, found above

    for flag, endpoint in (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay or "")):
        try:
            check_tcp_port(str(endpoint), flag)
        except ValueError as error:
            usage_error(str(error))
