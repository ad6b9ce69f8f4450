"""The command line's standard streams: one closed at start goes to /dev/null, text the output's encoding cannot
hold is written in ASCII words instead of raising (a non-UTF-8 locale, ``PYTHONIOENCODING=ascii``), and a reader
that left (``| head -1``) is told from a failure of the app's own pipes, so that every command stops the same
quiet way."""

from __future__ import annotations

import codecs
import io
import os
import select
import sys

# A process whose reader left: the shell's status for one killed by SIGPIPE.
CLOSED_OUTPUT_STATUS: int = 128 + 13
ENCODING_FALLBACK: str = "kv_cache_manager_v2.ascii_words"
# The characters the commands print outside ASCII, as ASCII that keeps their meaning (a unit stays a unit);
# anything else becomes "?".
ASCII_WORDS: dict[str, str] = {"µ": "u", "Δ": "delta ", "…": "...", "→": "->", "×": "x", "≤": "<=", "≥": ">="}


def _ascii_words(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    unencodable = error.object[error.start : error.end]
    return "".join(ASCII_WORDS.get(character, "?") for character in unencodable), error.end


codecs.register_error(ENCODING_FALLBACK, _ascii_words)


def prepare_streams() -> None:
    """stdout and stderr closed at start (``>&-``: Python makes them None, and ``sys.stdout.flush()`` raised) write
    to /dev/null; both write what their encoding cannot hold as ASCII words (``ASCII_WORDS``), not raise
    ``UnicodeEncodeError`` after the whole run."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors=ENCODING_FALLBACK)


def closed_outputs() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone; if so, those are pointed at /dev/null, so that
    neither the interpreter's last flush nor a message to stderr raises again."""
    closed: list[int] = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
        except (AttributeError, ValueError, OSError):  # replaced by one without a descriptor (a test's capture)
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            closed.append(fd)
    if not closed:
        return False
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in closed:
        os.dup2(null, fd)
    os.close(null)
    return True
