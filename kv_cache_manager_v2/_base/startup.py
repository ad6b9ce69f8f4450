"""Ctrl-C while the command line (``python -m kv_cache_manager_v2``, the ``kv-cache-manager-v2`` script) is still
importing the package: one line and status 130, as every later Ctrl-C of the command line, not a traceback from the
middle of an import. The package's ``__init__`` and ``__main__`` guard their imports with it; any other importer (an
engine, a test run, a REPL) keeps its ``KeyboardInterrupt``."""

from __future__ import annotations

import os
import signal
import sys
import threading
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
    if signal.getsignal(signal.SIGTERM) is signal.default_int_handler:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"{PACKAGE}: interrupted while starting", file=sys.stderr)
    raise SystemExit(INTERRUPTED_STATUS)


def terminate_as_interrupt() -> None:
    """Make SIGTERM (``kill``, a supervisor) raise ``KeyboardInterrupt`` as Ctrl-C does, so that the command line
    stops the same way on either from its first import on (one line, or simulate's figures so far, status 130)
    rather than ending with -15 and nothing said while it starts or loads a trace. Only the default is replaced,
    on the main thread: a SIGTERM the parent ignored stays ignored."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
