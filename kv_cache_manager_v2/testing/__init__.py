"""Test support shipped with the package: the content-checking ``FakeEngine`` and an in-memory remote store."""

from .fake_engine import ContentError, FakeEngine
from .memory_store import MemoryStore, MemoryStoreConfig

__all__ = ["ContentError", "FakeEngine", "MemoryStore", "MemoryStoreConfig"]
