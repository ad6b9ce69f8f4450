"""Never another prompt's KV from the shared remote tier: managers that differ in one thing share one real Mooncake
Store (master and storage node on loopback), and each reads only objects its own model would have written.

Content is proven with ``contextual_tokens``: the FakeEngine's records are derived from per-position digests of the
model's identity, the reuse scope and every token so far, so a page written under another prefix, scope or model
fails the reader's check even where the block's own tokens agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCacheManager,
    MooncakeStoreConfig,
    Priority,
    RemoteCacheTierConfig,
    RemoteStore,
    ReuseScope,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2._base.hashing import Token
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._model.life_cycle import LifeCycle
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2.testing import contextual_tokens
from tests.forwarding_store import ForwardingStore
from tests.test_remote_tier import stats_of
from tests.helpers import attention, make_config, ssm
from tests.mooncake_helpers import MooncakeCluster, cluster

TPB = 16


@dataclass
class Instance:
    """What one serving instance is: its layers, tokens per block, remote-tier settings and reuse scope. ``model``
    names what its KV is computed by (the contextual tokens' context): equal only where the bytes truly agree."""

    model: str
    layers: list[LayerConfig] = field(default_factory=lambda: [attention(0, 512), attention(1, 512, window=32)])
    tokens_per_block: int = TPB
    namespace: str = "model/fp16"
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 2
    scope: ReuseScope | None = None
    secret_key: bytes | None = None
    previous_secret_keys: tuple[bytes, ...] = ()

    def manager(self, backend: object, test: str, gpu_bytes: int = 8 << 20) -> KVCacheManager:
        remote = RemoteCacheTierConfig(
            0, backend, namespace=f"{test}/{self.namespace}",  # type: ignore[arg-type]
            tensor_parallel_rank=self.tensor_parallel_rank, tensor_parallel_size=self.tensor_parallel_size,
            secret_key=self.secret_key,
            previous_secret_keys=self.previous_secret_keys,
        )
        return KVCacheManager(make_config(
            self.layers, tiers=[GpuCacheTierConfig(gpu_bytes), remote], tokens_per_block=self.tokens_per_block,
            ssm_reuse_interval=4 * self.tokens_per_block,
        ))

    def context(self) -> str:
        return f"{self.model}/{self.scope!r}"


def serve(instance: Instance, manager: KVCacheManager, tokens: Sequence[Token], priority: int | None = None) -> int:
    """Admit ``tokens`` (the reused prefix checked against this instance's own contextual records), compute the rest
    in chunks of 4 blocks, commit, close; the reused length. ``priority``: the full-attention pages' eviction
    priority (windowed pages get a high one)."""

    def by_kind(_ordinal: int, life_cycle: LifeCycle) -> Priority:
        return Priority(priority if priority is not None and life_cycle.window_size is None else 90)

    engine = FakeEngine(manager)
    written = contextual_tokens(tokens, instance.context())
    cache = manager.create_kv_cache(instance.scope, list(tokens), custom_priority_callback=by_kind)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, written)
    chunk = 4 * instance.tokens_per_block
    done = reused
    while done < len(tokens):
        end = min(len(tokens), done + chunk - done % chunk)
        assert cache.resize(end)
        engine.step(cache, written)
        cache.commit(list(tokens[done:end]))
        done = end
    cache.close()
    manager.check_invariants()
    return reused


def prompt(seed: int, blocks: int = 8, extra: int = 5) -> list[Token]:
    return [seed * 10_000 + i for i in range(blocks * TPB + extra)]


BASE = Instance("base")
# One difference each from BASE. A different model (its KV differs: another dtype or head split in pages of the same
# size, another window, more layers...) gets another ``model`` name; a scope is the same model's other context.
DIFFERENT: dict[str, Instance] = {
    "dtype (the namespace)": Instance("bf16", namespace="model/bf16"),
    "head count in pages of the same size (the namespace)": Instance("heads", namespace="model/fp16/16x64"),
    "tokens per block": Instance("tpb8", tokens_per_block=8),
    "layer order": Instance("order", layers=[attention(1, 512, window=32), attention(0, 512)]),
    "one more layer": Instance("three", layers=[*BASE.layers, attention(2, 512)]),
    "window size": Instance("window64", layers=[attention(0, 512), attention(1, 512, window=64)]),
    "sink tokens": Instance("sinks", layers=[attention(0, 512), attention(1, 512, window=32, sinks=16)]),
    "an SSM layer": Instance("hybrid", layers=[*BASE.layers, ssm(2, 4096, 512)]),
    "tensor-parallel rank": Instance("rank1", tensor_parallel_rank=1),
    "tensor-parallel size (more ranks than KV heads)": Instance("tp4", tensor_parallel_size=4),
    "salt": Instance("base", scope=ReuseScope(salt=1)),
    "lora 0 (not None)": Instance("base", scope=ReuseScope(lora_id=0)),
}


