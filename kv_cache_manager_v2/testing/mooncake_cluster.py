"""A Mooncake Store on loopback, for tests and benchmarks: ``mooncake_master`` (with its HTTP metadata server) and
one ``mooncake_client`` storage node that lends the store its memory, so objects outlive the clients that put them
(managers can lend none: quota 0). Ports are picked free; ``stop`` ends both processes. Needs the ``mooncake``
extra; the binaries sit beside the Python executable (``bin_dir``). Their logs (``logs``) go with ``stop``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from .._remote.mooncake import MooncakeStoreConfig

STARTUP_TIMEOUT_S = 30.0


def mooncake_bin_dir() -> Path:
    """Where pip put ``mooncake_master`` and ``mooncake_client``: the scripts directory of this interpreter."""
    return Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path) -> None:
    """Poll ``ready`` until it holds; fails with the process's log if it exits first, or after the startup timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}: {log.read_text()[-2000:]}")
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {STARTUP_TIMEOUT_S} s")


def listening(port: int) -> Callable[[], bool]:
    """A readiness check for ``wait_until``: something accepts connections on ``port`` of loopback."""

    def probe() -> bool:
        with socket.socket() as connection:
            return connection.connect_ex(("127.0.0.1", port)) == 0

    return probe


def mounted_capacity(metrics_port: int) -> int:
    """The bytes the master can place objects in (its ``master_total_capacity_bytes`` gauge); 0 until it answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as reply:
            text: str = reply.read().decode()
    except OSError:  # urllib's URLError included
        return 0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return int(float(line.split()[1]))
    return 0


def _started(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``command`` started with its output going to ``log`` (the child keeps the file open; this process does not)."""
    with log.open("wb") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)


class MooncakeCluster:
    """A master and one storage node on loopback; ``config`` connects a client to them."""

    def __init__(self, bin_dir: Path, segment_bytes: int = 256 << 20) -> None:
        self.logs: Path = Path(tempfile.mkdtemp(prefix="mooncake-"))  # both processes' output, until stop
        rpc, http, metrics, node = free_port(), free_port(), free_port(), free_port()
        self.master_address: str = f"127.0.0.1:{rpc}"
        self.metadata_url: str = f"http://127.0.0.1:{http}/metadata"
        self.metrics_port: int = metrics  # ``mounted_capacity(metrics_port)``: the bytes clients lend the store
        master_log = self.logs / "master.log"
        try:
            self.master: subprocess.Popen[bytes] = _started(
                [
                    str(bin_dir / "mooncake_master"),
                    f"--rpc_port={rpc}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={http}",
                    f"--metrics_port={metrics}",
                ],
                master_log,
            )
        except BaseException:
            shutil.rmtree(self.logs, ignore_errors=True)
            raise
        self.node: subprocess.Popen[bytes] | None = None
        try:
            wait_until(listening(rpc), self.master, f"mooncake_master listening on port {rpc}", master_log)
            wait_until(listening(http), self.master, f"the metadata server listening on port {http}", master_log)
            node_log = self.logs / "node.log"
            self.node = _started(
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
                node_log,
            )
            wait_until(listening(node), self.node, f"the storage node listening on port {node}", node_log)
            # The node listens before it mounts its memory; until the master counts that memory every put is
            # refused as 'insufficient space', so the store is ready only once the master reports the segment.
            wait_until(
                lambda: mounted_capacity(metrics) >= segment_bytes, self.node,
                f"the master counting the storage node's {segment_bytes} bytes", node_log,
            )
        except BaseException:
            self.stop()
            raise

    def config(self) -> MooncakeStoreConfig:
        return MooncakeStoreConfig(self.master_address, self.metadata_url)

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait()

    def stop(self) -> None:
        """End both processes and remove their logs (every test run would otherwise leave a directory behind)."""
        for process in (self.node, self.master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        shutil.rmtree(self.logs, ignore_errors=True)
