"""Priority-LRU eviction against an independent model (``tests/eviction_model.py``): seeded random workloads of
serve / suspend / resume / close / private pressure run through the real manager (cpu backend, FakeEngine content
checks) and the model; after every step the tree's blocks and their tiers (from KV events), the reusable prefix of
each prompt (``probe_reuse``) and each tier's free slots must agree."""

from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheRequest,
    LayerConfig,
    LifeCycle,
    Priority,
    PriorityCallback,
)
from kv_cache_manager_v2._introspection import (
    life_cycle_pool_group_indices,
    ssm_life_cycle_id,
    storage_statistics,
    swa_life_cycle_ids,
)
from kv_cache_manager_v2.testing import FakeEngine
from tests.eviction_model import EvictionModel, Key, Path
from tests.helpers import KIB, attention, make_config, ssm

TPB = 4
SLOT = 2 * KIB  # one layer, K and V of 1 KiB per block


@dataclass(frozen=True)
class SsmOptions:
    """The SSM snapshot settings of a hybrid setup (left at the manager's defaults without SSM layers)."""

    reuse_interval: int = 512
    save_last_snapshot: bool = False


def block_tokens(variant: int, ordinal: int, shared: int = 0) -> list[int]:
    """Block ``ordinal`` of a prompt; its first ``shared`` tokens are the same in every variant."""
    return [1 + (position >= shared) * variant * 1_000 + ordinal * 10 + position for position in range(TPB)]


class TierObserver:
    """Each tree block's page of each layer group and its tier, as the manager's KV events tell it."""

    def __init__(self) -> None:
        self.paths: dict[bytes, Path] = {}
        self.levels: dict[Key, int] = {}

    def read(self, manager: KVCacheManager) -> None:
        for event in manager.get_latest_events():
            if event.kind == "stored":
                parent = () if event.parent_hash is None else self.paths.get(event.parent_hash, ())
                path = parent + tuple(int(token) for token in event.tokens)
                self.paths[event.block_hash] = path
                self.levels[(event.layer_group_id, path)] = event.level
            elif event.kind == "updated":
                self.levels[(event.layer_group_id, self.paths[event.block_hash])] = event.level
            else:
                del self.levels[(event.layer_group_id, self.paths[event.block_hash])]


@dataclass
class Run:
    manager: KVCacheManager
    model: EvictionModel
    engine: FakeEngine
    observer: TierObserver = field(default_factory=TierObserver)
    suspended: dict[int, tuple[KVCache, list[int]]] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)
    initial_slots: list[list[int]] = field(default_factory=list)
    next_id: int = 0
    log: list[str] = field(default_factory=list)
    shared_tokens: int = 0  # how many first tokens of a block its variants share (partial reuse)

    def block(self, rng: random.Random, ordinal: int) -> list[int]:
        """A random variant of block ``ordinal``: three, or with shared tokens two (one partial match at most)."""
        variants = (0, 1) if self.shared_tokens else (0, 0, 1, 2)
        return block_tokens(rng.choice(variants), ordinal, self.shared_tokens)


@dataclass(frozen=True)
class Priorities:
    """What a request's priority callback answers: by block ordinal (cycling), or ``windowed`` for every page of a
    windowed layer group when set."""

    by_ordinal: tuple[int, ...]
    windowed: int | None = None

    def of(self, ordinal: int, windowed: bool) -> int:
        if windowed and self.windowed is not None:
            return self.windowed
        return self.by_ordinal[ordinal % len(self.by_ordinal)]


def priority_callbacks(run: Run, priorities: Priorities) -> tuple[PriorityCallback, Callable[[int, int], int]]:
    """The callback handed to the manager and the model's twin of it (block ordinal, layer group id)."""

    def callback(ordinal: int, life_cycle: LifeCycle) -> Priority:
        return Priority(priorities.of(ordinal, life_cycle.window_size is not None))

    def of(ordinal: int, lc: int) -> int:
        return priorities.of(ordinal, run.model.windows[lc] is not None)

    return callback, of


def open_cache(run: Run, tokens: list[int], priorities: Priorities) -> tuple[KVCache, int]:
    callback, of = priority_callbacks(run, priorities)
    cache_id = run.next_id
    run.next_id += 1
    cache = run.manager.create_kv_cache(None, tokens, id=cache_id, custom_priority_callback=callback)
    expected = run.model.create(cache_id, tokens, of)
    assert cache.num_committed_tokens == expected, run.log
    return cache, cache_id


