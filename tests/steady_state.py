"""What a long-running server must not accumulate, measured as counts (never timings): live objects by type,
open descriptors and threads. ``grown_after`` runs a workload N times, then N more: what the first N reached is
the steady state, and the second N must leave every count where the first left it."""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
from typing import Callable


def open_descriptors() -> list[str]:
    """What this process's descriptors point at (Linux ``/proc/self/fd``; empty elsewhere)."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    targets: list[str] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue  # the descriptor listdir itself used, closed meanwhile
    return sorted(targets)


def live_counts() -> dict[str, int]:
    """Objects the collector tracks, by type name, plus descriptors and threads, after a full collection."""
    gc.collect()
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        counts[name] = counts.get(name, 0) + 1
    counts["<descriptors>"] = len(open_descriptors())
    counts["<threads>"] = threading.active_count()
    return counts


def grown_after(workload: Callable[[int], None], rounds: int) -> dict[str, int]:
    """Run ``workload(rounds)`` twice; the counts that grew during the second run (empty: steady state)."""
    workload(rounds)
    before = live_counts()
    workload(rounds)
    after = live_counts()
    return {name: count - before.get(name, 0) for name, count in after.items() if count > before.get(name, 0)}


def traced_growth(workload: Callable[[int], None], rounds: int) -> int:
    """Bytes ``tracemalloc`` still traces after the second ``workload(rounds)`` beyond what the first left: for
    what the collector does not track (ints, strings, dict slots). Small: allocator noise, not per-round growth."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        workload(rounds)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        workload(rounds)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        if started:
            tracemalloc.stop()