def check_never_reads(cluster: MooncakeCluster, test: str, first: Instance, other: Instance) -> None:
    """``first`` serves a prompt, its twin reads all of it back (the control), ``other`` reads none of it."""
    writer = first.manager(cluster.config(), test)
    tokens = prompt(1)
    serve(first, writer, tokens)
    assert stats_of(writer).stored_pages > 0
    twin = first.manager(cluster.config(), test)  # the control: the same instance again reads all of it
    assert serve(first, twin, tokens) == 8 * TPB and stats_of(twin).fetched_pages > 0
    reader = other.manager(cluster.config(), test)
    assert serve(other, reader, tokens) == 0  # content checked: what it computed, nothing it read
    stats = stats_of(reader)
    assert stats.found_pages == 0 and stats.fetched_pages == 0, stats
    for manager in (writer, twin, reader):
        manager.shutdown()


@pytest.mark.parametrize("difference", list(DIFFERENT))
def test_an_instance_differing_in_one_thing_never_reads_the_others_pages(cluster: MooncakeCluster, difference: str) -> None:
    check_never_reads(cluster, f"one-{difference}", BASE, DIFFERENT[difference])


def windowed_with_sinks(*sinks: int) -> list[LayerConfig]:
    return [attention(0, 512), *(attention(1 + n, 512, window=32, sinks=count) for n, count in enumerate(sinks))]


# Models the manager files under equal layer groups (it counts sink tokens in whole blocks) whose pages an engine
# fills with other bytes: attention over other sinks gives every later layer other inputs.
ALIKE_IN_BLOCKS: dict[str, tuple[Instance, Instance]] = {
    "sink tokens within one block": (
        Instance("sinks4", layers=windowed_with_sinks(4)), Instance("sinks8", layers=windowed_with_sinks(8))
    ),
    "two layers' sink tokens swapped": (
        Instance("sinks4-8", layers=windowed_with_sinks(4, 8)), Instance("sinks8-4", layers=windowed_with_sinks(8, 4))
    ),
}


@pytest.mark.parametrize("difference", list(ALIKE_IN_BLOCKS))
def test_models_alike_in_whole_blocks_never_read_each_others_pages(cluster: MooncakeCluster, difference: str) -> None:
    check_never_reads(cluster, f"alike-{difference}", *ALIKE_IN_BLOCKS[difference])


def test_a_multimodal_item_with_another_digest_shares_only_the_blocks_before_it(cluster: MooncakeCluster) -> None:
    text = prompt(2, blocks=2, extra=0)

    def with_image(digest: bytes) -> list[Token]:
        return [*text, *gen_multimodal_cache_key_tokens(1 << 20, digest, 3 * TPB), *prompt(3, blocks=2)]

    writer = BASE.manager(cluster.config(), "multimodal")
    serve(BASE, writer, with_image(hashlib.sha256(b"cat").digest()))
    reader = BASE.manager(cluster.config(), "multimodal")
    # Only the text before the image is this prompt's: the stand-in ids after the digest are the same, the digest not.
    assert serve(BASE, reader, with_image(hashlib.sha256(b"dog").digest())) == 2 * TPB
    assert stats_of(reader).fetched_pages == 2 + 2  # blocks 0 and 1 of the full and the windowed layer group
    writer.shutdown()
    reader.shutdown()


def test_a_partial_block_is_never_stored_nor_read(cluster: MooncakeCluster) -> None:
    writer = BASE.manager(cluster.config(), "partial")
    tokens = prompt(4, blocks=3, extra=9)
    serve(BASE, writer, tokens)
    assert stats_of(writer).stored_pages == 3 + 3
    reader = BASE.manager(cluster.config(), "partial")
    longer = [*tokens, *prompt(5, blocks=1, extra=0)]  # the writer's partial block 3, then more: block 3 differs
    assert serve(BASE, reader, longer) == 3 * TPB
    reader.shutdown()
    writer.shutdown()


