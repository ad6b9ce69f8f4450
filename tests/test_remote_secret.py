"""A deployment's ``secret_key`` on the remote tier: whoever can write to the shared store but lacks the secret cannot
make an object the tier serves, deployments with other secrets never see each other's objects, and the secret is
never shown.

The forger is a real Mooncake client (master and storage node on loopback): it knows the victim's keys (a store
listing shows them; here a recording wrapper of the writer's client) and puts in their place another prompt's pages,
framed exactly as the tier frames them, with the digest it can compute: unkeyed, or keyed with another secret.
Content is checked with ``contextual_tokens``: a page of another prompt fails the reader's FakeEngine check.
"""

from __future__ import annotations

import base64
import hashlib
import logging

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCacheManager,
    MooncakeStoreConfig,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreConfig,
    RemoteStoreError,
)
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._base.hashing import block_key, root_key
from kv_cache_manager_v2._remote.objects import HEADER, frame, object_hasher
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import ContentError, FakeEngine, MemoryStoreConfig
from tests.forwarding_store import ForwardingStore, RecordingConfig
from tests.helpers import attention, make_config
from tests.mooncake_helpers import MooncakeCluster, cluster
from tests.test_remote_integrity import BASE, TPB, Instance, check_never_reads, prompt, serve
from tests.test_remote_keys import TPB as KEYS_TPB, stored_keys
from tests.test_remote_tier import stats_of

SECRET = bytes(range(1, 33))
OTHER_SECRET = bytes(range(101, 133))


# ------------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ("0123456789abcdef0123456789abcdef", TypeError, "must be bytes or None, got str"),
        (bytearray(SECRET), TypeError, "got bytearray"),
        (12345, TypeError, "got int"),
        (True, TypeError, "got bool"),
        (b"", ValueError, "got 0 bytes"),
        (SECRET[:15], ValueError, "16 to 64 bytes long"),
        (SECRET * 3, ValueError, "got 96 bytes"),
    ],
)
def test_a_bad_secret_key_is_refused_naming_the_field_and_never_showing_it(
    value: object, error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as raised:
        RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", secret_key=value)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "RemoteCacheTierConfig.secret_key" in message and says in message, message
    for shown in (repr(value), str(value), SECRET[:15].hex()):
        assert shown not in message, message


def test_secret_keys_of_16_to_64_bytes_are_accepted() -> None:
    for length in (16, 32, 64):
        config = RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", secret_key=bytes(length))
        assert config.secret_key == bytes(length)


def stored_prompt(layers: list[LayerConfig]) -> MemoryStoreConfig:
    """The store a manager of ``layers`` (namespace "golden", 16 tokens a block) wrote one 33-token prompt to."""
    store = MemoryStoreConfig()
    remote = RemoteCacheTierConfig(0, store, namespace="golden")
    manager = KVCacheManager(make_config(layers, tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=16))
    tokens = list(range(100, 133))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    FakeEngine(manager).step(cache, tokens)
    cache.commit(tokens)
    cache.close()
    manager.shutdown()
    return store


def test_without_a_secret_keys_and_digests_stay_those_of_earlier_versions() -> None:
    """Objects stored by earlier versions stay readable: the key prefix (pinned: computed since keys describe where
    each buffer sits in a page, ``page_format``; a change here costs every deployment a cold start, so only a change
    of the page's bytes may make one) and the plain BLAKE2b digest of key and payload."""
    store = stored_prompt([attention(0, 512), attention(1, 512, window=32)])
    assert {key[:38] for key in store.objects} == {"kvm2/a7d340104c6eda0db37924df1decb6de/"}
    assert len(store.objects) == 4
    for key, data in store.objects.items():
        digest = hashlib.blake2b(key.encode() + data[HEADER.size :], digest_size=16).digest()
        assert data[HEADER.size - 16 : HEADER.size] == digest


def test_a_model_with_sink_blocks_keeps_the_key_prefix_of_earlier_versions() -> None:
    """Windows with 1 sink block and with 3: the key prefix (pinned: computed by earlier versions) hashes each life
    cycle's kind, which once was ``describe()``'s text ("1 sink block(s)"); that text now counts in English, and
    the keys must not follow it. Before (keys hashing ``describe()``'s new words): ``kvm2/d0018530...`` instead."""
    store = stored_prompt(
        [attention(0, 512), attention(1, 512, window=32, sinks=4), attention(2, 512, window=64, sinks=40)]
    )
    assert {key[:38] for key in store.objects} == {"kvm2/63554d130a253e461b300fedae671a47/"}


def test_each_secret_has_a_key_space_of_its_own() -> None:
    """A secret changes every key (another deployment never even probes our objects); the same secret keeps them."""
    layers: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32)]
    plain = stored_keys(layers)
    keyed = stored_keys(layers, secret_key=SECRET)
    assert keyed == stored_keys(layers, secret_key=SECRET)
    assert not keyed & plain and not keyed & stored_keys(layers, secret_key=OTHER_SECRET)


