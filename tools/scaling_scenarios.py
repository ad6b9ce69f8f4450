"""The scenarios ``tools/scaling.py`` times: each builds a cpu manager holding n of one kind of state and returns the
call whose cost should not grow with it (see that tool's docstring)."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kv_cache_manager_v2 import KVCacheManager

TPB = 16
BLOCKS_PER_PROMPT = 64
BUFFER = 64  # bytes of one K (and one V) per block: a slot is 128 bytes
SLOT = 2 * BUFFER

# A scenario builds its state for n and returns (the timed call, work units per call, what to close afterwards).
Built = tuple[Callable[[], None], int, Callable[[], None]]
Scenario = Callable[[int], Built]


class Tokens:
    """Fresh token ids, never repeated, so every prompt is a miss unless it is built to match."""

    def __init__(self, start: int = 1000) -> None:
        self.next = start

    def take(self, count: int) -> list[int]:
        tokens = list(range(self.next, self.next + count))
        self.next += count
        return tokens


def attention(layer_id: int, window: int | None = None) -> object:
    from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig

    return AttentionLayerConfig(layer_id, [BufferConfig("key", BUFFER), BufferConfig("value", BUFFER)], window)


def manager(gpu_slots: int, host_slots: int = 0, disk_slots: int = 0, layers: list[object] | None = None,
            disk_dir: str = "", **options: object) -> KVCacheManager:
    """A cpu manager with one full-attention layer (unless ``layers``) and tiers of these many slots."""
    from kv_cache_manager_v2 import (
        DiskCacheTierConfig,
        GpuCacheTierConfig,
        HostCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
    )

    layer_list = layers if layers is not None else [attention(0)]
    groups = len(layer_list)
    tiers: list[object] = [GpuCacheTierConfig(gpu_slots * SLOT * groups)]
    if host_slots:
        tiers.append(HostCacheTierConfig(host_slots * SLOT * groups))
    if disk_slots:
        tiers.append(DiskCacheTierConfig(disk_slots * SLOT * groups, disk_dir))
    config = KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=tiers, layers=layer_list,  # type: ignore[arg-type]
                                  backend="cpu", max_util_for_resume=1.0, **options)  # type: ignore[arg-type]
    return KVCacheManager(config)


def prefill(kv: KVCacheManager, prompt: list[int], close: bool = True) -> object:
    """A cache that computed and committed ``prompt``; closed (its blocks stay cached) unless ``close`` is False."""
    cache = kv.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt)), "prefill did not fit"
    cache.commit(prompt[cache.num_committed_tokens:])
    if close:
        cache.close()
    return cache


def cached_tree(kv: KVCacheManager, blocks: int, tokens: Tokens) -> list[list[int]]:
    """``blocks`` unused cached blocks as prompts of ``BLOCKS_PER_PROMPT`` blocks; returns the prompts."""
    prompts = [tokens.take(BLOCKS_PER_PROMPT * TPB) for _ in range(max(1, blocks // BLOCKS_PER_PROMPT))]
    for prompt in prompts:
        prefill(kv, prompt)
    return prompts


# ------------------------------------------------------------------------------------------------ scenarios
def open_close_miss(n: int) -> Built:
    """n cached blocks; a new 4-block request: create, resume, resize, commit, close."""
    tokens = Tokens()
    kv = manager(n + 100_000)
    cached_tree(kv, n, tokens)
    return (lambda: (prefill(kv, tokens.take(4 * TPB)), None)[1]), 1, kv.shutdown


def open_close_hit(n: int) -> Built:
    """n cached blocks; a request reusing one cached 64-block prompt plus one new block: create..close."""
    tokens = Tokens()
    kv = manager(n + 100_000)
    prompts = cached_tree(kv, n, tokens)
    return (lambda: (prefill(kv, prompts[len(prompts) // 2] + tokens.take(TPB)), None)[1]), 1, kv.shutdown


def probe_hit(n: int) -> Built:
    """n cached blocks; probe_reuse of one cached 64-block prompt."""
    tokens = Tokens()
    kv = manager(n + 1000)
    prompts = cached_tree(kv, n, tokens)
    return (lambda: (kv.probe_reuse(None, prompts[len(prompts) // 2]), None)[1]), 1, kv.shutdown


def fanout(n: int, same_first_token: bool) -> tuple[KVCacheManager, list[int]]:
    """One shared block with n children (each a full block, optionally all starting with the same token)."""
    tokens = Tokens()
    kv = manager(2 * n + 1000)
    shared = tokens.take(TPB)
    for _ in range(n):
        child = tokens.take(TPB)
        if same_first_token:
            child[0] = 7
        prefill(kv, shared + child)
    return kv, shared


def probe_fanout(n: int) -> Built:
    """A block with n children (distinct first tokens); probe_reuse of the block plus a new one."""
    kv, shared = fanout(n, False)
    probe = shared + [5] * TPB
    return (lambda: (kv.probe_reuse(None, probe), None)[1]), 1, kv.shutdown


def probe_partial_fanout(n: int) -> Built:
    """A block with n children that all start with the same token (a chat template's turn marker) and partial
    reuse on; probe_reuse of the block plus a block sharing only that first token."""
    kv, shared = fanout(n, True)
    probe = shared + [7] + [5] * (TPB - 1)
    return (lambda: (kv.probe_reuse(None, probe), None)[1]), 1, kv.shutdown


def open_close_fanout(n: int) -> Built:
    """A block with n children (same first token); a request below it: create..close."""
    kv, shared = fanout(n, True)
    tokens = Tokens(10**8)
    return (lambda: (prefill(kv, shared + [7] + tokens.take(2 * TPB - 1)), None)[1]), 1, kv.shutdown


def live_caches(n: int, active: bool) -> tuple[KVCacheManager, list[object], Callable[[], None]]:
    """n caches of 4 committed blocks, active or suspended; the third value closes them and the manager."""
    tokens = Tokens()
    kv = manager(8 * n + 1000)
    caches = [prefill(kv, tokens.take(4 * TPB), close=False) for _ in range(n)]
    if not active:
        for cache in caches:
            cache.suspend()  # type: ignore[attr-defined]

    def close() -> None:
        for cache in caches:
            cache.close()  # type: ignore[attr-defined]
        kv.shutdown()

    return kv, caches, close


def decode_step(n: int) -> Built:
    """n active caches; one cache's decode step: resize by one token, commit it."""
    kv, caches, close = live_caches(n, True)
    cache = caches[n // 2]
    tokens = Tokens(10**8)

    def step() -> None:
        cache.resize(cache.capacity + 1)  # type: ignore[attr-defined]
        cache.commit(tokens.take(1))  # type: ignore[attr-defined]

    return step, 1, close


def suspend_resume(n: int) -> Built:
    """n suspended caches; resume one of them, suspend it again."""
    kv, caches, close = live_caches(n, False)
    cache = caches[n // 2]

    def cycle() -> None:
        assert cache.resume()  # type: ignore[attr-defined]
        cache.suspend()  # type: ignore[attr-defined]

    return cycle, 1, close


def stats_reads(n: int) -> Built:
    """n active caches (and their 4n pages), 8 of them with statistics not yet settled (an engine settles each
    request's after its admission); the per-step reads: iteration stats, storage statistics, usage, can_fit, dirty
    stats ids, committed stats, need_adjustment."""
    kv, caches, close = live_caches(n, True)
    for cache in caches[8:]:
        cache.commit_pending_stats()  # type: ignore[attr-defined]

    def reads() -> None:
        kv.get_and_reset_iteration_stats()
        kv.get_storage_statistics(0)
        kv.get_usage()
        kv.can_fit(4096)
        kv.get_dirty_stats_kv_cache_ids()
        kv.get_committed_stats()
        kv.need_adjustment  # noqa: B018 (a property: the read is the call)

    return reads, 1, close


def long_prompt(n: int) -> tuple[KVCacheManager, list[int]]:
    return manager(4 * n + 1000), Tokens().take(n * TPB)


def commit_whole_prompt(n: int) -> Built:
    """A prompt of n blocks: create, resume, resize, commit at once, close; per block."""
    kv, prompt = long_prompt(n)
    tokens = Tokens(10**8)
    return (lambda: (prefill(kv, tokens.take(len(prompt))), None)[1]), n, kv.shutdown


def commit_chunked_prompt(n: int) -> Built:
    """A prompt of n blocks prefilled one block per resize + commit, then closed; per block."""
    kv, prompt = long_prompt(n)
    tokens = Tokens(10**8)

    def run() -> None:
        cache = kv.create_kv_cache(None, None)
        assert cache.resume()
        for _ in range(n):
            assert cache.resize(cache.capacity + TPB)
            cache.commit(tokens.take(TPB))
        cache.close()

    return run, n, kv.shutdown


def probe_long_prompt(n: int) -> Built:
    """A cached prompt of n blocks; probe_reuse of it; per block."""
    kv, prompt = long_prompt(n)
    prefill(kv, prompt)
    return (lambda: (kv.probe_reuse(None, prompt), None)[1]), n, kv.shutdown


def eviction_cascade(n: int) -> Built:
    """GPU, host and disk tiers each full of n cached pages; a new cache's resize evicts 256 pages through them."""
    directory = tempfile.mkdtemp(prefix="scaling-")
    tokens = Tokens()
    kv = manager(n, host_slots=n, disk_slots=n, disk_dir=directory)
    cached_tree(kv, 3 * n, tokens)

    def evict() -> None:
        prefill(kv, tokens.take(256 * TPB))

    def close() -> None:
        kv.shutdown()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)

    return evict, 256, close


def batch_admission(n: int) -> Built:
    """create_kv_cache_batch of n requests (each 2 cached blocks + 2 new), then their close; per request."""
    from kv_cache_manager_v2 import KVCacheRequest

    tokens = Tokens()
    kv = manager(8 * n + 1000)
    prompts = cached_tree(kv, 2 * n, tokens)

    def admit() -> None:
        requests = [KVCacheRequest(prompts[i % len(prompts)][: 2 * TPB + i % TPB] + tokens.take(2 * TPB))
                    for i in range(n)]
        caches = kv.create_kv_cache_batch(requests)
        for cache in caches:
            assert cache is not None
            cache.close()

    return admit, n, kv.shutdown


def batch_shared_prefix(n: int) -> Built:
    """create_kv_cache_batch of n requests sharing an uncached 4-block prefix (each holds the first request's
    pages of it) plus 2 blocks of their own, then their close; per request."""
    from kv_cache_manager_v2 import KVCacheRequest

    tokens = Tokens()
    kv = manager(8 * n + 1000)

    def admit() -> None:
        prefix = tokens.take(4 * TPB)
        caches = kv.create_kv_cache_batch([KVCacheRequest(prefix + tokens.take(2 * TPB)) for _ in range(n)])
        for cache in caches:
            assert cache is not None
            cache.close()

    return admit, n, kv.shutdown


def decode_long_context(n: int) -> Built:
    """Full attention + a 4-block sliding window; one cache of n committed blocks decoding: resize by one token,
    commit it."""
    kv = manager(4 * n + 1000, layers=[attention(0), attention(1, 4 * TPB)], initial_pool_ratio=[4.0, 1.0])
    tokens = Tokens()
    cache = prefill(kv, tokens.take(n * TPB), close=False)

    def step() -> None:
        cache.resize(cache.capacity + 1)  # type: ignore[attr-defined]
        cache.commit(tokens.take(1))  # type: ignore[attr-defined]

    def close() -> None:
        cache.close()  # type: ignore[attr-defined]
        kv.shutdown()

    return step, 1, close


def evict_suspended(n: int) -> Built:
    """The GPU tier full of the pages of n/4 suspended caches, a host tier with room; a new cache's resize by 64
    blocks moves 64 of them down (then it is suspended too, and the GPU full again); per moved page."""
    tokens = Tokens()
    kv = manager(n, host_slots=64 * 1000 + n)
    caches = [prefill(kv, tokens.take(4 * TPB), close=False) for _ in range(n // 4)]
    for cache in caches:
        cache.suspend()  # type: ignore[attr-defined]

    def evict() -> None:
        cache = kv.create_kv_cache(None, None)
        assert cache.resume() and cache.resize(64 * TPB)
        cache.suspend()
        caches.append(cache)

    def close() -> None:
        for cache in caches:
            cache.close()  # type: ignore[attr-defined]
        kv.shutdown()

    return evict, 64, close


def refused_resize(n: int) -> Built:
    """The GPU tier full of the locked pages of n/4 active caches; one of them asks for 64 more blocks: refused."""
    tokens = Tokens()
    kv = manager(n + 8)
    caches = [prefill(kv, tokens.take(4 * TPB), close=False) for _ in range(n // 4)]
    cache = caches[0]

    def refuse() -> None:
        assert not cache.resize(cache.capacity + 64 * TPB)  # type: ignore[attr-defined]

    def close() -> None:
        for each in caches:
            each.close()  # type: ignore[attr-defined]
        kv.shutdown()

    return refuse, 1, close


def kv_events(n: int) -> Built:
    """n cached blocks with KV events on; a 4-block request prefilled and closed, its events drained."""
    tokens = Tokens()
    kv = manager(n + 100_000, enable_kv_events=True, max_kv_events=1_000_000)
    cached_tree(kv, n, tokens)
    kv.get_latest_events()

    def step() -> None:
        prefill(kv, tokens.take(4 * TPB))
        kv.get_latest_events()

    return step, 1, kv.shutdown


def observed_closes(n: int) -> Built:
    """2 layer groups (full + window) and n closed caches observed (the manager keeps the last 256); a request
    closes, then the step's need_adjustment."""
    tokens = Tokens()
    kv = manager(2 * n + 1000, layers=[attention(0), attention(1, 4 * TPB)])
    for _ in range(n):
        prefill(kv, tokens.take(2 * TPB))

    def step() -> None:
        prefill(kv, tokens.take(2 * TPB))
        kv.need_adjustment  # noqa: B018 (a property: the read is the call)

    return step, 1, kv.shutdown


def ssm_snapshots(n: int) -> Built:
    """Attention + SSM, a snapshot every block; a prompt of n blocks prefilled one block per resize + commit
    (n snapshots), then reused by a second cache with one more block: create..close of both; per block."""
    from kv_cache_manager_v2 import BufferConfig, SsmLayerConfig

    layers = [attention(0), SsmLayerConfig(1, [BufferConfig("ssm_state", BUFFER), BufferConfig("conv_state", BUFFER)])]
    kv = manager(8 * n + 1000, layers=layers, ssm_reuse_interval=TPB, initial_pool_ratio=[1.0, 1.0])
    tokens = Tokens()

    def run() -> None:
        prompt = tokens.take(n * TPB)
        cache = kv.create_kv_cache(None, None)
        assert cache.resume()
        for _ in range(n):
            assert cache.resize(cache.capacity + TPB)
            cache.commit(prompt[cache.num_committed_tokens: cache.num_committed_tokens + TPB])
        cache.close()
        prefill(kv, prompt + tokens.take(TPB))

    return run, n, kv.shutdown


def snapshot_points_read(n: int) -> Built:
    """Attention + SSM, a cache of an n-block prompt declaring a snapshot at every block (``snapshot_at``); the
    read of its ``snapshot_points`` a chunked-prefill scheduler makes every step (where its next chunk stops)."""
    from kv_cache_manager_v2 import BufferConfig, SsmLayerConfig

    layers = [attention(0), SsmLayerConfig(1, [BufferConfig("ssm_state", BUFFER), BufferConfig("conv_state", BUFFER)])]
    kv = manager(4 * n + 1000, layers=layers, initial_pool_ratio=[1.0, 1.0])
    prompt = Tokens().take(n * TPB)
    cache = kv.create_kv_cache(None, prompt, snapshot_at=range(TPB, n * TPB, TPB))

    def read() -> None:
        cache.snapshot_points  # noqa: B018 (a property: the read is the call)

    def close() -> None:
        cache.close()
        kv.shutdown()

    return read, 1, close


def swa_groups(n: int) -> Built:
    """n layer groups (n - 1 sliding windows of different sizes + 1 full); a 4-block request create..close,
    per layer group."""
    layers = [attention(0)] + [attention(i, (i + 1) * TPB) for i in range(1, n)]
    kv = manager(1000, layers=layers)
    tokens = Tokens()
    return (lambda: (prefill(kv, tokens.take(4 * TPB)), None)[1]), n, kv.shutdown


# (name, scenario, base n, what n counts)
SCENARIOS: list[tuple[str, Scenario, int, str]] = [
    ("open_close_miss", open_close_miss, 2_048, "cached blocks"),
    ("open_close_hit", open_close_hit, 2_048, "cached blocks"),
    ("probe_hit", probe_hit, 2_048, "cached blocks"),
    ("probe_fanout", probe_fanout, 256, "children of a block"),
    ("probe_partial_fanout", probe_partial_fanout, 256, "children of a block"),
    ("open_close_fanout", open_close_fanout, 256, "children of a block"),
    ("decode_step", decode_step, 256, "active caches"),
    ("suspend_resume", suspend_resume, 256, "suspended caches"),
    ("stats_reads", stats_reads, 256, "active caches"),
    ("commit_whole_prompt", commit_whole_prompt, 256, "prompt blocks (per block)"),
    ("commit_chunked_prompt", commit_chunked_prompt, 256, "prompt blocks (per block)"),
    ("probe_long_prompt", probe_long_prompt, 256, "prompt blocks (per block)"),
    ("eviction_cascade", eviction_cascade, 1_024, "pages per full tier (per eviction)"),
    ("batch_admission", batch_admission, 32, "requests (per request)"),
    ("evict_suspended", evict_suspended, 1_024, "suspended caches' GPU pages (per page)"),
    ("refused_resize", refused_resize, 1_024, "locked GPU pages"),
    ("batch_shared_prefix", batch_shared_prefix, 32, "requests (per request)"),
    ("decode_long_context", decode_long_context, 256, "blocks of the decoding cache"),
    ("kv_events", kv_events, 2_048, "cached blocks"),
    ("observed_closes", observed_closes, 64, "closed caches (256 kept)"),
    ("ssm_snapshots", ssm_snapshots, 64, "snapshots (per block)"),
    ("snapshot_points_read", snapshot_points_read, 256, "declared snapshot points"),
    ("swa_groups", swa_groups, 2, "layer groups (per group)"),
]
