"""The harness of the eviction-model tests (``tests/test_eviction_model.py``, ``tests/test_eviction_order.py``,
``tools/eviction_model_sweep.py``): a manager (cpu backend, KV events) and ``tests/eviction_model.py``'s model driven
with the same calls (serve / hold / resume / decode / placement hints / close / private pressure / quota changes /
batches), and ``compare``: after a step the tree's blocks and their tiers (from KV events), each tier's free slots
and the reusable prefix of recent prompts (``probe_reuse``) must agree."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

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
    assert cache.num_committed_tokens == expected, (f"reuse: manager {cache.num_committed_tokens}, model {expected}", run.log)
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


WINDOW = 2 * TPB
HYBRID: list[LayerConfig] = [attention(0, KIB), ssm(1, KIB, KIB)]  # the SSM group: a pool group of its own, one slot a state
EVERY_BLOCK = SsmOptions(reuse_interval=TPB)  # a snapshot at each commit ending a computed chunk on a block
