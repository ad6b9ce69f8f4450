"""``events-listen ENDPOINT | head``: a reader that leaves while the publisher is idle stops the listener within
``OUTPUT_CHECK_MS``, quietly and with the shell's SIGPIPE status, as ``simulate`` stops at its progress check
(``cli/streams.stop_if_reader_left``). Before, it waited for the next batch (forever, from an idle publisher) and
stopped only at the write after it."""

from __future__ import annotations

import os
import subprocess
import sys
import select
from pathlib import Path

import pytest

from tests.events_helpers import ipc_endpoint, require_events_extra

require_events_extra()

from kv_cache_manager_v2.cli.streams import CLOSED_OUTPUT_STATUS  # noqa: E402
from kv_cache_manager_v2.kv_events.listen import OUTPUT_CHECK_MS, listen  # noqa: E402
from kv_cache_manager_v2.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import EventSubscriber  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import AllBlocksCleared  # noqa: E402
from tests.helpers import status_once_reader_left  # noqa: E402
from tests.test_cli import IMPORT_ROOT  # noqa: E402

# A listener still alive this long after its reader left (and the publisher went quiet) did not notice it.
NOTICED_WITHIN_S = 60


def test_a_listener_waiting_without_limit_checks_its_output_between_waits() -> None:
    """No publisher, no ``--timeout``: the wait is cut into slices with a check before each; the third check
    finds the reader gone and its ``BrokenPipeError`` ends the listener."""
    subscriber = EventSubscriber(ipc_endpoint("idle"), "")
    checks: list[int] = []

    def check_output() -> None:
        checks.append(len(checks))
        if len(checks) == 3:
            raise BrokenPipeError("the output's reader left")

    try:
        with pytest.raises(BrokenPipeError):
            listen(subscriber, None, None, sys.stdout, check_output)
    finally:
        subscriber.close()
    assert checks == [0, 1, 2]


def test_a_timeout_still_ends_the_wait_when_the_output_is_checked() -> None:
    subscriber = EventSubscriber(ipc_endpoint("idle"), "")
    checks: list[int] = []
    try:
        assert listen(subscriber, None, 2.5 * OUTPUT_CHECK_MS / 1000, sys.stdout, lambda: checks.append(1)) == 0
    finally:
        subscriber.close()
    assert len(checks) >= 3  # 1,250 ms in slices of at most 500


def test_the_command_stops_once_its_reader_left_while_the_publisher_is_idle(tmp_path: Path) -> None:
    """Batches go out one at a time until the listener printed a line (a SUB socket joins late); once it printed
    the last one sent, the publisher is quiet and the reader leaves. Before: still running 60 s later (waiting in
    ``receive`` for a batch that never comes)."""
    publisher = ZmqEventPublisher(ipc_endpoint("live"), None, topic="kv")
    errors_file = tmp_path / "stderr"
    with open(errors_file, "wb") as errors_out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kv_cache_manager_v2", "events-listen", publisher.endpoint, "--topic", "kv"],
            stdout=subprocess.PIPE, stderr=errors_out, stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=IMPORT_ROOT), cwd=IMPORT_ROOT,
        )
    try:
        assert process.stdout is not None
        while True:
            last = publisher.publish([AllBlocksCleared()], ts=1.0)
            if select.select([process.stdout], [], [], 0.2)[0] or process.poll() is not None:
                break
        lines: list[bytes] = []
        while not lines or not lines[-1].startswith(f"batch seq={last} ".encode()):
            lines.append(process.stdout.readline())
            assert lines[-1], (lines, errors_file.read_text())  # not the end of its output
        # nothing more is sent: only a check of the output can notice
        status = status_once_reader_left(process, NOTICED_WITHIN_S)
    finally:
        publisher.close()
    errors = errors_file.read_text()
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors[-3000:]
    assert status == CLOSED_OUTPUT_STATUS, (status, errors[-3000:])
