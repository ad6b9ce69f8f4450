"""``python -m kv_cache_manager_v2`` (and the ``kv-cache-manager-v2`` script): one parser holding every subcommand,
and the dispatch to the app that runs it (``simulate``: ``sim/cli.py``; ``generate`` and ``disagg-demo``:
``models``; ``events-listen``: ``kv_events/listen.py``, with its own parser). The entry point is the top layer:
it alone sees every app."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kv_cache_manager_v2._base.startup import INTERRUPTED_STATUS, interrupted_while_starting, started_as_command

# Ctrl-C while the apps are imported: one line and status 130, as the package's own imports (``_base/startup.py``).
try:
    from kv_cache_manager_v2.models.disagg_demo import add_disagg_demo_parser, run_disagg_demo
    from kv_cache_manager_v2.models.generate_cli import add_generate_parser, run_generate
    from kv_cache_manager_v2.sim.cli import run_simulate
    from kv_cache_manager_v2.sim.flags import add_simulate_parser
    from kv_cache_manager_v2.cli.parsing import OneLineParser, version
    from kv_cache_manager_v2.cli.streams import (
        CLOSED_OUTPUT_STATUS, OUTPUT_FAILED_STATUS, OutputWriteError, closed_outputs, discard_stdout, prepare_streams,
        stop_if_reader_left,
    )
except KeyboardInterrupt:
    if __name__ == "__main__" or started_as_command():
        interrupted_while_starting()
    raise

DESCRIPTION = (
    "kv_cache_manager_v2 command line; `simulate` runs the serving simulator, `generate` a real model through the "
    "manager's pages, `disagg-demo` a prefill -> decode handoff, `events-listen` prints a publisher's KV events."
)
EPILOG = (
    "python -m kv_cache_manager_v2 COMMAND --help lists the flags of that command. Every command exits 141, "
    "without a word, when its output's reader leaves early (| head); text the output's encoding cannot hold is "
    "written in ASCII (µs: us)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m kv_cache_manager_v2", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(commands)
    add_generate_parser(commands)
    add_disagg_demo_parser(commands)
    # Listed here only: ``main`` hands its arguments to its own parser before this one runs.
    commands.add_parser(
        "events-listen",
        help="subscribe to vLLM-format KV events (simulate --kv-events, KVEventsPublisher) and print each batch "
        "decoded (the 'events' extra)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prepare_streams()
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(arguments)
    except BrokenPipeError:
        if not closed_outputs():
            raise  # a pipe of the app's own (a child process, a socket): a real failure
        return CLOSED_OUTPUT_STATUS
    except OutputWriteError as error:
        # ``> /dev/full``, a full disk: the results are lost, said in one line, not a traceback; what is still
        # buffered goes nowhere, or the interpreter's last flush would raise again.
        discard_stdout()
        print(f"error: stdout: cannot write the output ({error.strerror}); nothing more was printed",
              file=sys.stderr)
        return OUTPUT_FAILED_STATUS
    except KeyboardInterrupt:
        # Every command stops on Ctrl-C or SIGTERM (_base/startup.py) the same way: one line and status 130
        # (simulate first prints its partial summary, sim/cli.py; this is the rest: generate, disagg-demo, a lazy
        # import, simulate's set-up and trace loading).
        command = arguments[0] if arguments and not arguments[0].startswith("-") else "kv_cache_manager_v2"
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS


def _dispatch(arguments: list[str]) -> int:
    if arguments[:1] == ["events-listen"]:  # its own parser (no app imported)
        from kv_cache_manager_v2.kv_events.listen import main as listen_main

        return listen_main(arguments[1:], check_output=stop_if_reader_left)  # stops as simulate does at `| head`
    parser = build_parser()
    args = parser.parse_args(arguments)
    if args.command == "simulate":
        return run_simulate(args)
    if args.command == "generate":
        return run_generate(args, parser)
    if args.command == "disagg-demo":
        return run_disagg_demo(args, parser)
    return 2


if __name__ == "__main__":
    sys.exit(main())
