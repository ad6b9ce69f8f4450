"""Objects tampered with in a real Mooncake Store (master and storage node on loopback): a flipped byte, a cut or
padded object, one stored under another key, one whose header alone is another format's. The reader finds each,
accepts none (it recomputes, its content checked) and removes it, so an honest instance's copy can take the key.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2 import MooncakeStoreConfig, RemoteStore
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._remote.objects import FORMAT_VERSION, HEADER, MAGIC, object_digest, object_hasher
from tests.forwarding_store import ForwardingStore
from tests.mooncake_helpers import MooncakeCluster, cluster
from tests.test_remote_tier import TPB, make_manager, prompt, serve, stats_of


class RemoteStoreWrapper:
    """A backend config whose stores tamper with what they put: ``mode`` flip (a payload byte), short (the last 7
    bytes cut), long (7 bytes added), swap (each object stored under the next key), or one header field changed in an
    object framed again with a digest that matches (anyone can compute the unkeyed one): version (another format
    version's), magic, size (a payload size other than what follows)."""

    def __init__(self, inner: MooncakeStoreConfig, mode: str) -> None:
        self.inner = inner
        self.mode = mode

    def open(self, quota: int) -> RemoteStore:
        return TamperingStore(self.inner.open(quota), self.mode)


class TamperingStore(ForwardingStore):
    def __init__(self, inner: RemoteStore, mode: str) -> None:
        super().__init__(inner)
        self.mode = mode

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        changed: list[HostBuffer] = []
        for key, buffer in zip(keys, buffers):
            copy = buffer.copy()
            if self.mode in REFRAMED:
                copy = reframed(key, copy, self.mode)
            elif self.mode == "flip":
                copy[-1] ^= 1
            elif self.mode == "short":
                copy = copy[:-7].copy()
            elif self.mode == "long":
                copy = np.concatenate([copy, np.zeros(7, dtype=np.uint8)])
            changed.append(copy)
        if self.mode == "swap":
            changed = changed[1:] + changed[:1]
        return self.inner.put_batch(keys, changed)


# Header fields an object can differ in while its digest matches: each alone makes it another format's object.
REFRAMED = {"version": (MAGIC, FORMAT_VERSION + 1), "magic": (b"KVM3", FORMAT_VERSION), "size": (MAGIC, FORMAT_VERSION)}


def reframed(key: str, framed: HostBuffer, mode: str) -> HostBuffer:
    """``framed`` with the header ``mode`` names changed and a digest computed again, so only that field is wrong."""
    magic, version = REFRAMED[mode]
    payload = framed[HEADER.size :]
    size = payload.nbytes + (1 if mode == "size" else 0)
    digest = object_digest(object_hasher(None), key, payload)
    header = np.frombuffer(HEADER.pack(magic, version, 0, size, digest), dtype=np.uint8)
    return np.concatenate([header, payload])


@pytest.mark.parametrize("mode", ["flip", "short", "long", "swap", *REFRAMED])
def test_corrupted_short_long_or_misplaced_objects_are_rejected(cluster: MooncakeCluster, mode: str) -> None:
    writer = make_manager(RemoteStoreWrapper(cluster.config(), mode), f"tampered-{mode}")
    tokens = prompt(4)
    serve(writer, tokens)
    reader = make_manager(cluster.config(), f"tampered-{mode}")
    assert serve(reader, tokens) == 0  # every object was found, none accepted: recomputed, content checked
    stats = stats_of(reader)
    assert stats.found_pages > 0 and stats.fetched_pages == 0
    assert stats.rejected_pages > 0 and stats.warnings == stats.rejected_pages
    writer.shutdown()
    reader.shutdown()


@pytest.mark.parametrize("mode", ["flip", "short", "long", "swap"])
def test_a_rejected_object_is_removed_so_that_an_honest_instance_stores_it_again(
    cluster: MooncakeCluster, mode: str
) -> None:
    """Mooncake keeps the first object put under a key (a later put answers success and changes nothing), so a bad
    object left in place would turn its prefix into a miss for every instance for good: the reader that rejects it
    removes it, and its own pages, written through as it computes them, take the key."""
    test = f"poisoned-{mode}"
    writer = make_manager(RemoteStoreWrapper(cluster.config(), mode), test)
    tokens = prompt(9)
    serve(writer, tokens)
    healer = make_manager(cluster.config(), test)
    assert serve(healer, tokens) == 0 and stats_of(healer).rejected_pages > 0  # recomputed, then stored
    reader = make_manager(cluster.config(), test)
    assert serve(reader, tokens) == 8 * TPB  # the healer's pages, content checked
    stats = stats_of(reader)
    assert stats.rejected_pages == 0 and stats.fetched_pages > 0, stats
    for manager in (writer, healer, reader):
        manager.shutdown()
