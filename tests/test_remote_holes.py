"""Holes in what the remote tier holds of a chain: a hybrid's pages (full attention, a window with a sink block, SSM
snapshots) and a windowed model's, one object lost at a time, before the reader's probe or between its probe and
its get, with the coldest local tier on the GPU, a host or a disk tier. The reader's FakeEngine checks every row
and live state it reused against its own contextual records, and it reuses exactly the longest prefix that every
layer group can serve without the lost object: the window needs only its sink block and its last blocks, the SSM
group only the snapshot where the prefix ends, also when the object went after the probe found it (the fill is
planned once more). Also: a hybrid differing only in its sink count, in the same whole
blocks, never reads the first one's pages; a re-plan answered with another prompt's objects installs none of them.
In-process store (``MemoryStoreConfig``), cpu backend."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreConfig,
    SsmLayerConfig,
)
from kv_cache_manager_v2._base.hashing import block_key, root_key
from kv_cache_manager_v2._base.remote_store import MISSING, HostBuffer
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig, contextual_tokens
from tests.forwarding_store import ForwardingStore
from tests.helpers import attention, make_config, ssm
from tests.test_remote_tier import stats_of

TPB = 16
BLOCKS = 8
SNAPSHOT_BLOCKS = 2  # ssm_reuse_interval: a snapshot every second block, where each prefill chunk ends
HYBRID: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32, sinks=16), ssm(2, 2048, 256)]
WINDOWED: list[LayerConfig] = [attention(0, 512, window=32, sinks=16), attention(1, 512, window=48, sinks=16)]
MODELS = {"hybrid": HYBRID, "windowed": WINDOWED}
PROMPT = [5_000 + i for i in range(BLOCKS * TPB + 5)]


class LosingStore(ForwardingStore):
    """The store loses ``key`` before the probe (``when="probe"``) or between the probe that found it and the get."""

    def __init__(self, inner: RemoteStore, key: str, when: str) -> None:
        super().__init__(inner)
        self.key = key
        self.when = when

    def exists_batch(self, keys: list[str]) -> list[bool]:
        if self.when == "probe":
            self.inner.remove_batch([self.key])
        return self.inner.exists_batch(keys)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        self.inner.remove_batch([self.key])
        return self.inner.get_batch(keys, buffers)


class Losing:
    def __init__(self, inner: RemoteStoreConfig, key: str, when: str) -> None:
        self.inner = inner
        self.key = key
        self.when = when

    def open(self, quota: int) -> RemoteStore:
        return LosingStore(self.inner.open(quota), self.key, self.when)


def manager(layers: Sequence[LayerConfig], backend: object, local: Sequence[CacheTierConfig] = ()) -> KVCacheManager:
    remote = RemoteCacheTierConfig(0, backend, namespace="holes", retry_after_s=0.0)  # type: ignore[arg-type]
    tiers = [GpuCacheTierConfig(1 << 20), *local, remote]
    interval = SNAPSHOT_BLOCKS * TPB
    return KVCacheManager(make_config(layers, tiers=tiers, tokens_per_block=TPB, ssm_reuse_interval=interval))


def serve(manager: KVCacheManager, context: str, tokens: list[int]) -> int:
    """Admit ``tokens`` (what it reused checked), compute the rest in chunks ending on snapshot points, commit,
    close; the reused length."""
    engine = FakeEngine(manager)
    written = contextual_tokens(tokens, context)
    cache = manager.create_kv_cache(None, tokens)
    reused = done = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, written)
    while done < len(tokens):
        end = min(len(tokens), (done // (SNAPSHOT_BLOCKS * TPB) + 1) * SNAPSHOT_BLOCKS * TPB)
        assert cache.resize(end)
        engine.step(cache, written)
        cache.commit(tokens[done:end])
        done = end
    cache.close()
    manager.check_invariants()
    return reused


def block_names(tokens: list[int]) -> list[str]:
    """The last part of each full block's keys (no secret: the chained block key in hex)."""
    key, names = root_key(None), []
    for ordinal in range(BLOCKS):
        key = block_key(key, tokens[ordinal * TPB : (ordinal + 1) * TPB])
        names.append(key.hex())
    return names


def stored_objects(store: MemoryStoreConfig) -> dict[tuple[int, int], str]:
    """(layer group, block ordinal) -> key of every object the writer stored."""
    names = block_names(PROMPT)
    objects: dict[tuple[int, int], str] = {}
    for key in store.objects:
        group = int(key.split("/lg")[1].split("/")[0])
        objects[group, names.index(key.rsplit("/", 1)[1])] = key
    return objects


