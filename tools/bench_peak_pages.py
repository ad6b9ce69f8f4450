"""Per-call cost of ``KVCacheManager.peak_pages`` (microseconds), which a guaranteed-no-evict scheduler asks per
request at admission (TensorRT-LLM's ``GUARANTEED_NO_EVICT``), with as many distinct lengths as requests.

Configs as served (32 tokens a block; layer counts do not matter, the answer is per layer group): Llama full
attention, Gemma 5:1 sliding/global with a 1,024- and a 4,096-token window, a 131,072-token window with full
attention, a 4,096-token window with 4 sink blocks, an SSM hybrid (Nemotron-H: SSM and full attention), and a
4,096-token window with SWA scratch reuse (rewind 64); lengths from 1k to 512k tokens, chunks of 1, 512 and 8,192
tokens. Each cell is the mean over the lengths of the best of ``--repeats`` calls; ``worst`` is the slowest length.

    python tools/bench_peak_pages.py                          # this tree, interpreted
    python tools/bench_peak_pages.py --tree /work/main        # another checkout, for a same-sitting before/after
    python tools/bench_peak_pages.py --tree build/compiled     # the compiled build (setup_mypyc.py build --build-lib)
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


def parse_args(description: str | None = __doc__) -> argparse.Namespace:
    """The options both admission-query benches take (``tools/bench_chunked_fit.py`` too)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=None, help="import kv_cache_manager_v2 from this checkout")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many calls per length")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def model_layers(kvm: Any, buffer_bytes: int, ssm_bytes: int) -> dict[str, list[Any]]:
    """Each config's layers, by name (key and value buffers of ``buffer_bytes``, an SSM state of ``ssm_bytes``)."""
    kv = [kvm.BufferConfig("key", buffer_bytes), kvm.BufferConfig("value", buffer_bytes)]

    def attention(layer: int, window: int | None = None, sinks: int = 0) -> Any:
        return kvm.AttentionLayerConfig(layer, kv, sliding_window_size=window, num_sink_tokens=sinks or None)

    def gemma(window: int) -> list[Any]:
        return [attention(layer, None if layer % 6 == 5 else window) for layer in range(12)]

    return {
        "llama full attention": [attention(layer) for layer in range(4)],
        "gemma 5:1 window 1024": gemma(1024),
        "gemma 5:1 window 4096": gemma(4096),
        "window 131072 + full": [attention(0, 131_072), attention(1)],
        "window 4096, 4 sink blocks": [attention(0, 4096, 4 * TPB), attention(1)],
        "ssm hybrid (nemotron-h)": [kvm.SsmLayerConfig(0, [kvm.BufferConfig("ssm_state", ssm_bytes)]), attention(1)],
        "window 4096 + scratch reuse": [attention(0, 4096), attention(1)],
    }


def manager_config(kvm: Any, name: str, layers: list[Any], gpu_quota: int) -> Any:
    """The ``KVCacheManagerConfig`` of config ``name`` (scratch reuse with a rewind of 64 for the one named so)."""
    scratch = name.endswith("scratch reuse")
    return kvm.KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=layers, cache_tiers=[kvm.GpuCacheTierConfig(gpu_quota)],
        enable_swa_scratch_reuse=scratch, swa_scratch_reuse=kvm.SwaScratchReuseConfig(64) if scratch else None)


def configs(kvm: Any) -> dict[str, Any]:
    """Each config's ``KVCacheManagerConfig``, by name."""
    return {name: manager_config(kvm, name, layers, 64 << 20) for name, layers in model_layers(kvm, 4096, 1 << 16).items()}


def best_us(call: Any, repeats: int) -> float:
    """The fastest of ``repeats`` calls, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        best = min(best, (time.perf_counter_ns() - start) / 1e3)
    return best


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else REPO)
    import kv_cache_manager_v2 as kvm

    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, config in configs(kvm).items():
        manager = kvm.KVCacheManager(config)
        table[name] = {}
        for chunk in CHUNKS:
            times = [best_us(lambda: manager.peak_pages(length, chunk), args.repeats) for length in LENGTHS]
            table[name][str(chunk)] = {"mean": sum(times) / len(times), "worst": max(times)}
        manager.shutdown()
    if args.json:
        print(json.dumps({"compiled": kvm.COMPILED, "us_per_call": table}))
        return 0
    mode = "compiled" if kvm.COMPILED else "interpreted"
    print(f"{mode}: peak_pages us per call, mean / worst over lengths {', '.join(map(str, LENGTHS))}")
    print(f"  {'config':30s}" + "".join(f"{'chunk ' + str(chunk):>20s}" for chunk in CHUNKS))
    for name, row in table.items():
        cells = "".join(f"{row[str(c)]['mean']:>11.0f} /{row[str(c)]['worst']:>7.0f}" for c in CHUNKS)
        print(f"  {name:30s}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
