"""SIGTERM (``kill``, a supervisor) at any point of the command line ends it as Ctrl-C does: one line and status
130. Only the run held it (its figures so far, ``test_cli_streams``); while the package was imported, the manager
built or a trace loaded, the process died by the signal (status -15) without a word."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kv_cache_manager_v2.batching.interrupts import StepBoundaryInterrupts
from tests.test_cli import IMPORT_ROOT
from tests.test_cli_streams import interrupted_at_import

# Lines of the trace the test stops while it loads (~20 s to load on a loaded 2-core machine; stopped at once).
TRACE_LINES = 200_000


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux: its /proc/PID/fd links)."""
    directory = f"/proc/{pid}/fd"
    try:
        descriptors = os.listdir(directory)
    except FileNotFoundError:
        return False
    for descriptor in descriptors:
        try:
            if os.readlink(os.path.join(directory, descriptor)) == str(path):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def test_sigterm_while_a_trace_loads_prints_one_line(tmp_path: Path) -> None:
    """Before: status -15 and an empty stderr."""
    trace = tmp_path / "trace.jsonl"
    line = json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}) + "\n"
    trace.write_text(line * TRACE_LINES)
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--no-check",
         "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=IMPORT_ROOT,
        env=dict(os.environ, PYTHONPATH=IMPORT_ROOT),
    )
    while not holds_open(process.pid, trace.resolve()):  # polls until the loader has the trace open
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)  # pacing only: the child shares the machine's cores
    process.send_signal(signal.SIGTERM)
    output, errors = process.communicate(timeout=120)
    assert (process.returncode, errors, output) == (130, "simulate: interrupted\n", "")


def test_sigterm_while_the_command_line_imports_prints_one_line(tmp_path: Path) -> None:
    """Before: status -15, nothing on stderr past the pausing hook's line."""
    status, stdout, stderr = interrupted_at_import(
        tmp_path, "numpy", "simulate", "--backend", "cpu", "--requests", "2", signum=signal.SIGTERM
    )
    assert (status, stderr, stdout) == (130, "kv_cache_manager_v2: interrupted while starting\n", "")


def test_the_command_lines_sigterm_waits_for_the_step_boundary_in_every_app() -> None:
    """``generate`` holds Ctrl-C until its step ends (``StepBoundaryInterrupts()``, no ``terminate``); the command
    line's SIGTERM, an interrupt now, must be held alike, or it lands inside a manager call. Before: the
    KeyboardInterrupt came out of ``os.kill`` itself."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with StepBoundaryInterrupts() as interrupts:
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupts.pending
            with pytest.raises(KeyboardInterrupt):
                interrupts.check()
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