def compute(run: Run, cache: KVCache, cache_id: int, tokens: list[int], extra: int) -> bool:
    """Resume, compute ``tokens`` (and ``extra`` uncommitted blocks), commit the prompt; False if refused."""
    resumed = cache.resume()
    assert resumed == run.model.resume(cache_id, run.manager.config.max_util_for_resume), run.log
    if not resumed:
        return False
    run.engine.check(cache, tokens)
    # An SSM live state is the state after every token computed: a hybrid cache computes its prompt only, then
    # allocates its extra blocks (as a decode step does); a commit ending at the capacity snapshots.
    hybrid = run.model.ssm is not None
    capacity = len(tokens) + extra * TPB
    computed = len(tokens) if hybrid else capacity
    grown = cache.resize(computed)
    assert grown == run.model.resize(cache_id, computed), run.log
    if not grown:
        return False
    run.engine.step(cache, tokens + [0] * (computed - len(tokens)))
    cache.commit(tokens[cache.num_committed_tokens :])
    run.model.commit(cache_id, len(tokens))
    if capacity > computed:
        grown = cache.resize(capacity)
        assert grown == run.model.resize(cache_id, capacity), run.log
    return grown


def random_prompt(run: Run, rng: random.Random) -> list[int]:
    blocks = rng.randint(1, 5)
    return [token for ordinal in range(blocks) for token in run.block(rng, ordinal)]


def serve(run: Run, rng: random.Random, priorities: Priorities, hold: bool) -> None:
    serve_prompt(run, random_prompt(run, rng), priorities, hold and len(run.suspended) < 2)


def serve_prompt(run: Run, tokens: list[int], priorities: Priorities, hold: bool) -> None:
    """Compute and commit a prompt reusing what the cache has; close it, or (``hold``, with an uncommitted block
    more) keep it suspended."""
    run.log.append(f"{'hold' if hold else 'serve'} {len(tokens) // TPB} blocks {tokens[::TPB]} priorities {priorities}")
    run.prompts.append(tokens)
    cache, cache_id = open_cache(run, tokens, priorities)
    if compute(run, cache, cache_id, tokens, 1 if hold else 0) and hold:
        cache.suspend()
        run.model.suspend(cache_id)
        run.suspended[cache_id] = (cache, tokens)
        return
    cache.close()
    run.model.close(cache_id)


def resume_one(run: Run, rng: random.Random) -> None:
    cache_id = rng.choice(sorted(run.suspended))
    cache, tokens = run.suspended[cache_id]
    run.log.append(f"resume {cache_id}")
    resumed = cache.resume()
    assert resumed == run.model.resume(cache_id, run.manager.config.max_util_for_resume), run.log
    if resumed:
        run.engine.check(cache, tokens)
        cache.suspend()
        run.model.suspend(cache_id)


