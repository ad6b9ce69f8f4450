"""How a tier's quota is split across pool groups: proportional shares, constraint floors that only lift a share
that falls short, the bytes rounding leaves over, and a GPU quota raised to the floors."""

from __future__ import annotations

from kv_cache_manager_v2 import BatchDesc, KVCacheDesc, KVCacheManager
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2._introspection import internals_of
from tests.helpers import KIB, MIB, attention, make_config

TPB = 32


def swa_and_full(swa_size: int, full_size: int) -> list[LayerConfig]:
    return [attention(0, swa_size, window=TPB), attention(1, full_size)]


def totals(manager: KVCacheManager) -> list[int]:
    return [stats.total for stats in manager.get_storage_statistics(0)]


def used_bytes(manager: KVCacheManager) -> int:
    return sum(stats.total * sum(stats.slot_sizes) for stats in manager.get_storage_statistics(0))


def test_bytes_left_by_rounding_become_a_slot_of_the_group_that_wants_them() -> None:
    # Slots of 4 KiB - 2 and 4 KiB; 5 slots' worth of quota; one cache of one block as the constraint.
    layers = swa_and_full(2 * KIB - 1, 2 * KIB)
    one_block = BatchDesc([KVCacheDesc(TPB, 0)])
    manager = KVCacheManager(make_config(layers, gpu_quota=5 * 4 * KIB, constraints=[one_block]))
    # The SWA group is held at its floor (2 with resume headroom); the full group's share takes the rest: 3 slots,
    # not the 2 that rounding each share down would leave (a slot's worth of quota unused).
    assert totals(manager) == [2, 3]
    assert 5 * 4 * KIB - used_bytes(manager) < 4 * KIB - 2


def test_small_slots_take_what_large_slots_cannot_use() -> None:
    layers = swa_and_full(512 * KIB, KIB // 2)
    one_block = BatchDesc([KVCacheDesc(TPB, 0)])
    manager = KVCacheManager(make_config(layers, gpu_quota=4096 * KIB, typical_step=one_block))
    swa, full = totals(manager)
    assert swa == 3  # 3 x 1 MiB; the last MiB is smaller than a SWA slot ...
    assert full > 1000  # ... so it becomes 1 KiB slots of the full group
    assert 4096 * KIB - used_bytes(manager) < KIB


def test_floors_the_typical_step_already_covers_leave_the_split_unchanged() -> None:
    layers = [attention(0, 24 * KIB, window=128, sinks=32), attention(1, 40 * KIB)]
    typical = BatchDesc([KVCacheDesc(1024, 1024)] * 4)
    smaller = BatchDesc([KVCacheDesc(512, 512)] * 4)
    quota = 128 * (48 + 80) * KIB  # room for 128 slots of each group
    alone = KVCacheManager(make_config(layers, gpu_quota=quota, typical_step=typical))
    constrained = KVCacheManager(make_config(layers, gpu_quota=quota, typical_step=typical, constraints=[smaller]))
    assert totals(alone) == totals(constrained)


def test_a_floor_lifts_only_the_share_that_falls_short() -> None:
    layers = [attention(0, 24 * KIB, window=128, sinks=32), attention(1, 40 * KIB)]
    typical = BatchDesc([KVCacheDesc(4096, 4000)])  # long decode: the SWA share is a few slots
    many_short = BatchDesc([KVCacheDesc(256, 128)] * 16)
    quota = 64 * MIB
    alone = KVCacheManager(make_config(layers, gpu_quota=quota, typical_step=typical))
    constrained = KVCacheManager(
        make_config(layers, gpu_quota=quota, typical_step=typical, constraints=[many_short], max_util_for_resume=1.0)
    )
    (swa_alone, full_alone), (swa, full) = totals(alone), totals(constrained)
    floor = internals_of(constrained).planner.floors[0]
    assert swa_alone < floor == swa  # lifted exactly to the floor ...
    assert full < full_alone and used_bytes(constrained) > quota - 40 * 2 * KIB  # ... the full group takes the rest


def test_a_gpu_quota_below_the_constraint_floors_is_raised_so_the_batch_always_resumes() -> None:
    layers = [attention(0, 24 * KIB, window=128, sinks=32), attention(1, 40 * KIB)]
    batch = BatchDesc([KVCacheDesc(1, 0)] * 32)
    quota = 32 * (48 + 80) * KIB  # exactly one slot per cache: no room for max_util_for_resume's headroom
    manager = KVCacheManager(make_config(layers, gpu_quota=quota, constraints=[batch], max_util_for_resume=0.95))
    assert totals(manager) == [34, 34]  # ceil(32 / 0.95)
    assert manager.get_quota(0) == used_bytes(manager) > quota
    caches = [manager.create_kv_cache() for _ in range(32)]
    for cache in caches:
        assert cache.resume()  # the 32nd resumes with 31 of 34 slots in use: under 0.95
        cache.capacity = 1
    for cache in caches:
        cache.close()
    manager.shutdown()

