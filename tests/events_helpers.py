"""Shared by the KV event tests: the ``events`` extra (skip without it outside CI, fail in CI), free endpoints,
small managers."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest


def require_events_extra() -> None:
    """Skip (fail in CI, where ``.ci/run`` installs it) when pyzmq or msgspec is missing."""
    for module in ("zmq", "msgspec"):
        if importlib.util.find_spec(module) is None:
            if os.environ.get("CI"):
                pytest.fail(f"CI installs the events extra, yet {module} is missing")
            pytest.skip(f"the events extra is not installed ({module} is missing)", allow_module_level=True)


def ipc_endpoint(name: str) -> str:
    """An ipc:// endpoint in a fresh temporary directory (a short path: a socket's is limited to ~107 bytes, which
    pytest's ``tmp_path`` can exceed), removed when the process exits: nothing else removed them (558 were left on
    the shared test machine)."""
    directory = tempfile.mkdtemp(prefix="kv_events_")
    atexit.register(shutil.rmtree, directory, True)
    return f"ipc://{directory}/{name}"


TCP_ANY_PORT = "tcp://127.0.0.1:*"
