"""Rotating the remote tier's ``secret_key`` without a cold cache: ``previous_secret_keys`` are read after the current
secret, each object checked with the secret of the key space it was found in, and what is found there is stored
again under the current secret (write-through), so the old secret can go once nothing is found under it any more.

The store is a real Mooncake (master and storage node on loopback) for the serving tests; content is checked with
``contextual_tokens`` (``serve``): a page of another prompt fails the reader's FakeEngine check.
"""

from __future__ import annotations

import base64
import pickle

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.forwarding_store import RecordingConfig
from tests.helpers import attention, make_config
from tests.mooncake_helpers import MooncakeCluster, cluster
from tests.test_remote_integrity import TPB, Instance, prompt, serve
from tests.test_remote_secret import written_then_forged
from tests.test_remote_tier import stats_of

OLD = bytes(range(1, 33))
NEW = bytes(range(41, 73))
WRONG = bytes(range(101, 133))
THIRD = bytes(range(151, 183))
BASE_OF_ONE_LAYER = Instance("base", layers=[attention(0, 512)])


# ------------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("previous", "error", "says"),
    [
        (OLD, TypeError, "previous_secret_keys must be a tuple or list of bytes values, got bytes"),
        (OLD.hex(), TypeError, "got str"),
        (None, TypeError, "got NoneType"),
        ([OLD.hex()], TypeError, "previous_secret_keys[0] must be bytes, got str"),
        ((OLD, bytearray(WRONG)), TypeError, "previous_secret_keys[1] must be bytes, got bytearray"),
        ((OLD, WRONG[:15]), ValueError, "previous_secret_keys[1] must be 16 to 64 bytes long"),
        ((OLD, WRONG, THIRD), ValueError, "holds at most 2 secrets"),
        ((OLD, WRONG, OLD[:]), ValueError, "holds at most 2 secrets"),
        ((OLD, bytes(OLD)), ValueError, "previous_secret_keys[1] repeats previous_secret_keys[0]"),
        ((WRONG, NEW), ValueError, "previous_secret_keys[1] is secret_key itself"),
    ],
)
def test_bad_previous_secret_keys_are_refused_naming_the_field_and_never_showing_them(
    previous: object, error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as raised:
        RemoteCacheTierConfig(
            0, MemoryStoreConfig(), namespace="n", secret_key=NEW, previous_secret_keys=previous  # type: ignore[arg-type]
        )
    message = str(raised.value)
    assert "RemoteCacheTierConfig.previous_secret_keys" in message and says in message, message
    for secret in (OLD, NEW, WRONG):
        assert secret.hex() not in message and repr(secret) not in message and secret[:15].hex() not in message


def test_previous_secret_keys_need_a_secret_key() -> None:
    """Reading under old secrets while writing unsigned would give up what the secret was for."""
    with pytest.raises(ValueError, match=r"previous_secret_keys needs a secret_key"):
        RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", previous_secret_keys=(OLD,))


def test_previous_secret_keys_are_kept_as_a_tuple_hidden_in_repr_and_pickled() -> None:
    config = RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", secret_key=NEW, previous_secret_keys=[OLD])
    assert config.previous_secret_keys == (OLD,)
    assert repr(config).endswith("secret_key=<hidden>, previous_secret_keys=(<hidden>,))"), repr(config)
    two = RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", secret_key=NEW, previous_secret_keys=(OLD, WRONG))
    assert repr(two).endswith("previous_secret_keys=(<hidden>, <hidden>))")
    assert repr(RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n")).endswith("previous_secret_keys=())")
    for shown in (repr(config), str(config), repr(two)):
        for secret in (OLD, NEW, WRONG):
            for spelling in (secret.hex(), repr(secret), base64.b64encode(secret).decode(), str(list(secret))):
                assert spelling not in shown
    assert pickle.loads(pickle.dumps(two)).previous_secret_keys == (OLD, WRONG)


# --------------------------------------------------------------------------------------- what a miss costs
@pytest.mark.parametrize("previous", [(), (OLD,), (OLD, WRONG)], ids=["none", "one", "two"])
def test_a_miss_looks_each_page_up_once_per_secret_in_one_probe(previous: tuple[bytes, ...]) -> None:
    """The bound an operator pays while a rotation is under way: one more key per page and previous secret, in the
    same ``exists_batch`` (no round trip more)."""
    backend = RecordingConfig(MemoryStoreConfig())
    remote = RemoteCacheTierConfig(0, backend, namespace="n", secret_key=NEW, previous_secret_keys=previous)
    manager = KVCacheManager(make_config(
        [attention(0, 512)], tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=TPB
    ))
    assert manager.prefetch_remote(None, prompt(70, blocks=6)) == 0
    assert backend.probes == [6 * (1 + len(previous))]
    assert stats_of(manager).probed_pages == 6
    manager.shutdown()


def test_without_write_through_a_page_found_under_a_previous_secret_is_stored_anew_when_dropped() -> None:
    """``write_through=False`` stores pages only as the coldest local tier drops them: a page fetched under the
    previous secret is no exception (the current secret's key for it is not known as stored), so once the rotated
    instance shuts down an instance holding only the new secret reads the whole prompt."""
    store = MemoryStoreConfig()

    def instance(secret: bytes, previous: tuple[bytes, ...] = (), write_through: bool = True) -> KVCacheManager:
        remote = RemoteCacheTierConfig(
            0, store, namespace="n", secret_key=secret, previous_secret_keys=previous, write_through=write_through
        )
        return KVCacheManager(make_config(
            [attention(0, 512)], tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=TPB
        ))

    tokens = prompt(71, blocks=4, extra=0)
    old = instance(OLD)
    assert serve(BASE_OF_ONE_LAYER, old, tokens) == 0
    old.shutdown()
    rotated = instance(NEW, (OLD,), write_through=False)
    assert serve(BASE_OF_ONE_LAYER, rotated, tokens) == 4 * TPB
    assert stats_of(rotated).fetched_previous_secret_pages == 4 and stats_of(rotated).stored_pages == 0
    rotated.shutdown()
    assert stats_of(rotated).stored_pages == 4
    new_only = instance(NEW)
    assert serve(BASE_OF_ONE_LAYER, new_only, tokens) == 4 * TPB
    assert stats_of(new_only).fetched_pages == 4 and stats_of(new_only).fetched_previous_secret_pages == 0
    new_only.shutdown()


# --------------------------------------------------------------------------------------------- the real store
def test_a_rotated_instance_serves_the_old_secrets_pages_and_stores_them_under_the_new_one(
    cluster: MooncakeCluster,
) -> None:
    """An instance on the old secret serves a prompt; one rotated to the new secret (the old one listed as previous)
    reads all of it back, content checked, and stores it again under the new secret; an instance holding only the
    new secret then reads all of it too: the rotation never went through a cold cache."""
    old = Instance("base", secret_key=OLD)
    rotated = Instance("base", secret_key=NEW, previous_secret_keys=(OLD,))
    new_only = Instance("base", secret_key=NEW)
    tokens = prompt(60)
    writer = old.manager(cluster.config(), "rotated")
    serve(old, writer, tokens)
    reader = rotated.manager(cluster.config(), "rotated")
    assert serve(rotated, reader, tokens) == 8 * TPB
    stats = stats_of(reader)
    # What the prompt reads: every block of the full-attention group, the windowed group's last ones.
    assert 0 < stats.fetched_pages < stats_of(writer).stored_pages and stats.rejected_pages == 0, stats
    assert stats.fetched_previous_secret_pages == stats.stored_pages == stats.fetched_pages, stats
    after = new_only.manager(cluster.config(), "rotated")
    assert serve(new_only, after, tokens) == 8 * TPB
    assert stats_of(after).fetched_pages == stats.fetched_pages and stats_of(after).fetched_previous_secret_pages == 0
    for manager in (writer, reader, after):
        manager.shutdown()


def test_during_a_two_phase_rollout_switched_and_unswitched_instances_read_each_other(
    cluster: MooncakeCluster,
) -> None:
    """The rollout the README describes: every instance first lists the next secret as a previous one, then each
    switches (the old secret becomes the previous one). Instances on either side of the switch read what the other
    side writes, content checked."""
    unswitched = Instance("base", secret_key=OLD, previous_secret_keys=(NEW,))
    switched = Instance("base", secret_key=NEW, previous_secret_keys=(OLD,))
    first = unswitched.manager(cluster.config(), "rollout")
    second = switched.manager(cluster.config(), "rollout")
    serve(switched, second, prompt(61))
    assert serve(unswitched, first, prompt(61)) == 8 * TPB
    serve(unswitched, first, prompt(62))
    assert serve(switched, second, prompt(62)) == 8 * TPB
    for manager in (first, second):
        stats = stats_of(manager)
        assert stats.fetched_pages == stats.fetched_previous_secret_pages > 0 and stats.rejected_pages == 0, stats
        manager.shutdown()


def test_a_wrong_previous_secret_is_a_miss_never_a_wrong_page(cluster: MooncakeCluster) -> None:
    """A rotated instance listing a secret nobody wrote with finds none of the old secret's objects (another key
    space): it computes the prompt, content checked."""
    writer_instance = Instance("base", secret_key=OLD)
    writer = writer_instance.manager(cluster.config(), "wrong")
    serve(writer_instance, writer, prompt(63))
    mistaken = Instance("base", secret_key=NEW, previous_secret_keys=(WRONG,))
    reader = mistaken.manager(cluster.config(), "wrong")
    assert serve(mistaken, reader, prompt(63)) == 0
    stats = stats_of(reader)
    assert stats.found_pages == 0 and stats.fetched_pages == 0, stats
    writer.shutdown()
    reader.shutdown()


def test_objects_forged_under_the_previous_secrets_keys_are_rejected_and_removed(cluster: MooncakeCluster) -> None:
    """Whoever lists the store sees the old secret's keys; objects put there framed without the old secret (here
    with another one) are checked with the old secret and rejected (a miss, content checked), and the
    reader's honest copies go under the new secret, where an instance holding only that one reads them."""
    written_then_forged(cluster, "forged-old", Instance("base", secret_key=OLD), WRONG)
    rotated = Instance("base", secret_key=NEW, previous_secret_keys=(OLD,))
    reader = rotated.manager(cluster.config(), "forged-old")
    assert serve(rotated, reader, prompt(50)) == 0
    stats = stats_of(reader)
    assert stats.found_pages > 0 and stats.rejected_pages > 0, stats
    assert stats.fetched_pages == 0 and stats.fetched_previous_secret_pages == 0
    again = rotated.manager(cluster.config(), "forged-old")
    assert serve(rotated, again, prompt(50)) == 8 * TPB
    assert stats_of(again).fetched_previous_secret_pages == 0 and stats_of(again).rejected_pages == 0
    reader.shutdown()
    again.shutdown()