def servable(layers: Sequence[LayerConfig], held: set[tuple[int, int]]) -> int:
    """The longest prefix (in blocks, ending on a snapshot point when there are SSM layers) that every layer group
    can serve from ``held``, written from the README's rules rather than the manager's: full attention reads every
    block, a window of W tokens with sinks its sink block and the blocks holding the last W tokens before the next
    position, an SSM group the snapshot at the prefix's end. Layer group ids follow the layers here."""
    for blocks in range(BLOCKS, 0, -1):
        if any(isinstance(layer, SsmLayerConfig) for layer in layers) and blocks % SNAPSHOT_BLOCKS:
            continue
        needed: set[tuple[int, int]] = set()
        for group, layer in enumerate(layers):
            if isinstance(layer, SsmLayerConfig):
                needed.add((group, blocks - 1))
                continue
            assert isinstance(layer, AttentionLayerConfig)
            window = layer.sliding_window_size
            if window is None:
                needed |= {(group, ordinal) for ordinal in range(blocks)}
                continue
            first = max(0, (blocks * TPB - window + 1) // TPB)  # the next position attends back W - 1 tokens
            sink_blocks = min(blocks, -(-(layer.num_sink_tokens or 0) // TPB))
            needed |= {(group, ordinal) for ordinal in [*range(sink_blocks), *range(first, blocks)]}
        if needed <= held:
            return blocks
    return 0


@pytest.fixture(scope="module", params=list(MODELS))
def written(request: pytest.FixtureRequest) -> tuple[str, MemoryStoreConfig]:
    store = MemoryStoreConfig()
    writer = manager(MODELS[request.param], store)
    assert serve(writer, "model", PROMPT) == 0
    writer.shutdown()
    return request.param, store


def local_tiers(coldest: str, tmp_path: Path) -> list[CacheTierConfig]:
    if coldest == "host":
        return [HostCacheTierConfig(1 << 20)]
    if coldest == "disk":
        return [DiskCacheTierConfig(1 << 20, str(tmp_path))]
    return []


@pytest.mark.parametrize("coldest", ["gpu", "host", "disk"])
def test_a_chain_with_one_object_lost_serves_the_longest_prefix_left_with_its_content(
    written: tuple[str, MemoryStoreConfig], coldest: str, tmp_path: Path
) -> None:
    name, store = written
    layers = MODELS[name]
    objects = stored_objects(store)
    assert servable(layers, set(objects)) == BLOCKS
    control = manager(layers, store, local_tiers(coldest, tmp_path))
    assert serve(control, "model", PROMPT) == BLOCKS * TPB  # the control: nothing lost, all of it read
    control.shutdown()
    for (group, ordinal), key in sorted(objects.items()):
        for when in ("probe", "get"):
            saved = store.objects[key]
            reader = manager(layers, Losing(store, key, when), local_tiers(coldest, tmp_path))
            reused = serve(reader, "model", PROMPT)  # content checked: only what the writer wrote for these tokens
            best = servable(layers, set(objects) - {(group, ordinal)}) * TPB
            stats = stats_of(reader)
            reader.shutdown()
            where = f"{name} over {coldest}: layer group {group} block {ordinal} lost before the {when}"
            # Lost after the probe, it was a miss the fill had counted on: planned once more, the fill serves the
            # same longest prefix (it used to stop at the hole, or serve nothing where the prefix's end was lost).
            assert reused == best and stats.fetch_failures <= 1, (where, reused, best, stats)
            store.objects[key] = saved  # back for the next reader (its computed pages are stored over it)


def test_a_hybrid_differing_only_in_its_sink_count_never_reads_the_others_pages() -> None:
    """Sinks of 16 and 12 tokens take one whole block alike: the manager files both windows in equal layer groups of
    equal pages, but attention over 12 sinks gives every later layer (and the SSM state) other inputs. Only the
    layers' own fields in the keys tell the two apart; each instance reads its twin's pages, never the other's."""
    store = MemoryStoreConfig()
    fewer: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32, sinks=12), ssm(2, 2048, 256)]
    first = manager(HYBRID, store)
    serve(first, "sinks 16", PROMPT)
    twin = manager(HYBRID, store)
    assert serve(twin, "sinks 16", PROMPT) == BLOCKS * TPB  # the control
    other = manager(fewer, store)
    assert serve(other, "sinks 12", PROMPT) == 0  # content checked under its own model
    assert stats_of(other).found_pages == 0
    for instance in (first, twin, other):
        instance.shutdown()


OTHER_PROMPT = [9_000 + i for i in range(BLOCKS * TPB + 5)]


class FlippingStore(ForwardingStore):
    """The first get answers MISSING for ``lost`` (so the fill is planned once more); every later get answers each
    key with the object the store holds under ``swap``'s key for it (another prompt's, same layer group and block)."""

    def __init__(self, inner: RemoteStore, lost: str, swap: dict[str, str]) -> None:
        super().__init__(inner)
        self.lost = lost
        self.swap = swap
        self.gets = 0

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        self.gets += 1
        if self.gets > 1:
            return self.inner.get_batch([self.swap.get(key, key) for key in keys], buffers)
        answer = self.inner.get_batch(keys, buffers)
        return [MISSING if key == self.lost else length for key, length in zip(keys, answer)]


class Flipping:
    def __init__(self, inner: RemoteStoreConfig, lost: str, swap: dict[str, str]) -> None:
        self.inner = inner
        self.lost = lost
        self.swap = swap

    def open(self, quota: int) -> RemoteStore:
        return FlippingStore(self.inner.open(quota), self.lost, self.swap)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_second_plan_answered_with_another_prompts_objects_installs_none_of_them(name: str) -> None:
    """The re-plan after a lost object reads the store again; a store that then answers every key with another
    prompt's object of the same layer group and block (same size, well framed) gets them rejected by the key in
    their digest, not installed: the reader's rows are checked against its own prompt, and the rejection counted."""
    layers = MODELS[name]
    store = MemoryStoreConfig()
    writer = manager(layers, store)
    serve(writer, "model", PROMPT)
    serve(writer, "other", OTHER_PROMPT)
    writer.shutdown()
    ours, theirs = block_names(PROMPT), block_names(OTHER_PROMPT)
    swap = {}
    for key in store.objects:
        name_part = key.rsplit("/", 1)[1]
        if name_part in ours:
            swap[key] = key[: -len(name_part)] + theirs[ours.index(name_part)]
    assert swap and all(other in store.objects for other in swap.values())
    lost = min(key for key in swap if key.rsplit("/", 1)[1] == ours[BLOCKS - 1])  # the prefix's end, some group
    reader = manager(layers, Flipping(store, lost, swap))
    serve(reader, "model", PROMPT)  # every reused row checked against this prompt's contextual records
    stats = stats_of(reader)
    reader.shutdown()
    assert stats.fetch_failures >= 1 and stats.rejected_pages >= 1, stats
