"""Output files written whole or not at all (``simulate --json FILE``, ``--plot``, ``--output-dir``): into a hidden
temporary beside the target, renamed over it once complete, the temporary removed on every way out that runs
Python code: an exception, Ctrl-C, and SIGTERM (turned into an exception while the file is written, then sent
again, so that the process still ends as killed by it)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Callable, Iterator


class _Terminated(BaseException):
    """SIGTERM arrived while a file was being written: unwinds to the temporary's removal."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` inside the block (only where its default would have killed the process
    without running any code: the main thread, no handler of the embedding program's); on leaving the block with
    it, the default is restored and SIGTERM sent again."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_whole(path: str, write: Callable[[str], None]) -> None:
    """``write(file)`` into a new file beside ``path``, renamed over it once complete: a full disk or a kill midway
    left a cut-off result.json (or half of an earlier one overwritten) that looked like a result. Through a
    symbolic link to its target; a device or a FIFO is written in place (it cannot be renamed over)."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        write(target)
        return
    directory, name = os.path.split(target)
    stem, suffix = os.path.splitext(name)
    partial = os.path.join(directory, f".{stem}.partial-{os.getpid()}{suffix}")  # the suffix: matplotlib's format
    with _sigterm_unwinds():
        try:
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # as open(path, "w"): the umask
            write(partial)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):  # not created yet, or already renamed
                os.unlink(partial)
            raise
