"""Priority-LRU eviction against an independent model (``tests/eviction_model.py``): seeded random workloads of
serve / suspend / resume / close / private pressure run through the real manager (cpu backend, FakeEngine content
checks) and the model; after every step the tree's blocks and their tiers (from KV events), the reusable prefix of
each prompt (``probe_reuse``) and each tier's free slots must agree."""

from __future__ import annotations

import pathlib

from tests.eviction_workload import (
    DEFAULT,
    EVERY_BLOCK,
    HYBRID,
    MIXED,
    SEEDS,
    STEPS,
    TPB,
    WINDOW,
    SsmOptions,
    exercised,
    run_workload,
)
from tests.helpers import KIB, attention


def test_gpu_only() -> None:
    for priorities in (DEFAULT, MIXED):
        drops, refusals, _ = exercised([run_workload(seed, [12], priorities, STEPS) for seed in SEEDS])
        assert drops > 100 and refusals > 10


def test_gpu_and_host() -> None:
    for priorities in (DEFAULT, MIXED):
        drops, refusals, moves = exercised([run_workload(seed, [10, 8], priorities, STEPS) for seed in SEEDS])
        assert drops > 100 and moves[1] > 100


def test_gpu_host_and_disk(tmp_path: pathlib.Path) -> None:
    for priorities in (DEFAULT, MIXED):
        models = [run_workload(seed, [8, 4, 6], priorities, STEPS, str(tmp_path)) for seed in SEEDS]
        drops, refusals, moves = exercised(models)
        assert drops > 100 and moves[1] > 100 and moves[2] > 100


def test_windowed_and_full_sharing_one_pool_group() -> None:
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    for priorities in (DEFAULT, MIXED):
        models = [run_workload(seed, [16, 10], priorities, STEPS, layers=layers) for seed in SEEDS]
        drops, _, moves = exercised(models)
        assert drops > 100 and moves[1] > 100


def test_windowed_with_sinks_and_full() -> None:
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW, sinks=TPB + 1)]  # 2 sink blocks
    for priorities in (DEFAULT, MIXED):
        models = [run_workload(seed, [16, 10], priorities, STEPS, layers=layers) for seed in SEEDS]
        drops, _, moves = exercised(models)
        assert drops > 100 and moves[1] > 100


def test_windowed_and_full_on_three_tiers(tmp_path: pathlib.Path) -> None:
    layers = [attention(0, KIB), attention(1, KIB, window=3 * TPB)]
    models = [run_workload(seed, [12, 8, 8], MIXED, STEPS, str(tmp_path), layers) for seed in SEEDS]
    drops, _, moves = exercised(models)
    assert drops > 100 and moves[1] > 100 and moves[2] > 100


def test_a_page_leaving_the_tree_for_a_recomputed_copy_keeps_its_place(tmp_path: pathlib.Path) -> None:
    # The seeded workload that found it: a suspended cache's full-attention page on the host left the tree for a
    # copy another request recomputed (step 149) and was refiled as used now, so 50 steps later another page went
    # to the disk tier before it.
    run_workload(17, [12, 8, 8], DEFAULT, 210, str(tmp_path), [attention(0, KIB), attention(1, KIB, window=3 * TPB)])


def test_partial_reuse(tmp_path: pathlib.Path) -> None:
    # Blocks in two variants sharing their first half: a request whose block is not cached copies that half of the
    # other variant's page (held until its first resume, then filed with the others).
    windowed = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    for tier_slots, layers in (([12], None), ([10, 8], None), ([8, 4, 6], None), ([16, 10], windowed)):
        models = [run_workload(seed, tier_slots, MIXED, STEPS, str(tmp_path), layers, True) for seed in SEEDS]
        drops, _, moves = exercised(models)
        assert drops > 100 and all(count > 100 for count in moves[1:])
        assert sum(model.partial_matches for model in models) > 100


def test_a_new_cache_holds_its_copy_sources_with_its_blocks_deepest_first(tmp_path: pathlib.Path) -> None:
    # The seeded workload that found it (partial reuse, full + windowed layers sharing a pool group, three tiers):
    # a new cache held the copy-on-write sources group by group before its blocks, in the opposite order to every
    # other filing (within a block, the last layer group first), so at step 397 another source went to the disk.
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    run_workload(27, [12, 8, 8], DEFAULT, 398, str(tmp_path), layers, partial_reuse=True)