class ReadOnlyStore(ForwardingStore):
    """A client that reads the shared store but never writes to it (a reader instance)."""

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        return [False] * len(keys)


class ReadOnly:
    def __init__(self, inner: MooncakeStoreConfig) -> None:
        self.inner = inner

    def open(self, quota: int) -> RemoteStore:
        return ReadOnlyStore(self.inner.open(quota))


def test_a_layer_group_read_by_a_model_whose_earlier_layers_differ_is_a_miss(cluster: MooncakeCluster) -> None:
    """Layer k's keys and values are computed from the output of every layer before it: a full-attention group whose
    own layers match ours but that follows a windowed layer with another window holds other bytes. The reader holds
    its windowed group's pages locally and lacks only the full-attention ones: it must compute them, not fetch the
    writer's."""
    writer_instance = Instance("window32", layers=[attention(1, 512, window=32), attention(0, 512)])
    reader_instance = Instance("window64", layers=[attention(1, 512, window=64), attention(0, 512)])
    tokens = prompt(6)
    writer = writer_instance.manager(cluster.config(), "earlier")
    serve(writer_instance, writer, tokens)
    reader = reader_instance.manager(ReadOnly(cluster.config()), "earlier", gpu_bytes=14 * 2048)  # 14 slots a group
    assert serve(reader_instance, reader, tokens, priority=1) == 0
    serve(reader_instance, reader, prompt(7), priority=1)  # evicts the first prompt's full-attention pages first
    reused = serve(reader_instance, reader, tokens, priority=1)  # content checked against the reader's own records
    assert stats_of(reader).fetched_pages == 0 and reused < len(tokens)
    writer.shutdown()
    reader.shutdown()


# Ints hash to themselves modulo this Mersenne prime: tuples differing by it in one token share one ``hash()``, so
# they take one child slot of their parent (the radix tree's collision path; prompts an attacker can choose).
_MODULUS = (1 << 61) - 1


def colliding(block: list[int], position: int) -> list[int]:
    twin = list(block)
    twin[position] += _MODULUS
    assert hash(tuple(twin)) == hash(tuple(block)) and twin != block
    return twin


