"""Pytest plugin: TensorRT-LLM's import paths answered by ``kv_cache_manager_v2`` (load with ``-p aliases``).

Upstream's tests import the manager as ``tensorrt_llm.runtime.kv_cache_manager_v2`` (or the bindings' path), a
test-side copy helper from ``kv_cache_manager_v2_utils``, and (the older suite) private modules of upstream's Python
implementation. Public paths map to our package; the copy helpers are CPU stand-ins; names that only exist inside
upstream's implementation are ``Absent`` placeholders that fail loudly when a test uses them.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

import kv_cache_manager_v2 as ours
from kv_cache_manager_v2 import _introspection

PUBLIC_PREFIXES = (
    "tensorrt_llm.runtime.kv_cache_manager_v2",
    "tensorrt_llm.bindings.internal.batch_manager.kv_cache_manager_v2",
    "bindings.internal.batch_manager.kv_cache_manager_v2",
)


class Absent:
    """An upstream-internal name with no counterpart here: any use raises, naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _refuse(self) -> NotImplementedError:
        return NotImplementedError(f"{self._name} is internal to TensorRT-LLM's implementation; no counterpart here")

    def __getattr__(self, attribute: str) -> Any:
        raise self._refuse()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise self._refuse()


class MemToMemTask(NamedTuple):
    """One copy of the batch: destination and source addresses (host memory on the cpu backend)."""

    dst: int
    src: int


def copy_device_to_device(tasks: Sequence[MemToMemTask], num_bytes: int, stream: int) -> None:
    for task in tasks:
        ctypes.memmove(task.dst, task.src, num_bytes)


def batched_copy(dst_tier: object, src_tier: object, num_bytes: int, tasks: Sequence[MemToMemTask], stream: int) -> None:
    copy_device_to_device(tasks, num_bytes, stream)


class CacheLevelStorage:
    """The older suite's home of the grain arithmetic, which ``_introspection`` offers under its newer names."""

    _grains_for_slots = staticmethod(_introspection.grains_for_slots)
    _grains_to_slots = staticmethod(_introspection.grains_to_slots)
    ratio_to_slot_count_list = staticmethod(_introspection.ratio_to_slot_count_list)


def _module(name: str, **members: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    return module


def _older_private_modules() -> dict[str, types.ModuleType]:
    """What the pure-Python era's test imports from upstream's private modules."""
    cuda_test_utils = importlib.import_module("cuda_test_utils")  # the stand-in beside this plugin
    helpers = {name: getattr(cuda_test_utils, name) for name in (
        "CachedCudaStream", "HalfOpenRange", "TemporaryCudaStream", "div_up", "exact_div", "get_uniform_attribute",
        "init_cuda_once", "intersect", "overlap", "remove_if", "round_up", "temporary_sys_path", "typed_range",
        "unwrap_rawref", "value_or")}
    return {
        "_block_radix_tree": _module("_block_radix_tree", Hasher=Absent("Hasher"),
                                     traverse_post_order=Absent("traverse_post_order")),
        "_common": _module("_common", BAD_PAGE_INDEX=ours.BAD_PAGE_INDEX, GPU_LEVEL=ours.GPU_LEVEL,
                           CacheTier=ours.CacheTier, MemAddress=ours.MemAddress, NDEBUG=ours.NDEBUG,
                           PageIndexMode=ours.PageIndexMode,
                           PageStatus=Absent("PageStatus"), SlidingWindowSize=ours.SlidingWindowSize),
        "_copy_engine": _module("_copy_engine", CopyTask=MemToMemTask, batched_copy=batched_copy),
        "_exceptions": _module("_exceptions", LogicError=ours.InvariantError, OutOfPagesError=ours.OutOfPagesError),
        "_life_cycle_registry": _module("_life_cycle_registry", SsmLifeCycle=Absent("SsmLifeCycle")),
        "_storage._core": _module("_storage._core", CacheLevelStorage=CacheLevelStorage,
                                  PoolGroupBase=Absent("PoolGroupBase"), SlotAllocator=Absent("SlotAllocator")),
        "_storage_manager": _module("_storage_manager", StorageManager=Absent("StorageManager")),
        "_utils": _module("_utils", **helpers),
    }


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves upstream module names to ours (or to the stand-ins above) before the normal finders run."""

    def __init__(self) -> None:
        self.stand_ins = {f"kv_cache_manager_v2.{name}": module for name, module in _older_private_modules().items()}
        utils = _module("kv_cache_manager_v2_utils", MemToMemTask=MemToMemTask,
                        copy_device_to_device=copy_device_to_device)
        for prefix in PUBLIC_PREFIXES:
            self.stand_ins[prefix + "_utils"] = utils

    def target(self, fullname: str) -> str | None:
        for prefix in PUBLIC_PREFIXES:
            if fullname == prefix or fullname.startswith(prefix + "."):
                return "kv_cache_manager_v2" + fullname[len(prefix):]
        return None

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.stand_ins or self.target(fullname) is not None:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if any(prefix.startswith(fullname + ".") for prefix in PUBLIC_PREFIXES):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)  # a parent package: empty
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        name = spec.name
        if name in self.stand_ins:
            return self.stand_ins[name]
        ours_name = self.target(name)
        if ours_name is not None:
            return importlib.import_module(ours_name)
        return _module(name, __path__=[])

    def exec_module(self, module: types.ModuleType) -> None:
        """The module is complete when created."""


sys.meta_path.insert(0, AliasFinder())
