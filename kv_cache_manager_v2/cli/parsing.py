"""What every subcommand's parsing shares: usage errors as one line and exit status 2, and the version line."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from typing import NoReturn

from .. import COMPILED


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line (``error: ...``) and exit status 2, like every other usage error."""

    def error(self, message: str) -> NoReturn:
        usage_error(message)


def usage_error(message: str) -> NoReturn:
    """One line on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def version() -> str:
    """The installed version and whether the manager runs compiled (``--version``)."""
    try:
        number = importlib.metadata.version("kv_cache_manager_v2")
    except importlib.metadata.PackageNotFoundError:
        number = "(not installed)"
    return f"kv_cache_manager_v2 {number} ({'compiled' if COMPILED else 'interpreted'})"
