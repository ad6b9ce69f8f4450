"""The configs and the batch request are final in both modes: subclassing one raises ``TypeError`` naming it.

Compiled, mypyc checks a parameter, a field read and ``self`` of an inherited method by exact type for a class
with no subclass in the package, non-native ones included, so a user's ``MyBuffer(BufferConfig)`` failed at its
own construction ("BufferConfig object expected; got MyBuffer") and a ``KVCacheRequest`` subclass at
``create_kv_cache_batch``, while interpreted both were taken (``tools/mode_parity.py``'s ``inputs`` scenario found
it). Accepting them compiled would need every typed boundary to take ``object``; they are plain data, so both
modes refuse the subclass where it is defined instead (``typing.final`` tells type checkers too). ``ReuseScope``
keeps its documented difference (``tests/test_reentry_surfaces.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    KVCacheRequest,
    MooncakeStoreConfig,
    RemoteCacheTierConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2.kernels.attention_params import AttentionParams

FINAL = [
    AttentionLayerConfig, BatchDesc, BufferConfig, DiskCacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig,
    KVCacheDesc, KVCacheManagerConfig, KVCacheRequest, MooncakeStoreConfig, RemoteCacheTierConfig, SsmLayerConfig,
    SwaScratchReuseConfig, AttentionParams,
]
# Non-native classes that may be subclassed: exceptions (raised, never passed in) and ReuseScope (its documented
# difference: interpreted takes a subclass as the plain scope it holds, compiled refuses it at the call).
SUBCLASSABLE = {"ReuseScope", "MultimodalDigest"}


@pytest.mark.parametrize("cls", FINAL, ids=lambda cls: cls.__name__)
def test_subclassing_is_refused_naming_the_class(cls: type) -> None:
    with pytest.raises(TypeError, match=rf"{cls.__name__} cannot be subclassed"):
        type("Mine", (cls,), {})


def test_every_non_native_class_of_the_compiled_modules_is_final_or_listed() -> None:
    """Read from the sources: each ``mypyc_attr(native_class=False)`` class that is not an exception is in
    ``FINAL`` (so the runtime refusal is tested above) or in ``SUBCLASSABLE`` with its reason."""
    root = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"
    applications = {"sim", "models", "batching", "cli"}
    found: set[str] = set()
    for path in root.rglob("*.py"):
        if applications & set(path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any("native_class=False" in ast.unparse(d) for d in node.decorator_list):
                if not any(ast.unparse(base).endswith(("Error", "Exception")) for base in node.bases):
                    found.add(node.name)
    assert found - SUBCLASSABLE == {cls.__name__ for cls in FINAL}
