"""Does a NIXL READ that ended in ERR write into its destination afterwards? Measured with raw NIXL agents.

The receiver counts a READ as unable to write once NIXL reports it DONE or ERR (``_nixl_agent.settled``), and frees
its landing pages then. This checks the ERR half on loopback: a spawned source registers ``--mib`` of 0xAB; this
process READs it in ``--descriptors`` pieces, and once ``--at`` of it landed the source fails mid-READ (``kill``:
SIGKILL; ``drop``: the source drops its agent, keeping the process and the bytes). When NIXL reports ERR the handle
is released (as ``settled`` does), the destination is filled with 0x5A and watched for ``--watch-s`` seconds: any
byte that changes is a late write. Prints one line per trial; a READ that completed first is DONE, not counted.

    UCX_TLS=tcp python tools/nixl_late_writes.py [--mode kill|drop] [--mib 1024] [--at 0.1 0.3 0.5 0.7]

Over shared memory (UCX's defaults on one host) a READ of 1 GiB completed before the source could fail: use
``UCX_TLS=tcp``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection

import numpy as np

from kv_cache_manager_v2._handoff.nixl_agent import NixlAgent, new_agent

SOURCE_BYTE = 0xAB
POISON = 0x5A
SAMPLE_STRIDE = 4096  # landed bytes are estimated from every 4096th byte: a full count is slower than the READ


def source(connection: Connection, nbytes: int) -> None:
    """The READ's source: its bytes registered; on ``drop`` its agent goes, the process and the bytes stay."""
    agent: NixlAgent | None = new_agent("late-writes-source")
    assert agent is not None
    data = np.full(nbytes, SOURCE_BYTE, dtype=np.uint8)
    agent.register_memory([(data.ctypes.data, nbytes, 0, "")], "DRAM")
    connection.send((agent.get_agent_metadata(), data.ctypes.data))
    connection.recv()
    agent = None
    gc.collect()
    time.sleep(3600)  # killed by the parent


def state_of(agent: NixlAgent, handle: object) -> tuple[str, str]:
    """NIXL's state of the READ, and the error's type when the binding raised for an error status (an ERR)."""
    try:
        return agent.check_xfer_state(handle), ""
    except Exception as error:  # NIXL's binding errors derive from Exception only
        return "ERR", type(error).__name__


def trial(mode: str, nbytes: int, descriptors: int, at: float, watch_s: float) -> str:
    context = multiprocessing.get_context("spawn")
    connection, child_end = context.Pipe()
    child = context.Process(target=source, args=(child_end, nbytes), daemon=True)
    child.start()
    metadata, source_address = connection.recv()
    agent = new_agent(f"late-writes-{os.getpid()}-{at}")
    landing = np.zeros(nbytes, dtype=np.uint8)
    registration = agent.register_memory([(landing.ctypes.data, nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(metadata)
    peer = name.decode() if isinstance(name, bytes) else name
    piece = nbytes // descriptors
    local = np.array([(landing.ctypes.data + i * piece, piece, 0) for i in range(descriptors)], dtype=np.uint64)
    remote = np.array([(source_address + i * piece, piece, 0) for i in range(descriptors)], dtype=np.uint64)
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer, b"late-writes"
    )
    state, raised = agent.transfer(handle), ""
    landed = 0
    while state == "PROC" and landed < at * nbytes:
        landed = int(np.count_nonzero(landing[::SAMPLE_STRIDE])) * SAMPLE_STRIDE
        state, raised = state_of(agent, handle)
    if mode == "kill":
        os.kill(child.pid or 0, signal.SIGKILL)
    else:
        connection.send("drop")
    failed = time.monotonic()
    while state == "PROC" and time.monotonic() - failed < 30:
        state, raised = state_of(agent, handle)
    ended_ms = (time.monotonic() - failed) * 1000
    at_end = int(np.count_nonzero(landing))
    try:
        agent.release_xfer_handle(handle)
        released = "released"
    except Exception as error:
        released = f"release refused ({type(error).__name__})"
    landing.fill(POISON)
    late = 0
    first_late_s = -1.0
    watched = time.monotonic()
    while time.monotonic() - watched < watch_s:
        changed = int(np.count_nonzero(landing != POISON))
        if changed and first_late_s < 0:
            first_late_s = time.monotonic() - watched
        late = max(late, changed)
        time.sleep(0.005)
    child.kill()
    child.join(10)
    agent.deregister_memory(registration)
    return (
        f"{mode} at={at:.2f} failed_after={landed >> 20} MiB state={state}{f' ({raised})' if raised else ''} "
        f"ended {ended_ms:.1f} ms after the failure with {at_end >> 20} MiB landed, {released}; late bytes in "
        f"{watch_s:g} s: {late}" + (f" (first after {first_late_s:.3f} s)" if late else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("kill", "drop"), default="kill")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--descriptors", type=int, default=65536)
    parser.add_argument("--at", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    parser.add_argument("--watch-s", type=float, default=3.0)
    args = parser.parse_args()
    for at in args.at:
        print(trial(args.mode, args.mib << 20, args.descriptors, at, args.watch_s), flush=True)


if __name__ == "__main__":
    main()
