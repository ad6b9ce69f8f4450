"""A Mooncake Store on loopback for the remote-tier tests: ``mooncake_master`` (with its HTTP metadata server) and
one ``mooncake_client`` storage node that lends the store its memory, so objects outlive the processes that put
them (the managers under test lend none: quota 0). Ports are picked free; ``stop`` ends both.

Without the ``mooncake`` extra the tests skip, unless ``CI`` is set (``.ci/run`` installs it): then they fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kv_cache_manager_v2 import MooncakeStoreConfig

STARTUP_TIMEOUT_S = 30.0


def require_mooncake() -> Path:
    """The directory holding ``mooncake_master``; skips (fails under CI) when Mooncake is not installed."""
    problem = ""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        problem = f"the mooncake extra is not installed ({error})"
    bin_dir = Path(sys.executable).parent
    if not problem and not (bin_dir / "mooncake_master").exists():
        problem = f"no mooncake_master beside {sys.executable}"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs Mooncake (.ci/run), yet {problem}")
        pytest.skip(problem)
    return bin_dir


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {STARTUP_TIMEOUT_S} s")


class MooncakeCluster:
    """A master and one storage node on loopback; ``config`` connects a client to them."""

    def __init__(self, bin_dir: Path, segment_bytes: int = 256 << 20) -> None:
        self._logs = Path(tempfile.mkdtemp(prefix="mooncake-"))
        rpc, http, metrics, node = free_port(), free_port(), free_port(), free_port()
        self.master_address = f"127.0.0.1:{rpc}"
        self.metadata_url = f"http://127.0.0.1:{http}/metadata"
        master_log = self._logs / "master.log"
        self.master: subprocess.Popen[bytes] = subprocess.Popen(
            [
                str(bin_dir / "mooncake_master"),
                f"--rpc_port={rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                f"--metrics_port={metrics}",
            ],
            stdout=master_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.node: subprocess.Popen[bytes] | None = None
        try:
            wait_for_port(rpc, self.master, "mooncake_master", master_log)
            wait_for_port(http, self.master, "mooncake_master's metadata server", master_log)
            node_log = self._logs / "node.log"
            self.node = subprocess.Popen(
                [
                    str(bin_dir / "mooncake_client"),
                    "--host=127.0.0.1",
                    f"--port={node}",
                    f"--global_segment_size={segment_bytes}",
                    "--local_buffer_size=16MB",
                    f"--master_server_address={self.master_address}",
                    f"--metadata_server={self.metadata_url}",
                    "--protocol=tcp",
                ],
                stdout=node_log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            wait_for_port(node, self.node, "mooncake_client (storage node)", node_log)
        except BaseException:
            self.stop()
            raise

    def config(self) -> MooncakeStoreConfig:
        return MooncakeStoreConfig(self.master_address, self.metadata_url)

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait()

    def stop(self) -> None:
        for process in (self.node, self.master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
