"""A trace request far longer than the GPU tier costs no memory for its tokens: it is rejected on arrival, before
its token ids (a list of prompt plus output ints) are ever built."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from kv_cache_manager_v2.sim.mooncake_trace import MAX_REQUEST_TOKENS
from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.simulator import simulate


def test_a_request_of_the_largest_accepted_length_is_refused_without_building_its_tokens(tmp_path: Path) -> None:
    """Before: one line of input and output 2**24 tokens each built its 2**25 token ids at admission (1.5 GB RSS
    for ``simulate --trace``) only to be rejected after its first chunk."""
    path = tmp_path / "trace.jsonl"
    huge = {"timestamp": 0, "input_length": MAX_REQUEST_TOKENS, "output_length": MAX_REQUEST_TOKENS,
            "hash_ids": list(range(10**6, 10**6 + MAX_REQUEST_TOKENS // 512))}
    short = [{"timestamp": 1 + index, "input_length": 600, "output_length": 2, "hash_ids": [1, 2 + index]}
             for index in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in [huge, *short]))
    options = SimulatorOptions(trace=str(path), gpu_mib=65536, bookkeeping=True, check=False)
    tracemalloc.start()
    try:
        result = simulate(options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.rejected >= 1 and result.prefill_tokens < MAX_REQUEST_TOKENS
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB traced at the peak"
