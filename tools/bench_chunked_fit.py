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

import json
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.bench_peak_pages import (  # noqa: E402
    CHUNKS, LENGTHS, TPB, best_us, manager_config, model_layers, parse_args,
)

BUFFER = 64  # bytes per block per buffer: small, so a tier for 150,000 tokens is a few MiB of host memory


def configs(kvm: Any) -> dict[str, Any]:
    """Each config's ``KVCacheManagerConfig``, by name: its GPU tier holds 150,000 tokens' pages per layer."""
    return {
        name: manager_config(kvm, name, layers, len(layers) * 2 * BUFFER * (150_000 // TPB))
        for name, layers in model_layers(kvm, BUFFER, 1 << 10).items()
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> int:
    args = parse_args(__doc__)
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
