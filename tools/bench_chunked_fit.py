"""Per-call cost of ``KVCacheManager.can_fit_in_chunks`` and ``max_admissible`` (microseconds): the batcher asks
the first for every arriving request of known length and the second once per GPU tier size; a scheduler in the
style of TensorRT-LLM's may ask either per request.

The configs of ``tools/bench_peak_pages.py`` (32 tokens a block) on a GPU tier of 150,000 tokens' pages per
layer, split by the default typical step (the longest request that fits: 150,000 to 400,000 tokens); lengths from
1k to 512k tokens, chunks of 1, 512 and 8,192 tokens. ``fits`` is the mean over the lengths that fit of the best of ``--repeats`` calls, ``refused`` over those that do not (the
refusal names a step, which costs a bisection), ``cap`` the best of as many ``max_admissible(chunk)`` (the longest in
``--json``).

    python tools/bench_chunked_fit.py                          # this tree, interpreted
    python tools/bench_chunked_fit.py --tree /work/main        # another checkout, for a same-sitting before/after
    python tools/bench_chunked_fit.py --tree build/compiled    # the compiled build (setup_mypyc.py build --build-lib)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (1_000, 4_096, 8_192, 32_768, 131_072, 200_001, 524_288)
CHUNKS = (1, 512, 8_192)
TPB = 32
BUFFER = 64  # bytes per block per buffer: small, so a tier for 150,000 tokens is a few MiB of host memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=None, help="import kv_cache_manager_v2 from this checkout")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many calls per length")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def configs(kvm: Any) -> dict[str, Any]:
    """Each config's ``KVCacheManagerConfig``, by name: its GPU tier holds 150,000 tokens' pages per layer."""
    kv = [kvm.BufferConfig("key", BUFFER), kvm.BufferConfig("value", BUFFER)]

    def attention(layer: int, window: int | None = None, sinks: int = 0) -> Any:
        return kvm.AttentionLayerConfig(layer, kv, sliding_window_size=window, num_sink_tokens=sinks or None)

    def gemma(window: int) -> list[Any]:
        return [attention(layer, None if layer % 6 == 5 else window) for layer in range(12)]

    layers: dict[str, list[Any]] = {
        "llama full attention": [attention(layer) for layer in range(4)],
        "gemma 5:1 window 1024": gemma(1024),
        "gemma 5:1 window 4096": gemma(4096),
        "window 131072 + full": [attention(0, 131_072), attention(1)],
        "window 4096, 4 sink blocks": [attention(0, 4096, 4 * TPB), attention(1)],
        "ssm hybrid (nemotron-h)": [kvm.SsmLayerConfig(0, [kvm.BufferConfig("ssm_state", 1 << 10)]), attention(1)],
        "window 4096 + scratch reuse": [attention(0, 4096), attention(1)],
    }
    out: dict[str, Any] = {}
    for name, model in layers.items():
        scratch = name.endswith("scratch reuse")
        quota = len(model) * 2 * BUFFER * (150_000 // TPB)
        out[name] = kvm.KVCacheManagerConfig(
            tokens_per_block=TPB, backend="cpu", layers=model, cache_tiers=[kvm.GpuCacheTierConfig(quota)],
            enable_swa_scratch_reuse=scratch, swa_scratch_reuse=kvm.SwaScratchReuseConfig(64) if scratch else None)
    return out


def best_us(call: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        best = min(best, (time.perf_counter_ns() - start) / 1e3)
    return best


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else REPO)
    import kv_cache_manager_v2 as kvm

    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, config in configs(kvm).items():
        manager = kvm.KVCacheManager(config)
        table[name] = {}
        for chunk in CHUNKS:
            fits: list[float] = []
            refused: list[float] = []
            for length in LENGTHS:
                spent = best_us(lambda: manager.can_fit_in_chunks(length, chunk), args.repeats)
                (fits if manager.can_fit_in_chunks(length, chunk) else refused).append(spent)
            cap = best_us(lambda: manager.max_admissible(chunk), args.repeats)
            table[name][str(chunk)] = {"fits": mean(fits), "refused": mean(refused), "cap": cap,
                                       "longest": manager.max_admissible(chunk)}
        manager.shutdown()
    if args.json:
        print(json.dumps({"compiled": kvm.COMPILED, "us_per_call": table}))
        return 0
    mode = "compiled" if kvm.COMPILED else "interpreted"
    print(f"{mode}: us per call, can_fit_in_chunks fits / refused (mean over lengths {', '.join(map(str, LENGTHS))}),"
          " max_admissible(chunk)")
    print(f"  {'config':30s}" + "".join(f"{'chunk ' + str(chunk):>30s}" for chunk in CHUNKS))
    for name, row in table.items():
        cells = "".join(f"{row[str(c)]['fits']:>9.0f} /{row[str(c)]['refused']:>9.0f} /{row[str(c)]['cap']:>9.0f}"
                        for c in CHUNKS)
        print(f"  {name:30s}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
