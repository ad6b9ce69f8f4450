"""Which public classes a user may extend is the same in both modes: the configs and the batch request are final,
every native public class is sealed, and defining a subclass of one raises ``TypeError`` naming it.

Compiled, mypyc checks a parameter, a field read and ``self`` of an inherited method by exact type for a class
with no subclass in the package, non-native ones included, so a user's ``MyBuffer(BufferConfig)`` failed at its
own construction ("BufferConfig object expected; got MyBuffer") and a ``KVCacheRequest`` subclass at
``create_kv_cache_batch``, while interpreted both were taken (``tools/mode_parity.py``'s ``inputs`` scenario found
it). Accepting them compiled would need every typed boundary to take ``object``; they are plain data, so both
modes refuse the subclass where it is defined instead (``typing.final`` tells type checkers too). ``ReuseScope``
keeps its documented difference (``tests/test_reentry_surfaces.py``).

The native public classes (values, statistics, handles, the manager, the transfer and event classes, the testing
helpers) had the same shape: compiled, mypyc takes a user subclass's definition but refuses to make one
("interpreted classes cannot inherit from compiled"), interpreted it worked (the subclass probe of
``tools/mode_parity.py`` found it). They derive from ``Sealed`` now, which refuses a subclass defined outside the
package in both modes. Every exported class is either refused here or listed in ``SUBCLASSABLE`` with its reason."""

from __future__ import annotations

import ast
import enum
import inspect
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
from kv_cache_manager_v2.disagg import KVFormat
from kv_cache_manager_v2.kernels.attention_params import AttentionParams
from tests.helpers import public_modules

FINAL = [
    AttentionLayerConfig, BatchDesc, BufferConfig, DiskCacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig,
    KVCacheDesc, KVCacheManagerConfig, KVCacheRequest, MooncakeStoreConfig, RemoteCacheTierConfig, SsmLayerConfig,
    SwaScratchReuseConfig, AttentionParams, KVFormat,
]
# Non-native classes that may be subclassed: exceptions (raised, never passed in) and ReuseScope (its documented
# difference: interpreted takes a subclass as the plain scope it holds, compiled refuses it at the call).
SUBCLASSABLE = {"ReuseScope", "MultimodalDigest"}
# Exported classes a user may extend in both modes, with the reason.
EXTENSIBLE: dict[str, str] = {
    "KVCacheEventManager": "its hooks are the documented extension point (allow_interpreted_subclasses)",
    "ReuseScope": "documented difference: interpreted takes a subclass as its plain scope, compiled refuses it",
    "MultimodalDigest": "a bytes subclass; a token of a further subclass is taken as its plain value",
    "BufferId": "a NamedTuple, a tuple to compiled code",
    "ColdPageCodec": "a Protocol (tests/test_protocol_subclasses.py)",
    "PageView": "a Protocol",
    "RemoteStore": "a Protocol",
    "RemoteStoreConfig": "a Protocol",
}


def exported_classes() -> dict[str, type]:
    return {
        name: value
        for module in public_modules()
        for name in dir(module)
        if inspect.isclass(value := getattr(module, name)) and str(value.__module__).startswith("kv_cache_manager_v2")
        and not issubclass(value, (BaseException, enum.Enum))  # exceptions may be extended; enums never are
    }


@pytest.mark.parametrize("name", sorted(set(exported_classes()) - set(EXTENSIBLE)))
def test_every_other_exported_class_refuses_a_subclass_naming_itself(name: str) -> None:
    cls = exported_classes()[name]
    with pytest.raises(TypeError, match=rf"{cls.__name__} cannot be subclassed"):
        type("Mine", (cls,), {})


@pytest.mark.parametrize("name", sorted(EXTENSIBLE))
def test_the_extensible_ones_can_be_extended(name: str) -> None:
    cls = exported_classes()[name]
    assert cls in type("Mine", (cls,), {}).__mro__


@pytest.mark.parametrize("cls", FINAL, ids=lambda cls: cls.__name__)
def test_subclassing_is_refused_naming_the_class(cls: type) -> None:
    with pytest.raises(TypeError, match=rf"{cls.__name__} cannot be subclassed"):
        type("Mine", (cls,), {})


def test_every_non_native_class_of_the_compiled_modules_is_final_or_listed() -> None:
    """Read from the sources: each public ``mypyc_attr(native_class=False)`` class that is neither an exception nor
    a Protocol is in ``FINAL`` (so the runtime refusal is tested above) or in ``SUBCLASSABLE`` with its reason. A
    private one (``kv_events.listen._OneLineParser``) is no class a user is handed to extend."""
    root = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"
    applications = {"sim", "models", "batching", "cli"}
    found: set[str] = set()
    for path in root.rglob("*.py"):
        if applications & set(path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                "native_class=False" in ast.unparse(d) for d in node.decorator_list
            ):
                if not any(ast.unparse(base).endswith(("Error", "Exception", "Protocol")) for base in node.bases):
                    found.add(node.name)
    assert found - SUBCLASSABLE == {cls.__name__ for cls in FINAL}
