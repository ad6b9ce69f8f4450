"""Ctrl-C while the command line (``python -m kv_cache_manager_v2``, the ``kv-cache-manager-v2`` script) is still
importing the package: one line and status 130, as every later Ctrl-C of the command line, not a traceback from the
middle of an import. The package's ``__init__`` and ``__main__`` guard their imports with it; any other importer (an
engine, a test run, a REPL) keeps its ``KeyboardInterrupt``."""

from __future__ import annotations

import os
import signal
import sys
from typing import Final, NoReturn

INTERRUPTED_STATUS: Final = 130
PACKAGE: Final = "kv_cache_manager_v2"
SCRIPT: Final = "kv-cache-manager-v2"


def started_as_command() -> bool:
    """Whether this process is the command line: the console script, or ``python -m`` of the package (runpy sets
    ``sys.argv[0]`` to ``"-m"`` while it imports the package it is about to run)."""
    first = sys.argv[0] if sys.argv else ""
    if os.path.basename(first) == SCRIPT:
        return True
    original = list(getattr(sys, "orig_argv", ()))
    return first == "-m" and any(
        flag == "-m" and module in (PACKAGE, f"{PACKAGE}.__main__") for flag, module in zip(original, original[1:])
    )


def interrupted_while_starting() -> NoReturn:
    """End the command line interrupted during its imports: one line on stderr, status 130. SIGINT is ignored from
    here on, so a second Ctrl-C while the process exits prints no traceback either."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"{PACKAGE}: interrupted while starting", file=sys.stderr)
    raise SystemExit(INTERRUPTED_STATUS)
