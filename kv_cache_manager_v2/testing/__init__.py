"""Test support shipped with the package: the content-checking ``FakeEngine`` (with prefix-aware token codes) and an
in-memory remote store."""

from .contextual_tokens import ContextualTokens, contextual_tokens
from .fake_engine import ContentError, FakeEngine
from .memory_store import MemoryStore, MemoryStoreConfig

__all__ = ["ContentError", "ContextualTokens", "FakeEngine", "MemoryStore", "MemoryStoreConfig", "contextual_tokens"]
