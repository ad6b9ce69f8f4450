"""``ForwardingStore``: a ``RemoteStore`` passing every call to another, for tests' wrappers that change one call."""

from __future__ import annotations

from kv_cache_manager_v2._base.remote_store import HostBuffer, RemoteStore


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
