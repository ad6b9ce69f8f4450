"""How the simulator splits the GPU tier across pool groups: its ``typical_step`` follows the requests' lengths,
so a mix of lengths counts, while one outlier does not take the split from every other request; a hybrid's SSM
group gets the slots one admission needs where the tier can hold them."""

from __future__ import annotations

import json
from pathlib import Path

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.sim.options import MIB, SimulatorOptions, byte_divisor, typical_lengths
from kv_cache_manager_v2.sim.result import SimulationResult
from kv_cache_manager_v2.sim.simulator import simulate


def write_trace(path: Path, num_short: int, outlier_blocks: int) -> None:
    """``num_short`` requests of 4,096 prompt tokens (four system prompts of 2,048), then, last, one request of
    ``outlier_blocks`` 512-token blocks (none when 0)."""
    lines = [
        {"timestamp": index * 200, "input_length": 4096, "output_length": 64,
         "hash_ids": [index % 4 * 10 + block for block in range(4)] + [1000 + index * 4 + block for block in range(4)]}
        for index in range(num_short)
    ]
    if outlier_blocks:
        lines.append({"timestamp": num_short * 200 + 5000, "input_length": outlier_blocks * 512, "output_length": 64,
                      "hash_ids": list(range(10**6, 10**6 + outlier_blocks))})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def planned_gpu_slots(trace: Path) -> list[int]:
    """GPU slots per pool group of a ``simulate --trace`` run (gemma: a window group and a full-attention group)."""
    slots: list[int] = []

    def record(manager: KVCacheManager) -> None:
        slots.extend(stat.total for stat in manager.get_storage_statistics(0))

    options = SimulatorOptions(trace=str(trace), gpu_mib=512, host_mib=0, bookkeeping=True, check=False)
    simulate(options, on_start=record)
    return slots


def test_one_request_fifty_times_the_others_leaves_the_split_as_it_was(tmp_path: Path) -> None:
    """Before: the split followed the mean length, 5.4 times the others' with the outlier: [21, 459] slots instead
    of [78, 317]; without --bookkeeping all 11 requests were rejected, 10 finish without the outlier."""
    write_trace(tmp_path / "short.jsonl", 10, 0)
    write_trace(tmp_path / "outlier.jsonl", 10, 400)
    assert planned_gpu_slots(tmp_path / "outlier.jsonl") == planned_gpu_slots(tmp_path / "short.jsonl")


def test_typical_lengths_follow_a_mix_and_stop_at_the_ninetieth_percentile() -> None:
    assert typical_lengths([1000] * 5 + [16000] * 5, 4) == [1000, 1000, 16000, 16000]
    assert typical_lengths([100] * 10 + [5000], 16) == [100] * 16
    assert typical_lengths([], 3) == [1, 1, 1]
    assert typical_lengths(range(1, 101), 2) == [26, 76]


def run_hybrid(trace: Path, gpu_mib: int) -> tuple[list[int], int, SimulationResult]:
    """``simulate --preset hybrid-ssm --trace`` in bookkeeping mode: (GPU slots per pool group, the GPU bytes they
    take at full size, the result)."""
    slots: list[int] = []
    taken: list[int] = []

    def record(manager: KVCacheManager) -> None:
        statistics = manager.get_storage_statistics(0)
        slots.extend(stat.total for stat in statistics)
        taken.append(sum(stat.total * sum(manager.get_slot_bytes(group)) for group, stat in enumerate(statistics)))

    options = SimulatorOptions(preset="hybrid-ssm", trace=str(trace), gpu_mib=gpu_mib, host_mib=0, bookkeeping=True,
                               check=False)
    result = simulate(options, on_start=record)
    return slots, taken[0] * byte_divisor(options), result


def write_mixed_trace(path: Path) -> None:
    """16 requests, every other one of 400 + 16 tokens, the others of 1,936 + 16."""
    lines = [{"timestamp": index * 100, "input_length": blocks * 512 - 112, "output_length": 16,
              "hash_ids": [index * 10 + block for block in range(blocks)]}
             for index, blocks in enumerate([1, 4] * 8)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_small_tier_gives_a_hybrids_ssm_group_the_slots_one_admission_needs(tmp_path: Path) -> None:
    """Before: the typical step's proportions gave 64 MiB one 24.6 MiB SSM slot and 78 attention slots; an
    admission may lock at most 0.97 of a pool group, so no request was ever admitted: [1, 78] slots, 0 of 16
    finished. Two SSM slots leave 29 attention slots, which hold the short half of the trace."""
    write_mixed_trace(tmp_path / "mixed.jsonl")
    slots, _, result = run_hybrid(tmp_path / "mixed.jsonl", 64)
    assert (slots, result.finished, result.rejected) == ([2, 29], 8, 8)


def test_a_tier_too_small_for_that_floor_keeps_its_quota(tmp_path: Path) -> None:
    """Two SSM slots take more than 48 MiB: no shorter step admits a request either, and the run keeps the first
    split within --gpu-mib 48 (every request rejected, as it says)."""
    write_mixed_trace(tmp_path / "mixed.jsonl")
    slots, taken, result = run_hybrid(tmp_path / "mixed.jsonl", 48)
    assert slots == [1, 46] and taken <= 48 * MIB and result.rejected == 16
