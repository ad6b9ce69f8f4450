"""A user's class may name the public Protocol it implements as its base (``class MyStore(RemoteStore)``), as PEP
544 allows, in both modes. Compiled, mypyc made each Protocol of a compiled module a native trait, so such a class
could be defined but not instantiated ("interpreted classes cannot inherit from compiled traits"), while
interpreted it worked (``tools/mode_parity.py``'s subclass probe found it); the public Protocols are non-native
now, and a member answering a value raises ``NotImplementedError`` where such a class leaves it out (compiled, a
bare ``...`` body aborted the process). Checked by making each one's subclass, by a store and a codec naming their
Protocols serving a manager, by calling what a bare subclass leaves out, and by reading the sources."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kv_cache_manager_v2
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
from tests.helpers import public_modules

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


UNIMPLEMENTED_CALLS = """
from kv_cache_manager_v2 import ColdPageCodec, PageView, RemoteStore, RemoteStoreConfig
from kv_cache_manager_v2._handoff.nixl_agent import NixlAgent

def bare(protocol):
    return type("Bare", (protocol,), {})()

calls = {
    "put_batch": lambda: bare(RemoteStore).put_batch([], []),
    "get_batch": lambda: bare(RemoteStore).get_batch([], []),
    "exists_batch": lambda: bare(RemoteStore).exists_batch([]),
    "remove_batch": lambda: bare(RemoteStore).remove_batch([]),
    "open": lambda: bare(RemoteStoreConfig).open(0),
    "encoded_page_bytes": lambda: bare(ColdPageCodec).encoded_page_bytes(0),
    "shape": lambda: bare(PageView).shape,
    "__dlpack__": lambda: bare(PageView).__dlpack__(),
    "__dlpack_device__": lambda: bare(PageView).__dlpack_device__(),
    "register_memory": lambda: bare(NixlAgent).register_memory([], "DRAM"),
    "get_agent_metadata": lambda: bare(NixlAgent).get_agent_metadata(),
    "add_remote_agent": lambda: bare(NixlAgent).add_remote_agent(b"agent"),
    "get_xfer_descs": lambda: bare(NixlAgent).get_xfer_descs(None, "DRAM"),
    "initialize_xfer": lambda: bare(NixlAgent).initialize_xfer("READ", None, None, "agent", b""),
    "transfer": lambda: bare(NixlAgent).transfer(None),
    "check_xfer_state": lambda: bare(NixlAgent).check_xfer_state(None),
    "get_new_notifs": lambda: bare(NixlAgent).get_new_notifs(),
}
for name, call in calls.items():
    try:
        print(name, "returned", repr(call()), flush=True)
    except NotImplementedError:
        print(name, "NotImplementedError", flush=True)
"""


def test_a_member_a_subclass_leaves_out_raises_instead_of_crashing() -> None:
    """Compiled, a bare ``...`` body of a member answering a value aborted the process ("fatal: out of memory")
    where interpreted it returned None: every such member of a public Protocol raises ``NotImplementedError``.
    In a subprocess, which the abort would kill instead of pytest."""
    env = dict(os.environ, PYTHONPATH=str(Path(str(kv_cache_manager_v2.__file__)).parent.parent))
    result = subprocess.run([sys.executable, "-c", UNIMPLEMENTED_CALLS], capture_output=True, text=True, env=env, cwd="/")
    assert result.returncode == 0, (result.stdout, result.stderr[-2000:])
    answers = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert len(answers) == 17 and set(answers.values()) == {"NotImplementedError"}, answers


def test_every_exported_protocol_is_non_native_and_raises_for_what_it_leaves_out() -> None:
    """Read from the sources: each exported Protocol (of the package, ``disagg``, ``kv_events``, ``testing``) is in
    ``PUBLIC_PROTOCOLS``, non-native, and has no member answering a value with a bare ``...`` body."""
    exported = {
        value for module in public_modules() for name in dir(module)
        if inspect.isclass(value := getattr(module, name)) and getattr(value, "_is_protocol", False)
        and str(value.__module__).startswith("kv_cache_manager_v2")
    }
    assert exported <= set(PUBLIC_PROTOCOLS)
    root = Path(__file__).resolve().parent.parent
    problems: list[str] = []
    for protocol in PUBLIC_PROTOCOLS:
        path = root / (protocol.__module__.replace(".", "/") + ".py")
        node = next(
            node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.name == protocol.__name__
        )
        if not any("native_class=False" in ast.unparse(decorator) for decorator in node.decorator_list):
            problems.append(f"{protocol.__name__} is native")
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.returns is not None and ast.unparse(item.returns) != "None":
                last = item.body[-1]
                if isinstance(last, ast.Expr) and isinstance(last.value, ast.Constant) and last.value.value is Ellipsis:
                    problems.append(f"{protocol.__name__}.{item.name} has a bare ... body")
    assert problems == []