def decode(run: Run, rng: random.Random) -> None:
    """A suspended cache's next block: resumed, its uncommitted block computed and committed (the history moves:
    a window passes blocks), one more block allocated, suspended again."""
    cache_id = rng.choice(sorted(run.suspended))
    cache, tokens = run.suspended[cache_id]
    grown = tokens + run.block(rng, len(tokens) // TPB)
    run.log.append(f"decode {cache_id} block {grown[-TPB]}")
    resumed = cache.resume()
    assert resumed == run.model.resume(cache_id, run.manager.config.max_util_for_resume), run.log
    if not resumed:
        return
    run.engine.step(cache, grown)
    cache.commit(grown[cache.num_committed_tokens :])
    run.model.extend(cache_id, grown)
    run.model.commit(cache_id, len(grown))
    run.prompts.append(grown)
    run.suspended[cache_id] = (cache, grown)
    capacity = len(grown) + TPB
    grew = cache.resize(capacity)
    assert grew == run.model.resize(cache_id, capacity), run.log
    cache.suspend()
    run.model.suspend(cache_id)
    if not grew:  # no room for its next block: the request ends
        close_one(run, cache_id)


def placement_hint(run: Run, rng: random.Random) -> None:
    cache_id = rng.choice(sorted(run.suspended))
    cache, _ = run.suspended[cache_id]
    hint = rng.choice(("offload", "prefetch", "prefetch evicting"))
    run.log.append(f"{hint} {cache_id}")
    if hint == "offload":
        assert cache.offload() == run.model.offload(cache_id), run.log
    else:
        evict = hint == "prefetch evicting"
        util = run.manager.config.max_util_for_resume
        assert cache.prefetch(evict=evict) == run.model.prefetch(cache_id, evict, util), run.log


def close_one(run: Run, cache_id: int) -> None:
    run.log.append(f"close {cache_id}")
    cache, _ = run.suspended.pop(cache_id)
    cache.close()
    run.model.close(cache_id)


def pressure(run: Run, rng: random.Random, priorities: Priorities) -> None:
    pressure_blocks(run, rng.randint(1, 4), priorities)


def pressure_blocks(run: Run, blocks: int, priorities: Priorities) -> None:
    """Private pages of a cache with no input tokens (a new request's first chunk), then closed."""
    run.log.append(f"pressure {blocks} blocks priorities {priorities}")
    cache, cache_id = open_cache(run, [], priorities)
    resumed = cache.resume()
    assert resumed == run.model.resume(cache_id, run.manager.config.max_util_for_resume), run.log
    if resumed:
        assert cache.resize(blocks * TPB) == run.model.resize(cache_id, blocks * TPB), run.log
    cache.close()
    run.model.close(cache_id)


def change_quota(run: Run, rng: random.Random) -> None:
    """``manager.resize`` of a tier with one pool group (every cache is suspended between steps)."""
    level = rng.randrange(len(run.initial_slots))
    if len(run.initial_slots[level]) != 1:
        return
    count = rng.randint(max(0, run.initial_slots[level][0] - 4), run.initial_slots[level][0])
    run.log.append(f"quota of tier {level}: {count} slots")
    assert run.manager.resize(level, count * SLOT) == run.model.resize_tier(level, count), run.log


def clear(run: Run) -> None:
    run.log.append("clear reusable blocks")
    for cache_id in sorted(run.suspended):
        close_one(run, cache_id)
    run.manager.clear_reusable_blocks()
    run.model.clear()


def batch(run: Run, rng: random.Random, priority_choices: list[Priorities]) -> None:
    """``create_kv_cache_batch`` of 2 or 3 prompts with different first blocks; each admitted one is computed,
    committed and closed in order."""
    variants = rng.sample(range(3), rng.randint(2, 3))
    prompts = [
        block_tokens(variant, 0) + random_prompt(run, rng)[TPB : TPB * rng.randint(1, 5)] for variant in variants
    ]
    priorities = [rng.choice(priority_choices) for _ in prompts]
    run.log.append(f"batch {[tokens[::TPB] for tokens in prompts]} priorities {priorities}")
    run.prompts.extend(prompts)
    requests: list[KVCacheRequest] = []
    modelled: list[tuple[int, list[int], Callable[[int, int], int]]] = []
    for tokens, chosen in zip(prompts, priorities):
        callback, of = priority_callbacks(run, chosen)
        requests.append(KVCacheRequest(tokens, id=run.next_id, custom_priority_callback=callback))
        modelled.append((run.next_id, tokens, of))
        run.next_id += 1
    caches = run.manager.create_kv_cache_batch(requests)
    admitted = run.model.create_batch(modelled, run.manager.config.max_util_for_resume)
    assert [cache is not None for cache in caches] == admitted, (admitted, run.log)
    for cache, (cache_id, tokens, _) in zip(caches, modelled):
        if cache is not None:
            run.engine.step(cache, tokens)
            cache.commit(tokens[cache.num_committed_tokens :])
            run.model.commit(cache_id, len(tokens))
    for cache, (cache_id, _, _) in zip(caches, modelled):
        if cache is not None:
            cache.close()
            run.model.close(cache_id)


def step(run: Run, rng: random.Random, priority_choices: list[Priorities]) -> None:
    action = rng.choices(
        ("serve", "hold", "resume", "decode", "hint", "close", "pressure", "quota", "clear", "batch"),
        (24, 8, 6, 6, 8, 8, 8, 3, 1, 6),
    )[0]
    priorities = rng.choice(priority_choices)
    if action in ("serve", "hold"):
        serve(run, rng, priorities, action == "hold")
    elif action == "batch" and not run.shared_tokens:  # prompts sharing a block's first tokens share in a batch
        batch(run, rng, priority_choices)
    elif action == "pressure":
        pressure(run, rng, priorities)
    elif action == "quota":
        change_quota(run, rng)
    elif action == "clear":
        clear(run)
    elif run.suspended:
        if action == "resume":
            resume_one(run, rng)
        elif action == "decode":
            decode(run, rng)
        elif action == "hint":
            placement_hint(run, rng)
        else:
            close_one(run, rng.choice(sorted(run.suspended)))


def compare(run: Run) -> None:
    run.manager.check_invariants()
    run.observer.read(run.manager)
    observed, modelled = run.observer.levels, run.model.levels()
    differing = {path: (observed.get(path), modelled.get(path)) for path in observed.keys() | modelled.keys()}
    differing = {path: levels for path, levels in differing.items() if levels[0] != levels[1]}
    assert not differing, f"(manager, model) tiers {differing} after {run.log}"
    for level, pool_groups in enumerate(run.model.slots):
        for group in range(len(pool_groups)):
            free = storage_statistics(run.manager, level)[group].free
            assert free == run.model.free(level, group), (level, group, run.log)
    for tokens in run.prompts[-8:]:
        assert run.manager.probe_reuse(None, tokens) == run.model.match(tokens)[0], (tokens, run.log)


def build_run(
    tier_slots: list[int],
    disk: str | None = None,
    layers: Sequence[LayerConfig] | None = None,
    partial_reuse: bool = False,
    ssm_options: SsmOptions | None = None,
) -> Run:
    """A manager with a GPU tier, then a host tier, then a disk tier (in ``disk``) with room for those numbers of
    ``SLOT``s (one full-attention layer of ``SLOT`` bytes a block unless ``layers``), and its model. With
    ``partial_reuse``, a prompt's blocks come in two variants sharing their first half: a request whose block is
    not cached reuses that half of the other's."""
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig] = [
        GpuCacheTierConfig(tier_slots[0] * SLOT)
    ]
    if len(tier_slots) > 1:
        tiers.append(HostCacheTierConfig(tier_slots[1] * SLOT))
    if len(tier_slots) > 2:
        assert disk is not None
        tiers.append(DiskCacheTierConfig(tier_slots[2] * SLOT, disk))
    layers = layers or [attention(0, KIB)]
    options = ssm_options or SsmOptions()
    step = BatchDesc([KVCacheDesc(capacity=5 * TPB, history_length=5 * TPB - 1)] * 2)  # splits pool groups alike
    config = make_config(
        layers,
        tiers=tiers,
        tokens_per_block=TPB,
        enable_partial_reuse=partial_reuse,
        enable_kv_events=True,
        typical_step=step,
        ssm_reuse_interval=options.reuse_interval,
        mamba_save_last_snapshot=options.save_last_snapshot,
    )
    manager = KVCacheManager(config)
    slots = [[group.total for group in storage_statistics(manager, level)] for level in range(len(tiers))]
    if len(layers) == 1:
        assert slots == [[count] for count in tier_slots]
    windowed = [
        layer for layer in layers if isinstance(layer, AttentionLayerConfig) and layer.sliding_window_size is not None
    ]
    window = None if not windowed else (windowed[0].sliding_window_size or 0, windowed[0].num_sink_tokens or 0)
    windows = [window if lc in swa_life_cycle_ids(manager) else None for lc in range(manager.num_layer_groups)]
    model = EvictionModel(
        slots,
        TPB,
        windows,
        life_cycle_pool_group_indices(manager),
        partial_reuse,
        ssm_life_cycle_id(manager),
        options.reuse_interval,
        options.save_last_snapshot,
    )
    run = Run(manager, model, FakeEngine(manager), initial_slots=[list(counts) for counts in slots])
    run.shared_tokens = TPB // 2 if partial_reuse else 0
    return run


