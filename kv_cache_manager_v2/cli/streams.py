"""The command line's standard streams: one closed at start goes to /dev/null, text the output's encoding cannot
hold is written in ASCII words instead of raising (a non-UTF-8 locale, ``PYTHONIOENCODING=ascii``), a reader
that left (``| head -1``) is told from a failure of the app's own pipes, so that every command stops the same
quiet way, and a stdout that cannot be written (``> /dev/full``) raises its own error, said in one line."""

from __future__ import annotations

import codecs
import errno
import io
import os
import select
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

# A process whose reader left: the shell's status for one killed by SIGPIPE.
CLOSED_OUTPUT_STATUS: int = 128 + 13
# An output that could not be written (stdout on a full disk, a --json FILE): the run's results are lost.
OUTPUT_FAILED_STATUS: int = 1
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


class OutputWriteError(OSError):
    """stdout could not take what was printed (``> /dev/full``, a full disk, an I/O error): the run's output is
    lost, which the command says in one line (``__main__.py``), told apart from a failure of the app's own files."""


class _StdoutFile(io.FileIO):
    """stdout's descriptor, whose write failures raise ``OutputWriteError`` (a reader that left stays a
    ``BrokenPipeError``: ``closed_outputs``)."""

    def write(self, data: ReadableBuffer, /) -> int:
        try:
            return super().write(data)
        except BrokenPipeError:
            raise
        except OSError as error:
            raise OutputWriteError(error.errno, error.strerror) from error


# The streams ``prepare_streams`` replaced, kept open for the process's life.
_REPLACED: list[io.TextIOWrapper] = []


def _failures_told(stream: io.TextIOWrapper) -> io.TextIOWrapper:
    """The same stream (descriptor, encoding, buffering) over ``_StdoutFile``."""
    stream.flush()
    raw = _StdoutFile(stream.fileno(), "w", closefd=False)
    # Unbuffered (``python -u``, PYTHONUNBUFFERED) stays unbuffered: the text layer sits on the file itself.
    binary: io.FileIO | io.BufferedWriter = raw if isinstance(stream.buffer, io.FileIO) else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary, encoding=stream.encoding, errors=stream.errors,
        line_buffering=stream.line_buffering, write_through=stream.write_through,
    )


def prepare_streams() -> None:
    """stdout's write failures raise ``OutputWriteError``; stdout and stderr closed at start (``>&-``: Python makes
    them None, and ``sys.stdout.flush()`` raised) write to /dev/null; both write what their encoding cannot hold
    as ASCII words (``ASCII_WORDS``), not raise ``UnicodeEncodeError`` after the whole run."""
    stdout = sys.stdout
    if isinstance(stdout, io.TextIOWrapper) and type(getattr(stdout.buffer, "raw", stdout.buffer)) is io.FileIO:
        _REPLACED.append(stdout)  # it owns the descriptor: collected, it would close it
        sys.stdout = _failures_told(stdout)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors=ENCODING_FALLBACK)


def discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what the failed stream still buffers goes nowhere at exit."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _readers_gone() -> list[int]:
    """The descriptors of stdout and stderr that are pipes whose reader has gone (``poll`` says ``POLLERR`` of a
    pipe with no reader; a file or a terminal never does)."""
    gone: list[int] = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
        except (AttributeError, ValueError, OSError):  # replaced by one without a descriptor (a test's capture)
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            gone.append(fd)
    return gone


def stop_if_reader_left() -> None:
    """Raise ``BrokenPipeError`` when stdout's or stderr's reader has gone (``| head -5`` after the layout), so
    that a long run stops at once, as a failed write would stop it, instead of at its first write at the end."""
    if _readers_gone():
        raise BrokenPipeError(errno.EPIPE, "the output's reader left")


def closed_outputs() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone; if so, those are pointed at /dev/null, so that
    neither the interpreter's last flush nor a message to stderr raises again."""
    closed = _readers_gone()
    if not closed:
        return False
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in closed:
        os.dup2(null, fd)
    os.close(null)
    return True
