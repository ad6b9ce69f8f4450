"""The harness of ``tests/test_reuse_model.py``: seeded random workloads (prompt families sharing a prefix,
conversations whose next turn extends an earlier one, branches inside and at the edge of blocks, suspended caches,
batches, planned drops, evictions under small quotas) run through the real manager and ``tests/reuse_model.py``'s
model (``Run``), each request's reuse, tallies and ``snapshot_points`` compared, and after every call the pages the
KV events say are stored against the model's (``Run.sync``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheRequest,
    _introspection,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm
from tests.reuse_model import Group, Path, ReuseModel

STEPS = 60


@dataclass(frozen=True)
class Setup:
    """One model shape and its reuse options."""

    kinds: tuple[Group, ...]
    tokens_per_block: int
    gpu_slots: int = 0  # 0: room for everything (no eviction)
    host_slots: int = 0
    options: tuple[tuple[str, object], ...] = ()

    @property
    def block_bytes(self) -> int:
        """K (and V) bytes of one block: 64 a token, a multiple of 8 as the FakeEngine needs."""
        return 64 * self.tokens_per_block

    def layers(self) -> list[LayerConfig]:
        layers: list[LayerConfig] = []
        for layer_id, group in enumerate(self.kinds):
            if group.kind == "ssm":
                layers.append(ssm(layer_id, state=KIB, conv=KIB // 4))
            elif group.kind == "window":
                sinks = group.sink_blocks * self.tokens_per_block or None
                layers.append(attention(layer_id, self.block_bytes, window=group.window, sinks=sinks))
            else:
                layers.append(attention(layer_id, self.block_bytes))
        return layers


class EventPages:
    """Each tree block's pages (path, layer group) as the manager's KV events tell it. A block's path is found from
    its tokens: every token of a workload is drawn once, after one prefix (``before`` holds the token before it),
    so a block whose parent never had a page (no event named it) is placed too."""

    def __init__(self) -> None:
        self.before: dict[int, int] = {}
        self.paths: dict[bytes, Path] = {}
        self.stored: set[tuple[Path, int]] = set()
        self.removed: set[tuple[Path, int]] = set()  # since the last read, less what was stored again after

    def path(self, last: int) -> Path:
        path = [last]
        while path[-1] in self.before:
            path.append(self.before[path[-1]])
        return tuple(reversed(path))

    def read(self, manager: KVCacheManager) -> None:
        for event in manager.get_latest_events():
            if event.kind == "updated":
                continue
            if event.kind == "stored":
                path = self.path(int(event.tokens[-1]))
                assert path[len(path) - len(event.tokens) :] == tuple(int(token) for token in event.tokens)
                self.paths[event.block_hash] = path
                self.stored.add((path, event.layer_group_id))
                self.removed.discard((path, event.layer_group_id))
            else:
                path = self.paths[event.block_hash]
                self.stored.discard((path, event.layer_group_id))
                self.removed.add((path, event.layer_group_id))


@dataclass
class Request:
    cache: KVCache
    tokens: list[int]
    prompt_length: int
    points: tuple[int, ...]
    decode: int


@dataclass
class Run:
    setup: Setup
    rng: random.Random
    manager: KVCacheManager
    model: ReuseModel
    engine: FakeEngine
    events: EventPages = field(default_factory=EventPages)
    histories: list[list[int]] = field(default_factory=list)
    suspended: list[Request] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    next_token: int = 1
    reused: list[int] = field(default_factory=list)
    evictions: int = 0  # pages the KV events say left the tree (a sibling absorbing a partial block aside)
    refusals: int = 0

    def fresh(self, count: int, after: list[int]) -> list[int]:
        """``count`` tokens never drawn before, to follow ``after``."""
        tokens = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        chain = after[-1:] + tokens
        for previous, token in zip(chain, chain[1:]):
            self.events.before[token] = previous
        return tokens

    def sync(self) -> None:
        """Apply the evictions the events report to the model, then compare the stored pages."""
        self.events.read(self.manager)
        for path, group in self.events.removed:
            self.evictions += group in self.model.pages.get(path, {})
            self.model.remove(path, group)
        self.events.removed.clear()
        self.forget_gone_narrow_pages()
        if self.setup.gpu_slots:  # small quotas: a copy may find no room (else every one must be there)
            self.model.skipped(self.events.stored)
        self.model.copies.clear()
        modelled = self.model.whole_pages()
        if modelled != self.events.stored:
            extra = sorted((len(p), g) for p, g in modelled - self.events.stored)
            missing = sorted((len(p), g) for p, g in self.events.stored - modelled)
            self.fail(f"stored pages differ: (length, group) modelled only {extra}, stored only {missing}")

    def forget_gone_narrow_pages(self) -> None:
        """A page narrower than its block sends no KV event, also when a planned drop or an eviction removes it:
        ask the tree (``reuse_match_pages``) whether each such page of the model is still there."""
        for path, group, width in self.model.narrow_pages():
            length, pages = _introspection.reuse_match_pages(self.manager, None, path, group)
            page = pages[-1] if length == len(path) and pages else None
            if page is None or page[1] is None or page[1] < width:
                self.model.remove(path, group)

    def fail(self, message: str) -> None:
        raise AssertionError("\n".join(self.log[-12:] + [message]))

    def prompt(self) -> tuple[list[int], list[int]]:
        """A new prompt: a new family, a branch of an earlier one, or the next turn of an earlier conversation."""
        rng, tpb = self.rng, self.setup.tokens_per_block
        choice = rng.random()
        if not self.histories or choice < 0.2:
            tokens = self.fresh(rng.randint(1, 6 * tpb), [])
            self.log.append(f"new family of {len(tokens)}")
        elif choice < 0.55:
            base = rng.choice(self.histories)
            cut = rng.choice([rng.randint(0, len(base)), len(base) // tpb * tpb, len(base)])
            tokens = base[:cut] + self.fresh(rng.randint(0 if cut else 1, 3 * tpb), base[:cut])
            self.log.append(f"branch at {cut} of a history of {len(base)}: {len(tokens)} tokens")
        else:
            base = rng.choice(self.histories)
            tokens = base + self.fresh(rng.randint(1, 2 * tpb), base)
            self.log.append(f"next turn of a history of {len(base)}: {len(tokens)} tokens")
        snapshot_at = [rng.randint(1, len(tokens))] if rng.random() < 0.3 else []
        return tokens, snapshot_at

    def note_live(self) -> None:
        """Tell the model the blocks the open (suspended) caches use: the tree keeps them, pages or not."""
        tpb = self.setup.tokens_per_block
        self.model.live = [
            tuple(request.tokens[: request.cache.num_committed_tokens // tpb * tpb]) for request in self.suspended
        ]

    def admit(self, prompt: tuple[list[int], list[int]] | None = None) -> None:
        """A new request (``prompt``: its tokens and ``snapshot_at``, else a random one): reuse checked, then
        prefilled, decoded and closed, or suspended."""
        self.note_live()
        tokens, snapshot_at = prompt or self.prompt()
        expected = self.model.reuse(tokens)
        probed = self.manager.probe_reuse(None, tokens)
        self.manager.get_and_reset_iteration_stats()
        self.manager.get_and_reset_ssm_snapshot_iteration_stats()
        cache = self.manager.create_kv_cache(None, tokens, snapshot_at=snapshot_at)
        self.sync()
        self.check_tallies(len(tokens), cache.num_committed_tokens)
        got = cache.num_committed_tokens
        self.log.append(f"  reuse {got} (model {expected}, probe {probed}), snapshot_at {snapshot_at}")
        self.reused.append(got)
        if got != expected or probed != got:
            self.fail(f"reuse of {len(tokens)} tokens: manager {got}, probe_reuse {probed}, model {expected}")
        points = self.model.snapshot_points(len(tokens), snapshot_at)
        if tuple(cache.snapshot_points) != points:
            self.fail(f"snapshot_points {tuple(cache.snapshot_points)}, model {points}")
        request = Request(cache, tokens, len(tokens), points, self.rng.randint(0, 2 * self.setup.tokens_per_block))
        if not cache.resume():
            self.log.append("  resume refused: closed")
            self.refusals += 1
            self.finish(request)
            return
        self.engine.check(cache, tokens)
        self.prefill(request)

    def check_tallies(self, length: int, reused: int) -> None:
        """What the statistics say a new cache reused: per attention group the pages it holds (full blocks, and
        a partially reused last block), per SSM group one lookup and whether it hit."""
        tpb = self.setup.tokens_per_block
        for index, stats in self.manager.get_and_reset_iteration_stats().items():
            group = self.setup.kinds[index]
            if group.kind == "ssm":
                continue
            held = self.model.held_blocks(group, reused)
            found = (stats.iter_full_reused_blocks, stats.iter_partial_reused_blocks, stats.iter_missed_blocks)
            wanted = (len(held) - (reused % tpb > 0), int(reused % tpb > 0), -(-length // tpb) - -(-reused // tpb))
            if found != wanted:
                self.fail(f"group {index} reuse tallies (full, partial, missed) {found}, model {wanted}")
        for index, snapshots in self.manager.get_and_reset_ssm_snapshot_iteration_stats().items():
            found = (snapshots.iter_snapshot_hits, snapshots.iter_reused_tokens, snapshots.iter_unreused_tokens)
            if snapshots.iter_snapshot_lookups != 1 or found != (int(reused > 0), reused, length - reused):
                self.fail(f"group {index} snapshot tallies {snapshots}, reused {reused} of {length}")

    def admit_batch(self) -> None:
        """Two or three prompts admitted together (``create_kv_cache_batch``): each reuses what the tree held when
        the batch came (with only full attention a later one also holds the blocks an earlier one computes in
        this step); computed in batch order, each in one chunk."""
        self.note_live()
        prompts = [self.prompt() for _ in range(self.rng.randint(2, 3))]
        expected = [self.model.reuse(tokens) for tokens, _ in prompts]
        self.log.append(f"  probes {[self.manager.probe_reuse(None, tokens) for tokens, _ in prompts]} model {expected}")
        requests = [KVCacheRequest(tokens, snapshot_at=snapshot_at) for tokens, snapshot_at in prompts]
        caches = self.manager.create_kv_cache_batch(requests)
        self.sync()
        self.log.append(f"  as one batch: reuse {[None if c is None else c.num_committed_tokens for c in caches]}")
        for (tokens, snapshot_at), wanted, cache in zip(prompts, expected, caches):
            if cache is None:
                continue
            if cache.num_committed_tokens != wanted:
                self.fail(f"batch reuse of {len(tokens)} tokens: manager {cache.num_committed_tokens}, model {wanted}")
            points = self.model.snapshot_points(len(tokens), snapshot_at)
            request = Request(cache, tokens, len(tokens), points, self.rng.randint(0, self.setup.tokens_per_block))
            self.engine.check(cache, tokens)
            if self.compute(request, len(tokens)):
                self.decode(request)
            else:
                self.finish(request)

    def prefill(self, request: Request) -> None:
        rng, cache, tokens = self.rng, request.cache, request.tokens
        ends = {point for point in request.points if point > cache.history_length}
        for _ in range(rng.randint(0, 2)):
            if cache.history_length < len(tokens):
                ends.add(rng.randint(cache.history_length + 1, len(tokens)))
        ends.add(len(tokens))
        for end in sorted(ends):
            if end <= cache.history_length:
                continue
            if not self.compute(request, end):
                self.finish(request)
                return
        self.log.append(f"  prefilled to {sorted(ends)}")
        if rng.random() < 0.3:
            cache.suspend()
            self.sync()
            self.suspended.append(request)
            self.log.append("  suspended")
            return
        self.decode(request)

    def compute(self, request: Request, end: int) -> bool:
        """One chunk ``[history, end)``: resize, write, commit whole; False when memory is short."""
        cache = request.cache
        if end > cache.history_length:
            if not cache.resize(end, cache.history_length):
                self.log.append(f"  resize to {end} refused")
                self.refusals += 1
                return False
            self.engine.step(cache, request.tokens)
        save = self.model.has_ssm and self.rng.random() < 0.1
        begin = cache.num_committed_tokens  # behind the history over a prefix shared in a batch
        cache.commit(request.tokens[begin:end], save_ssm_snapshot=save)
        self.model.commit_chunk(request.tokens, begin, end, request.prompt_length, request.points)
        if save:
            self.model.save_snapshot(request.tokens, end)
            self.log.append(f"  commit(save_ssm_snapshot=True) at {end}")
        self.sync()
        return True

    def decode(self, request: Request) -> None:
        for _ in range(request.decode):
            request.tokens.extend(self.fresh(1, request.tokens))
            if not self.compute(request, len(request.tokens)):
                request.tokens.pop()
                break
        self.finish(request)

    def finish(self, request: Request) -> None:
        cache = request.cache
        committed = cache.num_committed_tokens
        plan = None
        if self.rng.random() < 0.4:
            save = self.model.has_ssm and committed > 0 and self.rng.random() < 0.4
            cache.stop_committing(save_last_ssm_snapshot=save)
            if save:
                self.model.save_snapshot(request.tokens, committed)
                self.log.append("  stop_committing(save_last_ssm_snapshot=True)")
            if self.model.publishes_at_stop(committed, request.prompt_length, request.points):
                self.model.publish_tail(request.tokens, committed, request.prompt_length, request.points, copy=True)
            self.sync()
            if self.rng.random() < 0.3:
                plan = cache.plan_committed_block_drop()
        cache.close()  # publishes the trailing block, refilling what eviction took from a copy published earlier
        self.model.publish_tail(request.tokens, committed, request.prompt_length, request.points)
        self.sync()
        if plan is not None:
            plan.drop()  # the turn's window blocks and SSM snapshot at its end (the KV events say which)
            self.log.append("  planned drop")
            self.sync()
        self.histories.append(request.tokens[:committed])
        self.log.append(f"  closed at {committed}")

    def fan_out(self) -> None:
        """A system prompt, then 9-12 chat turns after it, each starting with the same turn marker (children of
        one block sharing their first tokens)."""
        rng, tpb = self.rng, self.setup.tokens_per_block
        system = self.fresh(rng.randint(1, 3 * tpb), [])
        marker = self.fresh(rng.randint(1, tpb), system)
        self.log.append(f"fan out after a system prompt of {len(system)}, marker of {len(marker)}")
        for _ in range(rng.randint(9, 12)):
            head = system + marker
            self.admit((head + self.fresh(rng.randint(1, 2 * tpb), head), []))
            self.resume_beyond(2)

    def resume_beyond(self, count: int) -> None:
        """Resume (and finish) suspended requests while more than ``count`` wait: each holds an SSM live state, and
        the model assumes room for every snapshot unless the setup's quotas are small."""
        while len(self.suspended) > count:
            self.resume_one()

    def check_probes(self) -> None:
        """Every recent history's and suspended request's reuse now (``probe_reuse``) is the model's."""
        self.note_live()
        for tokens in self.histories[-6:] + [request.tokens for request in self.suspended]:
            probed, expected = self.manager.probe_reuse(None, tokens), self.model.reuse(tokens)
            if probed != expected:
                self.fail(f"probe_reuse of {len(tokens)} tokens: manager {probed}, model {expected}")

    def resume_one(self) -> None:
        request = self.suspended.pop(self.rng.randrange(len(self.suspended)))
        self.log.append(f"resume a cache of {len(request.tokens)}")
        if not request.cache.resume():
            self.log.append("  refused: closed")
            self.refusals += 1
            self.finish(request)
            return
        self.sync()
        self.engine.check(request.cache, request.tokens)
        self.decode(request)


