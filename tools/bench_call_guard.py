"""What making the call guard's "no call in flight" check exact costs, ns per guarded call, in both modes.

``KVCache.resize`` and ``commit`` (one each per cache per decode step) inline the guard's common case. Three ways
to test and mark "no call in flight" are timed here as that inlined fragment (nothing dropped, no hold, the call
itself empty):

- ``test_then_mark``: read ``current``, then write it (what the guard did: a thread switch between the two lets a
  second thread in, interpreted);
- ``pop_token``: pop the one entry of a list, put it back at the end (``CallGuard.idle``, what it does now: one C
  call, no switch inside it);
- ``lock``: ``threading.Lock.acquire(False)`` / ``release``.

Compiled mode compiles this file with mypyc into a temporary folder and runs it from there.

    python tools/bench_call_guard.py              # interpreted
    python tools/bench_call_guard.py --compiled   # mypyc-compiled (needs mypyc, ~1 minute)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Callable


class Guard:
    def __init__(self) -> None:
        self.current: str = ""
        self.dropped: deque[object] = deque()
        self.idle: list[None] = [None]
        self.lock: threading.Lock = threading.Lock()


def test_then_mark(guard: Guard, holds: list[str]) -> bool:
    if guard.current or guard.dropped or holds:
        return False
    guard.current = "KVCache.resize"
    try:
        return True
    finally:
        guard.current = ""


def pop_token(guard: Guard, holds: list[str]) -> bool:
    if guard.dropped or holds:
        return False
    try:
        guard.idle.pop()
    except IndexError:
        return False
    guard.current = "KVCache.resize"
    try:
        return True
    finally:
        guard.current = ""
        guard.idle.append(None)


def lock(guard: Guard, holds: list[str]) -> bool:
    if guard.dropped or holds or not guard.lock.acquire(False):
        return False
    guard.current = "KVCache.resize"
    try:
        return True
    finally:
        guard.current = ""
        guard.lock.release()


def no_guard(guard: Guard, holds: list[str]) -> bool:
    return True


VARIANTS: dict[str, Callable[[Guard, list[str]], bool]] = {
    "no guard (the loop and call)": no_guard,
    "test_then_mark": test_then_mark,
    "pop_token": pop_token,
    "lock": lock,
}


def best_ns(variant: Callable[[Guard, list[str]], bool], calls: int, repeats: int) -> float:
    guard = Guard()
    holds: list[str] = []
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            variant(guard, holds)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def measure(calls: int, repeats: int) -> None:
    mode = "compiled" if __file__.endswith(".so") else "interpreted"
    print(f"{mode}: ns per guarded call (best of {repeats} x {calls:,})")
    for name, variant in VARIANTS.items():
        print(f"  {name:30s} {best_ns(variant, calls, repeats):8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiled", action="store_true", help="compile this file with mypyc and time that")
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not args.compiled:
        measure(args.calls, args.repeats)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(os.path.abspath(__file__), os.path.join(folder, "bench_call_guard.py"))
        subprocess.run(["mypyc", "bench_call_guard.py"], cwd=folder, check=True, capture_output=True)
        run = f"import bench_call_guard as b; b.measure({args.calls}, {args.repeats})"
        return subprocess.run([sys.executable, "-c", run], cwd=folder, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
