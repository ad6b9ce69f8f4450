"""What a deployment's ``secret_key`` costs the remote tier: framing and checking one page object with its MAC
(HMAC-SHA256 keyed with the secret) against the unkeyed BLAKE2b digest used without a secret, and against keyed
BLAKE2b (the alternative: HMAC-SHA256 won where the CPU has SHA instructions), per page size.

Each figure is the median time of ``frame`` + ``unframe`` (what a page costs when it is stored by one instance and
fetched by another: the digest is computed twice) over one page, in microseconds, and the rate over its bytes. Page
sizes: 64 KiB, a SmolLM2-135M block of 32 tokens (1.4 MiB) and 16 MiB.

    python tools/bench_object_digest.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Callable

import numpy as np

from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._remote.objects import HEADER, ObjectHasher, frame, object_hasher, unframe

SIZES = {"64 KiB page": 64 << 10, "SmolLM2 block (1.4 MiB)": 30 * 2 * 3 * 64 * 2 * 32, "16 MiB object": 16 << 20}
KEY = "kvm2/0123456789abcdef0123456789abcdef/lg0/pg0/" + "ab" * 32
SECRET = bytes(range(32))


def median_us(run: Callable[[], object], repeat: int) -> float:
    run()  # warm-up
    times: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def round_trip(hasher: ObjectHasher, payload: HostBuffer, out: HostBuffer) -> Callable[[], object]:
    def run() -> object:
        frame(hasher, KEY, payload, out)
        checked = unframe(hasher, KEY, out, out.nbytes)
        assert checked is not None
        return checked

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print(f"{'page':<26}{'unkeyed us':>12}{'ours keyed us':>15}{'ours GB/s':>11}{'keyed BLAKE2b us':>18}")
    keyed_blake2b = hashlib.blake2b(digest_size=16, key=SECRET)
    for name, size in SIZES.items():
        payload: HostBuffer = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        out: HostBuffer = np.empty(HEADER.size + size, dtype=np.uint8)
        unkeyed = median_us(round_trip(object_hasher(None), payload, out), args.repeat)
        ours = median_us(round_trip(object_hasher(SECRET), payload, out), args.repeat)
        other = median_us(round_trip(keyed_blake2b, payload, out), args.repeat)
        print(f"{name:<26}{unkeyed:>12.1f}{ours:>15.1f}{2 * size / ours / 1e3:>11.2f}{other:>18.1f}")

if __name__ == "__main__":
    main()
