"""``python -m kv_cache_manager_v2``: one parser holding every subcommand, and the dispatch to the app that runs it
(``simulate``: ``sim/cli.py``; ``generate`` and ``disagg-demo``: ``models``). ``events-listen`` has its own parser
(``kv_events/listen.py``, dispatched by ``__main__.py``)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..models.disagg_demo import add_disagg_demo_parser, run_disagg_demo
from ..models.generate_cli import add_generate_parser, run_generate
from ..sim.cli import run_simulate
from ..sim.flags import add_simulate_parser
from .parsing import OneLineParser, version

DESCRIPTION = (
    "kv_cache_manager_v2 command line; `simulate` runs the serving simulator (SPEC §10), `generate` a real model "
    "(SPEC §12)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m kv_cache_manager_v2", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(commands)
    add_generate_parser(commands)
    add_disagg_demo_parser(commands)
    return parser


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
    if args.command == "disagg-demo":
        return run_disagg_demo(args, parser)
    return 2