def test_with_a_secret_no_stored_key_holds_or_follows_from_the_plain_block_keys() -> None:
    """Whoever can list the store (Mooncake shows every key to every client) must not be able to test a guessed
    prompt: hash the guess as prefix reuse does (the chained block keys, computable by anyone) and look for it among
    the keys. With a secret a key's last part is an HMAC of the block key under it: no stored key holds a plain block
    key or a plain digest of one, and another secret names the same blocks otherwise. Without a secret the names are
    the plain block keys (earlier versions' keys: the documented trade)."""
    layers: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32)]
    tokens = list(range(1000, 1000 + 4 * KEYS_TPB + 3))  # the prompt ``stored_keys`` serves
    chain, guesses = root_key(None), set[str]()
    for ordinal in range(len(tokens) // KEYS_TPB):
        chain = block_key(chain, tokens[ordinal * KEYS_TPB : (ordinal + 1) * KEYS_TPB])
        guesses |= {chain.hex(), hashlib.sha256(chain).hexdigest(), hashlib.blake2b(chain).hexdigest()}

    def names(keys: set[str]) -> set[str]:
        return {key.rsplit("/", 1)[1] for key in keys}

    assert names(stored_keys(layers)) <= guesses  # the control: the guesses are right
    keyed = stored_keys(layers, secret_key=SECRET)
    assert len(names(keyed)) == 4 and not names(keyed) & guesses
    assert not [key for key in keyed for guess in guesses if guess[:16] in key]
    assert not names(keyed) & names(stored_keys(layers, secret_key=OTHER_SECRET))


def test_pipeline_stages_numbering_layers_model_wide_share_no_key() -> None:
    """Layer ids are part of the keys: stages holding layers of the same shapes share no object when they number
    their layers model-wide; numbered from 0 each, the second stage's layout is the first's (the manager cannot tell:
    the README says so), and it would read the first stage's pages."""

    def stage(*layer_ids: int) -> list[LayerConfig]:
        return [attention(layer_id, 512) for layer_id in layer_ids]

    first = stored_keys(stage(0, 1))
    assert first and not first & stored_keys(stage(2, 3))
    assert stored_keys(stage(0, 1)) == first  # the second stage numbered from 0: the first stage's keys


class FailingStore(ForwardingStore):
    """Refuses every put, flips a byte of every object read, and fails every removal with an error."""

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        self.inner.put_batch(keys, buffers)
        return [False] * len(keys)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        lengths = self.inner.get_batch(keys, buffers)
        for buffer in buffers:
            buffer[-1] ^= 1
        return lengths

    def remove_batch(self, keys: list[str]) -> list[bool]:
        raise RemoteStoreError(f"cannot remove {keys[0]}")


class Failing:
    def __init__(self, inner: MemoryStoreConfig) -> None:
        self.inner = inner

    def open(self, quota: int) -> RemoteStore:
        return FailingStore(self.inner.open(quota))


def test_the_secret_never_appears_in_repr_logs_events_statistics_keys_or_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two keyed instances share a store (the second rotated: the first's secret is its previous one); the second's
    store client fails every way the tier logs (refused puts, corrupt objects, a failing removal): nothing any of it
    shows holds either secret, in any common spelling."""
    caplog.set_level(logging.DEBUG)
    memory = MemoryStoreConfig()
    shown: list[str] = []
    instances: list[KVCacheManager] = []
    rotations: list[tuple[bytes, tuple[bytes, ...]]] = [(SECRET, ()), (OTHER_SECRET, (SECRET,))]
    backends: list[RemoteStoreConfig] = [memory, Failing(memory)]
    for backend, (secret, previous) in zip(backends, rotations):
        remote = RemoteCacheTierConfig(
            0, backend, namespace="shown", secret_key=secret, previous_secret_keys=previous, retry_after_s=0.0
        )
        config = make_config(
            [attention(0, 512)], tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=TPB,
            enable_kv_events=True,
        )
        shown += [repr(remote), str(remote), repr(config)]
        instances.append(KVCacheManager(config))
    tokens = prompt(40, blocks=4)
    for manager in instances:
        serve(BASE, manager, tokens)
        shown += [repr(event) for event in manager.get_latest_events()]
        shown.append(repr(stats_of(manager)))
    assert stats_of(instances[1]).rejected_pages > 0 and stats_of(instances[1]).store_failures > 0
    for manager in instances:
        manager.shutdown()
    shown += [record.getMessage() for record in caplog.records]
    assert any("rejected object" in line for line in shown) and any("removing" in line for line in shown)
    shown += list(memory.objects)  # the keys (the objects' bytes hold the digests, which depend on the secret)
    spellings: list[str] = []
    for secret in (SECRET, OTHER_SECRET):
        spellings += [secret.hex(), secret.hex().upper(), repr(secret), str(list(secret)), secret.decode("latin-1")]
        spellings += [base64.b64encode(secret).decode(), base64.urlsafe_b64encode(secret).decode()]
    leaks = [line for line in shown for spelling in spellings if spelling in line]
    assert not leaks, leaks[:3]


# --------------------------------------------------------------------------------------------- the real store
MIXED = {"none-keyed": (None, SECRET), "keyed-none": (SECRET, None), "two-secrets": (SECRET, OTHER_SECRET)}


@pytest.mark.parametrize("mix", list(MIXED))
def test_deployments_with_other_secrets_never_read_each_others_pages(cluster: MooncakeCluster, mix: str) -> None:
    """A writer, its twin holding the same secret (the control: it reads every block back, content checked) and a
    reader holding another secret (or none), which finds none of the writer's objects."""
    writer, reader = MIXED[mix]
    first, other = Instance("base", secret_key=writer), Instance("base", secret_key=reader)
    check_never_reads(cluster, f"secrets-{mix}", first, other)


def forge(cluster: MooncakeCluster, victims: list[str], donors: list[str], secret: bytes | None) -> None:
    """Replace each victim's object by a donor object's payload (another prompt's page of the same layer group),
    framed for the victim's key with the digest ``secret`` gives (the tier's own framing)."""
    client = cluster.config().open(0)
    hasher = object_hasher(secret)
    sources = {key[: key.rindex("/") + 1]: key for key in donors}
    donor_keys = [sources[key[: key.rindex("/") + 1]] for key in victims]
    buffers: list[HostBuffer] = [np.empty(1 << 20, dtype=np.uint8) for _ in donor_keys]
    lengths = client.get_batch(donor_keys, buffers)
    assert all(length > HEADER.size for length in lengths), lengths
    forged: list[HostBuffer] = []
    for buffer, length, victim in zip(buffers, lengths, victims):
        out: HostBuffer = np.empty(length, dtype=np.uint8)
        frame(hasher, victim, buffer[HEADER.size : length], out)
        forged.append(out)
    assert all(client.remove_batch(victims))
    assert all(client.put_batch(victims, forged))
    client.close()


def written_then_forged(cluster: MooncakeCluster, test: str, instance: Instance, forger: bytes | None) -> None:
    """``instance`` serves prompts A then B; the forger replaces A's objects with B's pages."""
    backend = RecordingConfig(cluster.config())
    writer = instance.manager(backend, test)
    serve(instance, writer, prompt(50))
    victims = list(backend.keys)
    serve(instance, writer, prompt(51))
    donors = backend.keys[len(victims) :]
    writer.shutdown()
    forge(cluster, victims, donors, forger)


def test_without_a_secret_a_forged_object_is_served(cluster: MooncakeCluster) -> None:
    """The trust assumption of a deployment without a secret (and the control for the forger): an object framed with
    the unkeyed digest is accepted, and the reader serves another prompt's page."""
    written_then_forged(cluster, "forged-plain", BASE, None)
    reader = BASE.manager(cluster.config(), "forged-plain")
    with pytest.raises(ContentError):
        serve(BASE, reader, prompt(50))
    assert stats_of(reader).fetched_pages > 0 and stats_of(reader).rejected_pages == 0
    reader.shutdown()


@pytest.mark.parametrize("forger", [None, OTHER_SECRET], ids=["unkeyed", "other-secret"])
def test_with_a_secret_a_forged_object_is_a_miss_removed_for_an_honest_copy(
    cluster: MooncakeCluster, forger: bytes | None
) -> None:
    """The same forgery against a deployment holding a secret: every forged object is rejected (a miss: the reader
    computes the prompt, content checked) and removed, so the reader's honest copies take the keys back and a
    second reader of the deployment reads them all."""
    keyed = Instance("base", secret_key=SECRET)
    test = f"forged-{forger is None}"
    written_then_forged(cluster, test, keyed, forger)
    reader = keyed.manager(cluster.config(), test)
    assert serve(keyed, reader, prompt(50)) == 0
    stats = stats_of(reader)
    assert stats.found_pages > 0 and stats.fetched_pages == 0 and stats.rejected_pages > 0, stats
    # Mooncake answers a put under a taken key with success and keeps the first object: only a removed forgery
    # gives way to the honest copy the reader computed and wrote through, which a second reader then fetches.
    second = keyed.manager(cluster.config(), test)
    assert serve(keyed, second, prompt(50)) == 8 * TPB
    assert stats_of(second).fetched_pages == stats.rejected_pages and stats_of(second).rejected_pages == 0
    reader.shutdown()
    second.shutdown()