def model_of(setup: Setup) -> ReuseModel:
    options = dict(setup.options)
    has_ssm = any(group.kind == "ssm" for group in setup.kinds)
    partial = options.get("enable_partial_reuse")
    return ReuseModel(
        tokens_per_block=setup.tokens_per_block,
        groups=setup.kinds,  # one layer per group: layer groups in layer order
        partial_reuse=bool(partial) if partial is not None else not has_ssm,
        backoff=int(options.get("reuse_match_backoff", 0)),  # type: ignore[call-overload]
        interval=int(options.get("ssm_reuse_interval", 512)),  # type: ignore[call-overload]
        last_snapshot=bool(options.get("commit_min_snapshot") or options.get("mamba_save_last_snapshot")),
        prefill_chunks=bool(options.get("snapshot_prefill_chunks", True)),
        scratch=bool(options.get("enable_swa_scratch_reuse")),
    )


def build_run(setup: Setup, seed: int) -> Run:
    """A manager of ``setup``'s shape (KV events on) and its model, with a ``random.Random(seed)``."""
    tpb = setup.tokens_per_block
    slot_bytes = [KIB + KIB // 4 if group.kind == "ssm" else 2 * setup.block_bytes for group in setup.kinds]
    options: dict[str, Any] = dict(setup.options)
    options["enable_kv_events"] = True
    tiers: list[CacheTierConfig] | None = None
    if setup.gpu_slots:  # about that many slots for each layer group
        tiers = [GpuCacheTierConfig(setup.gpu_slots * sum(slot_bytes))]
        if setup.host_slots:
            tiers.append(HostCacheTierConfig(setup.host_slots * sum(slot_bytes)))
        options["initial_pool_ratio"] = slot_bytes
    config = make_config(setup.layers(), tiers=tiers, tokens_per_block=tpb, **options)
    manager = KVCacheManager(config)
    return Run(setup, random.Random(seed), manager, model_of(setup), FakeEngine(manager))


def run_workload(setup: Setup, seed: int, steps: int = STEPS) -> Run:
    run = build_run(setup, seed)
    for _ in range(steps):
        if run.suspended and (len(run.suspended) > 2 or run.rng.random() < 0.3):
            run.resume_one()
        elif run.rng.random() < 0.15:
            run.admit_batch()
        else:
            run.admit()
    while run.suspended:
        run.resume_one()
    run.manager.shutdown()
    return run


FULL = Group("full")
SSM = Group("ssm")

SETUPS = {
    "full": Setup((FULL,), 4),
    "full_tpb3": Setup((FULL,), 3),
    "full_window": Setup((FULL, Group("window", 10)), 4),
    "full_window_sinks": Setup((FULL, Group("window", 7, 1)), 3),
    "window_only_sinks": Setup((Group("window", 9, 2),), 4),
    "full_ssm": Setup((FULL, SSM), 4, options=(("ssm_reuse_interval", 8),)),
    "full_ssm_last": Setup((SSM, FULL), 4, options=(("ssm_reuse_interval", 0), ("mamba_save_last_snapshot", True))),
    "full_ssm_no_chunks": Setup(
        (FULL, SSM), 5, options=(("ssm_reuse_interval", 10), ("snapshot_prefill_chunks", False))
    ),
    "window_ssm": Setup((Group("window", 6), SSM), 4, options=(("ssm_reuse_interval", 8),)),
    "all_three": Setup((FULL, Group("window", 11, 1), SSM), 4, options=(("ssm_reuse_interval", 8),)),
    "all_three_last": Setup(
        (SSM, Group("window", 5), FULL), 3, options=(("commit_min_snapshot", True), ("ssm_reuse_interval", 6))
    ),
    "full_evicting": Setup((FULL,), 4, gpu_slots=24, host_slots=12),
    "full_window_evicting": Setup((FULL, Group("window", 10, 1)), 4, gpu_slots=30, host_slots=12),
    "full_ssm_evicting": Setup((FULL, SSM), 4, gpu_slots=30, host_slots=12, options=(("ssm_reuse_interval", 8),)),
    "all_three_evicting": Setup(
        (Group("window", 7), SSM, FULL), 3, gpu_slots=30, host_slots=12, options=(("ssm_reuse_interval", 6),)
    ),
    "full_ssm_partial": Setup(
        (FULL, SSM), 4, options=(("enable_partial_reuse", True), ("ssm_reuse_interval", 8))
    ),
    "all_three_partial_last": Setup(
        (Group("window", 6, 1), FULL, SSM),
        3,
        options=(("enable_partial_reuse", True), ("commit_min_snapshot", True), ("ssm_reuse_interval", 0)),
    ),
    "window_ssm_partial_evicting": Setup(
        (Group("window", 9), SSM),
        4,
        gpu_slots=30,
        host_slots=12,
        options=(("enable_partial_reuse", True), ("snapshot_prefill_chunks", False), ("ssm_reuse_interval", 4)),
    ),
    "full_window_scratch": Setup((FULL, Group("window", 10, 1)), 4, options=(("enable_swa_scratch_reuse", True),)),
    "windows_scratch": Setup(
        (Group("window", 13), Group("window", 7, 2)), 5, options=(("enable_swa_scratch_reuse", True),)
    ),
    "all_three_tight": Setup(
        (FULL, SSM, Group("window", 9, 1)), 4, gpu_slots=14, options=(("ssm_reuse_interval", 4),)
    ),
    "full_window_partial_off": Setup((FULL, Group("window", 10, 1)), 4, options=(("enable_partial_reuse", False),)),
    "all_three_scratch": Setup(
        (FULL, Group("window", 7, 1), SSM),
        4,
        options=(("enable_swa_scratch_reuse", True), ("ssm_reuse_interval", 8)),
    ),
    "window_ssm_partial_scratch": Setup(
        (Group("window", 9), SSM),
        3,
        options=(("enable_swa_scratch_reuse", True), ("enable_partial_reuse", True), ("ssm_reuse_interval", 6)),
    ),
    "backoff_scratch_evicting": Setup(
        (FULL, Group("window", 11, 2)),
        4,
        gpu_slots=24,
        host_slots=8,
        options=(("reuse_match_backoff", 5), ("enable_swa_scratch_reuse", True)),
    ),
    "full_backoff": Setup((FULL, Group("window", 10)), 4, options=(("reuse_match_backoff", 3),)),
    "ssm_backoff": Setup((FULL, SSM), 4, options=(("reuse_match_backoff", 2), ("ssm_reuse_interval", 4))),
}
