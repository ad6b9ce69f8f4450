"""A user's class may name the public Protocol it implements as its base (``class MyStore(RemoteStore)``), as PEP
544 allows, in both modes. Compiled, mypyc made each Protocol of a compiled module a native trait, so such a class
could be defined but not instantiated ("interpreted classes cannot inherit from compiled traits"), while
interpreted it worked (``tools/mode_parity.py``'s subclass probe found it); the public Protocols are non-native
now, as is every Protocol of a compiled module. Checked by making each public one's subclass, by a store and a
codec naming their Protocols serving a manager, and by reading the sources for a Protocol left native."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    ColdPageCodec,
    KVCacheManager,
    PageView,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreConfig,
    _introspection,
)
from kv_cache_manager_v2._handoff.nixl_agent import NixlAgent
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.forwarding_store import ForwardingStore
from tests.fuzz.configs import COLD_PAGE_BYTES, CONFIGS

PUBLIC_PROTOCOLS = [ColdPageCodec, PageView, RemoteStore, RemoteStoreConfig, NixlAgent]


@pytest.mark.parametrize("protocol", PUBLIC_PROTOCOLS, ids=lambda protocol: protocol.__name__)
def test_a_class_naming_a_public_protocol_as_base_can_be_instantiated(protocol: type) -> None:
    assert protocol in type(type("Mine", (protocol,), {})()).__mro__


class NamedStoreConfig(RemoteStoreConfig):
    def __init__(self) -> None:
        self.memory = MemoryStoreConfig()

    def open(self, quota: int) -> RemoteStore:
        return ForwardingStore(self.memory.open(quota))  # ForwardingStore names RemoteStore as its base


class NamedCodec(ColdPageCodec):
    def __init__(self) -> None:
        self.padding = _introspection.create_test_padding_cold_page_codec(COLD_PAGE_BYTES)
        self.encoded = 0

    def encoded_page_bytes(self, layer_group_id: int) -> int:
        return self.padding.encoded_page_bytes(layer_group_id)

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        self.encoded += 1
        self.padding.encode(layer_group_id, pages, encoded)

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        self.padding.decode(layer_group_id, encoded, pages)


def serve(manager: KVCacheManager, tokens: list[int]) -> None:
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def test_a_store_and_a_codec_naming_their_protocols_serve_a_manager(tmp_path: object) -> None:
    configs = {config.name: config for config in CONFIGS}
    remote = configs["remote_fills"].build("")
    store_config = NamedStoreConfig()
    tiers = [*remote.cache_tiers[:-1], RemoteCacheTierConfig(0, store_config, namespace="named")]
    manager = KVCacheManager(dataclasses.replace(remote, cache_tiers=tiers))
    serve(manager, list(range(64)))
    statistics = manager.get_remote_tier_statistics()
    assert statistics is not None and statistics.stored_pages > 0
    manager.shutdown()

    codec = NamedCodec()
    manager = KVCacheManager(configs["cold_codec"].build(str(tmp_path)), cold_page_codec=codec)
    assert codec.encoded > 0  # the construction-time round trip went through it
    serve(manager, list(np.arange(64)))
    manager.shutdown()


def test_every_protocol_of_the_compiled_modules_is_non_native() -> None:
    """Read from the sources, so a new Protocol cannot be compiled into a trait no interpreted class can extend."""
    root = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"
    applications = {"sim", "models", "batching", "cli"}
    native: list[str] = []
    for path in root.rglob("*.py"):
        if applications & set(path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and "Protocol" in map(ast.unparse, node.bases):
                if not any("native_class=False" in ast.unparse(decorator) for decorator in node.decorator_list):
                    native.append(f"{path.relative_to(root)}: {node.name}")
    assert native == []