def run_workload(
    seed: int,
    tier_slots: list[int],
    priority_choices: list[Priorities],
    steps: int,
    disk: str | None = None,
    layers: Sequence[LayerConfig] | None = None,
    partial_reuse: bool = False,
    ssm_options: SsmOptions | None = None,
) -> EvictionModel:
    """``steps`` random steps on ``build_run``'s manager and model, compared after each."""
    run = build_run(tier_slots, disk, layers, partial_reuse, ssm_options)
    manager = run.manager
    rng = random.Random(seed)
    for _ in range(steps):
        step(run, rng, priority_choices)
        compare(run)
    for cache, _ in run.suspended.values():
        cache.close()
    manager.shutdown()
    return run.model


DEFAULT = [Priorities((35,))]
MIXED = [
    Priorities((35,)),
    Priorities((10,)),
    Priorities((80,)),
    Priorities((80, 35, 10)),
    Priorities((10, 35, 80)),
    Priorities((35,), windowed=10),
    Priorities((10,), windowed=80),
]


SEEDS = range(8)
STEPS = 300


def exercised(models: list[EvictionModel]) -> tuple[int, int, list[int]]:
    """Drops, refusals and moves into each tier over several runs (each must happen for a run to mean much)."""
    moves = [sum(model.moves[level] for model in models) for level in range(len(models[0].slots))]
    return sum(model.drops for model in models), sum(model.refusals for model in models), moves


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



