"""``ForwardingStore``: a ``RemoteStore`` passing every call to another, for tests' wrappers that change one call;
``RecordingConfig``: a store config whose clients note what the tier asks of the store."""

from __future__ import annotations

from kv_cache_manager_v2._base.remote_store import HostBuffer, RemoteStore, RemoteStoreConfig


class ForwardingStore(RemoteStore):
    def __init__(self, inner: RemoteStore) -> None:
        self.inner = inner

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        return self.inner.put_batch(keys, buffers)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        return self.inner.get_batch(keys, buffers)

    def exists_batch(self, keys: list[str]) -> list[bool]:
        return self.inner.exists_batch(keys)

    def remove_batch(self, keys: list[str]) -> list[bool]:
        return self.inner.remove_batch(keys)

    def close(self) -> None:
        self.inner.close()


class RecordingConfig:
    """Wraps any store config (Mooncake's, the in-process one); over every client it opened: ``keys``, each key
    stored, in order (what a listing of the store shows whoever can read it), and ``probes``, each
    ``exists_batch``'s number of keys (what a miss costs); ``stores``, the clients, each counting its ``puts``."""

    def __init__(self, inner: RemoteStoreConfig) -> None:
        self.inner = inner
        self.keys: list[str] = []
        self.probes: list[int] = []
        self.stores: list[RecordingStore] = []

    def open(self, quota: int) -> RemoteStore:
        self.stores.append(RecordingStore(self.inner.open(quota), self))
        return self.stores[-1]


class RecordingStore(ForwardingStore):
    """One client of a ``RecordingConfig``: counts its put batches and notes into the config's records."""

    def __init__(self, inner: RemoteStore, record: RecordingConfig) -> None:
        super().__init__(inner)
        self.record = record
        self.puts = 0

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        self.puts += 1
        self.record.keys.extend(keys)
        return self.inner.put_batch(keys, buffers)

    def exists_batch(self, keys: list[str]) -> list[bool]:
        self.record.probes.append(len(keys))
        return self.inner.exists_batch(keys)
