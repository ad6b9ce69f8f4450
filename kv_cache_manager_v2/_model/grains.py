"""Slot counts of pool groups whose memory is reserved in fixed-size grains (TensorRT-LLM's virtual-memory pools).

Pools here reserve whole quotas up front and are sized in slots, but an engine that maps pool memory a grain at a
time (CUDA virtual memory: 2 MiB or 16 MiB pages) needs the same arithmetic TensorRT-LLM's storage uses: each pool
of a pool group rounds its own bytes up to whole grains, so a pool group of ``n`` slots costs the sum over its pools
of ``ceil(n * slot_size / granularity)`` grains."""

from __future__ import annotations

from typing import Sequence

from .._base.validation import as_int, as_float


def _check_sizes(slot_sizes: Sequence[int], granularity: int) -> tuple[list[int], int]:
    """The slot sizes and granularity as ints, each checked positive (a zero would divide by zero below)."""
    sizes = [as_int(size, "slot_size_list[]") for size in slot_sizes]
    if not sizes:
        raise ValueError("slot_size_list must name at least one pool")
    for index, size in enumerate(sizes):
        if size <= 0:
            raise ValueError(f"slot_size_list[{index}] must be positive, got {size}")
    grain = as_int(granularity, "granularity")
    if grain <= 0:
        raise ValueError(f"granularity must be positive, got {grain}")
    return sizes, grain


def _grains(num_slots: int, sizes: list[int], granularity: int) -> int:
    return sum(-(-num_slots * size // granularity) for size in sizes)


def grains_for_slots(num_slots: int, slot_size_list: Sequence[int], granularity: int) -> int:
    """Grains a pool group of ``num_slots`` slots needs: each pool's bytes rounded up to whole grains."""
    count = as_int(num_slots, "num_slots")
    if count < 0:
        raise ValueError(f"num_slots must be >= 0, got {count}")
    sizes, grain = _check_sizes(slot_size_list, granularity)
    return _grains(count, sizes, grain)


def grains_to_slots(pg_grains: int, slot_size_list: Sequence[int], granularity: int) -> tuple[int, int]:
    """The most slots ``pg_grains`` grains hold, and the grains those slots use (never more than given).

    Rounding costs each pool less than a grain, so the answer lies between the slots of the grains minus one per
    pool and the slots of all of them, bytes for bytes; a bisection between the two finds it."""
    budget = as_int(pg_grains, "pg_grains")
    if budget < 0:
        raise ValueError(f"pg_grains must be >= 0, got {budget}")
    sizes, grain = _check_sizes(slot_size_list, granularity)
    slot_bytes = sum(sizes)
    low = max(0, (budget - len(sizes)) * grain // slot_bytes)
    high = budget * grain // slot_bytes
    while low < high:
        middle = (low + high + 1) // 2
        if _grains(middle, sizes, grain) <= budget:
            low = middle
        else:
            high = middle - 1
    return low, _grains(low, sizes, grain)


def ratio_to_slot_count_list(
    quota: int,
    slot_size_lists: Sequence[Sequence[int]],
    ratio_list: Sequence[float],
    granularity: int,
    min_slots: Sequence[int],
) -> list[int]:
    """Slots per pool group for ``quota`` bytes split by ``ratio_list``, every group keeping ``min_slots``.

    The minimums are reserved first; the grains left go to the groups whose ratio share exceeds their minimum, in
    proportion to that excess. ValueError when the minimums alone exceed the quota."""
    total_bytes = as_int(quota, "quota")
    grain = as_int(granularity, "granularity")
    if grain <= 0:
        raise ValueError(f"granularity must be positive, got {grain}")
    count = len(slot_size_lists)
    if len(ratio_list) != count or len(min_slots) != count:
        raise ValueError(
            f"slot_size_lists, ratio_list and min_slots must have one entry per pool group, got {count}, "
            f"{len(ratio_list)} and {len(min_slots)}"
        )
    ratios = [as_float(ratio, "ratio_list[]") for ratio in ratio_list]
    if any(not ratio >= 0.0 for ratio in ratios) or sum(ratios) <= 0.0:
        raise ValueError(f"ratio_list must hold non-negative values with a positive sum, got {list(ratio_list)}")
    total = total_bytes // grain
    floors = [grains_for_slots(slots, sizes, grain) for slots, sizes in zip(min_slots, slot_size_lists)]
    if sum(floors) > total:
        raise ValueError(f"min_slots need {sum(floors)} grains, more than the quota's {total}")
    ratio_sum = sum(ratios)
    excess = [max(0.0, total * ratio / ratio_sum - floor) for ratio, floor in zip(ratios, floors)]
    spare = total - sum(floors)
    excess_sum = sum(excess)
    scale = min(1.0, spare / excess_sum) if excess_sum > 0.0 else 0.0
    return [
        grains_to_slots(floor + int(extra * scale), sizes, grain)[0]
        for floor, extra, sizes in zip(floors, excess, slot_size_lists)
    ]