WINDOW = 2 * TPB


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


def test_a_copy_source_once_copied_is_room_for_the_next_copy() -> None:
    # GPU only, 9 slots: a cached prompt of 2 blocks (4 pages: full + windowed layer group), 4 pages held by a
    # suspended cache, 1 free. A request sharing block 0 and half of block 1 copies that half in both layer
    # groups: 2 new pages, room for 1 until the first copy's source is filed (reusable, nobody else uses it).
    run = build_run([9], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)], partial_reuse=True)
    prompt = [token for ordinal in range(2) for token in block_tokens(0, ordinal, TPB // 2)]
    serve_prompt(run, prompt, Priorities((35,)), hold=False)
    holder, holder_id = open_cache(run, [], Priorities((35,)))
    assert holder.resume() == run.model.resume(holder_id, 1.0) is True
    assert holder.resize(2 * TPB) == run.model.resize(holder_id, 2 * TPB) is True
    holder.suspend()
    run.model.suspend(holder_id)
    request = prompt[:TPB] + block_tokens(1, 1, TPB // 2)
    cache, cache_id = open_cache(run, request, Priorities((35,)))
    assert cache.num_committed_tokens == TPB + TPB // 2
    assert compute(run, cache, cache_id, request, 0)  # resumed (the model agrees), computed and committed
    cache.close()
    run.model.close(cache_id)
    compare(run)
    holder.close()
    run.manager.shutdown()


def test_windowed_and_full_in_two_pool_groups() -> None:
    layers = [attention(0, KIB), attention(1, 2 * KIB, window=WINDOW)]
    for priorities in (DEFAULT, MIXED):
        models = [run_workload(seed, [24, 16], priorities, STEPS, layers=layers) for seed in SEEDS]
        drops, _, moves = exercised(models)
        assert drops > 100 and moves[1] > 100


def four_block_manager(gpu_slots: int, host_slots: int) -> tuple[KVCacheManager, list[int], TierObserver]:
    """A GPU + host manager with one prompt of 4 blocks computed and cached."""
    config = make_config(
        [attention(0, KIB)],
        tiers=[GpuCacheTierConfig(gpu_slots * SLOT), HostCacheTierConfig(host_slots * SLOT)],
        tokens_per_block=TPB,
        enable_partial_reuse=False,
        enable_kv_events=True,
    )
    manager = KVCacheManager(config)
    tokens = [token for ordinal in range(4) for token in block_tokens(0, ordinal)]
    first = manager.create_kv_cache(None, tokens)
    assert first.resume() and first.resize(len(tokens))
    FakeEngine(manager).step(first, tokens)
    first.commit(tokens)
    first.close()
    observer = TierObserver()
    observer.read(manager)
    return manager, tokens, observer


def ordinals_at(observer: TierObserver, manager: KVCacheManager, level: int) -> list[int]:
    observer.read(manager)
    return sorted(len(path) // TPB - 1 for (_, path), at in observer.levels.items() if at == level)


def add_pressure(manager: KVCacheManager, blocks: int) -> None:
    pressure = manager.create_kv_cache()
    assert pressure.resume() and pressure.resize(blocks * TPB)
    pressure.close()


@pytest.mark.parametrize("resume_first", [False, True])
def test_a_suspended_caches_deepest_blocks_leave_the_gpu_first(resume_first: bool) -> None:
    # As a closed cache's: eviction shortens the GPU-resident prefix, it does not cut its head. The cache is held
    # since create_kv_cache (resume_first: resumed, then suspended).
    manager, tokens, observer = four_block_manager(5, 4)
    cache = manager.create_kv_cache(None, tokens)
    if resume_first:
        assert cache.resume()
        cache.suspend()
    add_pressure(manager, 3)
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_offload_into_few_free_slots_sends_the_deepest_blocks() -> None:
    manager, tokens, observer = four_block_manager(5, 2)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.offload() == 2
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_prefetched_pages_leave_the_gpu_deepest_first() -> None:
    manager, tokens, observer = four_block_manager(5, 4)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.offload() == 4
    assert cache.prefetch() == 4
    add_pressure(manager, 3)
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_every_layer_groups_last_block_is_evicted_before_an_earlier_block() -> None:
    # A full-attention and a windowed layer group in one pool group: a closed cache's pages are filed block by
    # block, so eviction takes the last block's pages of both groups before the full group's earlier blocks (full
    # attention reuses nothing past a block without a page: the windowed pages of later blocks would stay for
    # nothing). The window's first blocks, filed when it passed them, go first.
    run = build_run([8], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)])
    tokens = [token for ordinal in range(4) for token in block_tokens(0, ordinal)]
    cache, cache_id = open_cache(run, tokens, Priorities((35,)))
    assert compute(run, cache, cache_id, tokens, 0)
    cache.close()
    add_pressure(run.manager, 2)  # 4 pages of 2 layer groups
    run.observer.read(run.manager)
    kept = sorted((lc, len(path) // TPB - 1) for lc, path in run.observer.levels)
    full, windowed = sorted(set(range(2)) - set(swa_life_cycle_ids(run.manager))) + swa_life_cycle_ids(run.manager)
    assert kept == sorted([(full, 0), (full, 1), (full, 2), (windowed, 2)])
    run.manager.shutdown()


def test_a_quota_shrink_keeps_the_lru_order_of_the_pages_it_compacts() -> None:
    # Prompts A then B (4 blocks each) fill 8 GPU slots, B's in slots 4-7. Shrinking to 6 slots drops A's last two
    # blocks and moves B's pages out of slots 6 and 7: a move inside the tier, not a use, so B's last block stays
    # the next victim after A's.
    run = build_run([8])
    prompts = [[token for ordinal in range(4) for token in block_tokens(variant, ordinal)] for variant in (1, 2)]
    for tokens in prompts:
        cache, cache_id = open_cache(run, tokens, Priorities((35,)))
        assert compute(run, cache, cache_id, tokens, 0)
        cache.close()
    assert run.manager.resize(0, 6 * SLOT)
    assert run.manager.probe_reuse(None, prompts[0]) == 2 * TPB
    add_pressure(run.manager, 3)
    assert run.manager.probe_reuse(None, prompts[0]) == 0
    assert run.manager.probe_reuse(None, prompts[1]) == 3 * TPB
    run.manager.shutdown()



def test_a_window_releases_a_page_its_committed_block_no_longer_uses() -> None:
    # Cache A keeps its committed prompt suspended on the host tier; B recomputes its first two blocks, so the tree
    # takes B's GPU pages and A's colder ones leave it (A keeps using them). Once A's window has passed block 1, A's
    # windowed page of it serves nothing and must be freed, not held until A closes.
    run = build_run([8, 7], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)])
    prompt = [token for ordinal in range(3) for token in block_tokens(0, ordinal)]
    serve_prompt(run, prompt, Priorities((35,)), hold=True)
    ((cache_id, (cache, _)),) = run.suspended.items()
    assert cache.offload() == run.model.offload(cache_id) == 7
    pressure_blocks(run, 4, Priorities((35,)))  # drops A's windowed block 0 (reusable, no colder room)
    serve_prompt(run, prompt[: 2 * TPB], Priorities((35,)), hold=False)
    compare(run)
    decode(run, random.Random(0))  # A resumes, computes and commits block 3: its window passes block 1
    compare(run)
    cache.close()
    run.manager.shutdown()


HYBRID: list[LayerConfig] = [attention(0, KIB), ssm(1, KIB, KIB)]  # the SSM group: a pool group of its own, one slot a state
EVERY_BLOCK = SsmOptions(reuse_interval=TPB)  # a snapshot at each commit ending a computed chunk on a block


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