def test_a_closing_cache_files_its_unused_copy_sources_deepest_first(tmp_path: pathlib.Path) -> None:
    # The seeded workload that found it: a cache closed before its first resume released its copy sources in
    # layer-group order (step 265), unlike every other filing; a page went to the disk in place of another later.
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    run_workload(33, [12, 8, 8], MIXED, 400, str(tmp_path), layers, partial_reuse=True)


def test_a_resume_makes_room_with_the_copy_sources_it_has_copied(tmp_path: pathlib.Path) -> None:
    # The seeded workload that found it (partial reuse, full + windowed layers in one pool group, the host tier full
    # of held pages): a new cache copying the first half of a block in both layer groups needed 2 GPU pages with 1
    # free or reusable; the resume copies one group's source, files it, and can drop it for the second copy, but
    # the room check counted both sources as kept, so the resume was refused ("2 GPU pages needed in pool group 0,
    # 1 free or reusable").
    # On three tiers (seed 189, step 119): '4 GPU pages needed in pool group 0, 1 free or reusable'.
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    run_workload(50, [16, 10], MIXED, 200, str(tmp_path), layers, partial_reuse=True)
    run_workload(189, [12, 8, 8], DEFAULT, 120, str(tmp_path), layers, partial_reuse=True)


def test_a_block_a_live_cache_committed_stays_in_the_walk_without_pages(tmp_path: pathlib.Path) -> None:
    # The seeded workload that found it (partial reuse, full + windowed, three tiers; step 250): a suspended cache
    # had committed block 4 (41, 42, 43, 44), whose pages were all evicted since; the manager keeps the block
    # (a live cache uses it), so a later prompt with that block walks into it and reuses 16 tokens, not 18 from the
    # sibling (41, 42, 1043, 1044). The model pruned a block with no page left and matched 18.
    layers = [attention(0, KIB), attention(1, KIB, window=WINDOW)]
    run_workload(223, [12, 8, 8], DEFAULT, 251, str(tmp_path), layers, partial_reuse=True)


def test_windowed_and_full_in_two_pool_groups() -> None:
    layers = [attention(0, KIB), attention(1, 2 * KIB, window=WINDOW)]
    for priorities in (DEFAULT, MIXED):
        models = [run_workload(seed, [24, 16], priorities, STEPS, layers=layers) for seed in SEEDS]
        drops, _, moves = exercised(models)
        assert drops > 100 and moves[1] > 100


def test_hybrid(tmp_path: pathlib.Path) -> None:
    # Snapshots at every block (the prompt's end, the interval, or mamba_save_last_snapshot) or every other block
    # past the prompt, on two and three tiers: snapshots and live states compete for the SSM group's few slots.
    for tier_slots, options, priorities in (
        ([12, 8], EVERY_BLOCK, MIXED),
        ([12, 8, 8], SsmOptions(2 * TPB), MIXED),
        ([12, 8], SsmOptions(0, save_last_snapshot=True), DEFAULT),
    ):
        models = [
            run_workload(seed, tier_slots, priorities, STEPS, str(tmp_path), HYBRID, ssm_options=options)
            for seed in SEEDS
        ]
        drops, refusals, moves = exercised(models)
        assert drops > 100 and refusals > 10 and all(count > 100 for count in moves[1:])
        assert sum(model.snapshot_matches for model in models) > 100


def test_a_batch_refusing_one_request_keeps_the_snapshot_an_admitted_one_copied_filed_as_used(
    tmp_path: pathlib.Path,
) -> None:
    # The seeded workload that found it (hybrid, GPU + host; step 215): a batch admitted a request whose resume
    # copied the snapshot it matched (filed as used now) and refused the next; putting the refused request's
    # matched pages back in their LRU places also put back the admitted one's snapshot, so the next commit's
    # snapshot evicted it to the host before an older live state.
    run_workload(1, [12, 8], MIXED, 216, layers=HYBRID, ssm_options=EVERY_BLOCK)