def test_prompts_whose_blocks_collide_in_hash_keep_their_own_pages_locally_and_remotely(cluster: MooncakeCluster) -> None:
    """Blocks whose token tuples share ``hash()`` under one parent (first block, a later block, a partial block, with
    and without the first-token index of a block with many children), served under eviction pressure with a
    written-through remote tier, then by a second instance from the store: every reuse is checked against the
    prompt's own contextual records."""
    x = [100 + i for i in range(TPB)]
    y = [200 + i for i in range(TPB)]
    x2, y2 = colliding(x, TPB - 1), colliding(y, 0)
    prompts: list[list[int]] = [
        x + y + [1, 2, 3],
        x2 + y + [1, 2, 3],  # block 0 collides with the first prompt's
        x + y2 + [1, 2, 3],  # block 1 collides under the same block 0
        x2 + y2 + [4],
        x + y2[:10],  # a partial block sharing no token with y (they differ at position 0)
        x + y[:10],
        x2 + y[:12],
    ]
    fillers = [prompt(10 + n, blocks=2, extra=1) for n in range(8)]  # the root gets its first-token index
    writer = BASE.manager(cluster.config(), "collisions", gpu_bytes=16 * 2048)  # 16 slots per layer group
    # Only the tokens each prompt shares with an earlier one, however the hashes collide (x2 agrees with x on its
    # first 15 tokens: a partial reuse of them is right).
    expected = [0, TPB - 1, TPB, TPB, TPB + 10, TPB + 10, TPB + 12]
    for round_ in range(3):
        for n, tokens in enumerate(prompts):
            reused = serve(BASE, writer, tokens)
            assert round_ > 0 or reused == expected[n], (n, reused)  # later: whatever survived, content checked
        for filler in fillers:  # pushes most of the prompts' pages out of the only local tier
            serve(BASE, writer, filler)
    assert stats_of(writer).fetched_pages > 0  # evicted pages came back from the store
    reader = BASE.manager(cluster.config(), "collisions")
    for n, tokens in enumerate(prompts):
        assert serve(BASE, reader, tokens) >= (len(tokens) // TPB) * TPB, n  # every full block from the store
    assert stats_of(reader).rejected_pages == 0 and stats_of(reader).fetched_pages > 0
    writer.shutdown()
    reader.shutdown()


class HostileStore(ForwardingStore):
    """A client whose reads go wrong after honest probes: ``removed`` (the objects vanish between exists and get),
    ``alternate`` (every other get of a batch fails), ``unwritten`` (success with the full length, buffer untouched),
    ``rotated`` (each buffer gets the batch's next key's object: right size and frame, another key) or ``stale``
    (success, and the buffer holds an object read earlier for another key)."""

    def __init__(self, inner: RemoteStore, mode: str) -> None:
        super().__init__(inner)
        self.mode = mode
        self.earlier: list[HostBuffer] = []

    def exists_batch(self, keys: list[str]) -> list[bool]:
        found = self.inner.exists_batch(keys)
        if self.mode == "removed":
            self.inner.remove_batch([key for key, hit in zip(keys, found) if hit])
        return found

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        if self.mode == "unwritten":
            return [buffer.nbytes for buffer in buffers]
        if self.mode == "rotated" and len(keys) > 1:
            return self.inner.get_batch(keys[1:] + keys[:1], buffers)
        if self.mode == "stale":
            lengths = self.inner.get_batch(keys, buffers)
            answer: list[int] = []
            for n, buffer in enumerate(buffers):
                old = next((b for b in self.earlier if b.nbytes == buffer.nbytes), None)
                self.earlier.append(buffer.copy())
                if old is not None:
                    buffer[:] = old
                answer.append(buffer.nbytes if old is not None else lengths[n])
            return answer
        lengths = self.inner.get_batch(keys, buffers)
        if self.mode == "alternate":
            return [length if n % 2 == 0 else -1 for n, length in enumerate(lengths)]
        return lengths


class Hostile:
    def __init__(self, inner: MooncakeStoreConfig, mode: str) -> None:
        self.inner = inner
        self.mode = mode

    def open(self, quota: int) -> RemoteStore:
        return HostileStore(self.inner.open(quota), self.mode)


@pytest.mark.parametrize("mode", ["removed", "alternate", "unwritten", "rotated", "stale"])
def test_reads_that_go_wrong_after_the_probe_are_misses_never_wrong_pages(cluster: MooncakeCluster, mode: str) -> None:
    test = f"hostile-{mode}"
    writer = BASE.manager(cluster.config(), test)
    prompts = [prompt(20 + n) for n in range(3)]
    for tokens in prompts:
        serve(BASE, writer, tokens)
    reader = BASE.manager(Hostile(cluster.config(), mode), test)
    for tokens in prompts:
        serve(BASE, reader, tokens)  # whatever it reused is checked against its own records
    stats = stats_of(reader)
    assert stats.found_pages > 0
    assert stats.fetched_pages < stats.found_pages and stats.rejected_pages + stats.fetch_failures > 0, stats
    writer.shutdown()
    reader.shutdown()


def test_hybrid_twins_share_attention_pages_and_snapshots_with_their_content(cluster: MooncakeCluster) -> None:
    """The control for SSM layers: an identical hybrid instance reads the window's pages and the snapshot at the
    last interval from the store; its contextual records (a snapshot is the state after the whole prefix) hold."""
    hybrid = DIFFERENT["an SSM layer"]
    writer = hybrid.manager(cluster.config(), "hybrid-twins")
    tokens = prompt(30)
    serve(hybrid, writer, tokens)
    twin = hybrid.manager(cluster.config(), "hybrid-twins")
    assert serve(hybrid, twin, tokens) == 8 * TPB
    assert stats_of(twin).fetched_pages == 8 + 2 + 1  # full attention, the window's blocks 6 and 7, one snapshot
    other_prompt = [*tokens[: 4 * TPB], *prompt(31, blocks=4)]  # the first interval only is shared
    assert serve(hybrid, twin, other_prompt) == 4 * TPB
    writer.shutdown()
    twin.shutdown()
