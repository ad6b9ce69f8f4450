"""What ``help()`` shows a user: every public class, method and property of the package documents itself in
words (no citations of a spec the user does not have), and ``MovementCounters`` prints readably (both modes)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
import re

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCache, KVCacheManager,
                                 KVCacheManagerConfig, MovementCounters, SsmLayerConfig)
from kv_cache_manager_v2.testing import FakeEngine
from tests import public_parameters
from tests.helpers import attention, make_config

PUBLIC_MODULES = [
    "kv_cache_manager_v2",
    "kv_cache_manager_v2.config",
    "kv_cache_manager_v2.config.batches",
    "kv_cache_manager_v2.config.layers",
    "kv_cache_manager_v2.config.manager_config",
    "kv_cache_manager_v2.config.tiers",
    "kv_cache_manager_v2.disagg",
    "kv_cache_manager_v2.sim.workload",
    "kv_cache_manager_v2.testing",
    "kv_cache_manager_v2.testing.fake_engine",
    "kv_cache_manager_v2.kernels.attention",
    "kv_cache_manager_v2.kernels.kv_append",
    "kv_cache_manager_v2.kernels.page_copy",
    "kv_cache_manager_v2.kernels.page_table",
    "kv_cache_manager_v2.kernels.ssm_copy",
]
SPEC_CITATION = re.compile(r"SPEC\s*§|§\s*\d")
# mypyc (2.4) drops the docstrings of what it compiles: what help() shows comes from the sources, checked here.
sources_only = pytest.mark.skipif(kv_cache_manager_v2.COMPILED, reason="compiled classes and functions carry no docstrings")


# The subpackages an engine imports from besides the package itself (adopt11v: help(PrefixIndex) showed the
# docstring of the sealed base class, since a class without its own inherits the nearest one in help()).
ENGINE_FACING_PACKAGES = [*public_parameters.ENGINE_FACING_PACKAGES, "kv_cache_manager_v2.disagg"]


def public_classes() -> list[type]:
    """Every class the package exports, and the package's own public classes its engine-facing modules offer."""
    found = [value for name, value in vars(kv_cache_manager_v2).items() if not name.startswith("_") and inspect.isclass(value)]
    for module_name in ENGINE_FACING_PACKAGES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", [name for name in vars(module) if not name.startswith("_")]):
            value = getattr(module, name)
            if inspect.isclass(value) and value.__module__.startswith("kv_cache_manager_v2") and value not in found:
                found.append(value)
    return found


def members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties a class defines itself (a class-valued attribute such as ``Status`` aside)."""
    found: list[tuple[str, object]] = []
    for name, value in vars(cls).items():
        if name.startswith("_") or inspect.isclass(value):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or callable(value):
            found.append((name, value))
    return found


@sources_only
@pytest.mark.parametrize("cls", public_classes(), ids=lambda cls: cls.__name__)
def test_public_classes_document_every_method_and_property(cls: type) -> None:
    assert (vars(cls).get("__doc__") or "").strip(), cls.__name__
    undocumented = [name for name, value in members(cls) if not (getattr(value, "__doc__", None) or "").strip()]
    assert undocumented == [], f"{cls.__name__}: {undocumented}"


def documented_objects(module_name: str) -> list[tuple[str, object]]:
    """The module, its public functions and classes (the package: every public name) and their members."""
    module = importlib.import_module(module_name)
    found: list[tuple[str, object]] = [(module_name, module)]
    for name, value in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(value) or inspect.isroutine(value)):
            continue
        if module_name != "kv_cache_manager_v2" and getattr(value, "__module__", None) != module_name:
            continue  # imported from elsewhere
        found.append((f"{module_name}.{name}", value))
        if inspect.isclass(value):
            found += [(f"{module_name}.{name}.{member}", doc) for member, doc in members(value)]
    return found


@sources_only
def test_docstrings_say_it_in_words_without_citing_the_spec() -> None:
    citing = [
        name
        for module_name in PUBLIC_MODULES
        for name, value in documented_objects(module_name)
        if SPEC_CITATION.search(getattr(value, "__doc__", None) or "")
    ]
    assert citing == []


@sources_only
def test_the_converter_and_the_quota_have_docstrings_not_comments() -> None:
    """``help()`` falls back to the comment above an undocumented method: here a section divider."""
    for method in (KVCacheManager.get_page_index_converter, KVCacheManager.get_quota, KVCacheManager.get_layer_group_id):
        doc = inspect.getdoc(method) or ""
        assert len(doc) > 40 and "---" not in doc, method


@sources_only
@pytest.mark.parametrize(
    ("method", "where"),
    [
        (KVCache.resume, "last_refusal"),
        (KVCache.resize, "last_refusal"),
        (KVCache.prefetch, "last_refusal"),
        (KVCacheManager.create_kv_cache_batch, "last_batch_refusals"),
        (KVCacheManager.resize, "last_refusal"),
        (KVCacheManager.adjust, "last_refusal"),
    ],
    ids=lambda value: getattr(value, "__qualname__", value),
)
def test_every_soft_refusal_names_where_its_reason_is_kept(method: object, where: str) -> None:
    """An engine meets a False or a None in ``help()`` of the call it made: the reason must be findable from there,
    not only from the README's section on refusals."""
    assert where in (inspect.getdoc(method) or "")


def test_movement_counters_print_their_fields() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    counters = manager.movement_counters
    assert isinstance(counters, MovementCounters)
    assert repr(counters) == (
        "MovementCounters(onboarded_pages=0, onboarded_bytes=0, offloaded_pages=0, offloaded_bytes=0, "
        "copied_pages=0, dropped_pages=0, lost_pages=0)"
    )
    manager.shutdown()


def test_no_module_cites_a_document_outside_the_repository() -> None:
    """The design is described here (README's Architecture section, CLAUDE.md, the docstrings): a source that cites
    a numbered section of a specification kept elsewhere leaves its reader without the reason."""
    package = Path(kv_cache_manager_v2.__file__).resolve().parent
    citing = [
        f"{path.relative_to(package.parent)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SPEC_CITATION.search(line)
    ]
    assert citing == []


@sources_only
def test_help_says_what_the_fake_engine_needs_and_how_the_resume_limit_rounds() -> None:
    """Two facts an engine author met by trial (adopt4): FakeEngine's buffer requirements were in its module's
    docstring (half of them) and its errors, not in ``help(FakeEngine)``; and the default ``max_util_for_resume``
    lets a 2-slot SSM pool group run one cache only, which its one-line description did not let anyone guess.
    Both are checked against the behaviour they describe."""
    engine_doc = inspect.getdoc(FakeEngine) or ""
    assert "multiple of 8 bytes" in engine_doc and "at least 16 bytes" in engine_doc
    for row_bytes, state_bytes, fits in ((8, 16, True), (4, 16, False), (8, 8, False)):
        config = KVCacheManagerConfig(
            16, layers=[AttentionLayerConfig(0, [BufferConfig("key", 16 * row_bytes)]),
                        SsmLayerConfig(1, [BufferConfig("ssm_state", state_bytes)])],
            cache_tiers=[GpuCacheTierConfig(1 << 16)], backend="cpu",
        )
        manager = KVCacheManager(config)
        if fits:
            FakeEngine(manager)
        else:
            with pytest.raises(ValueError, match="layer [01] role"):
                FakeEngine(manager)
        manager.shutdown()
    config_doc = inspect.getdoc(KVCacheManagerConfig) or ""
    assert "int(max_util_for_resume * slots)" in config_doc and "one slot of" in config_doc
    # The documented example: 2 SSM slots, the default limit, one cache at a time (1.0: both).
    for limit, running in ((0.97, 1), (1.0, 2)):
        manager = KVCacheManager(KVCacheManagerConfig(
            16, layers=[AttentionLayerConfig(0, [BufferConfig("key", 128)]),
                        SsmLayerConfig(1, [BufferConfig("ssm_state", 1 << 14)])],
            cache_tiers=[GpuCacheTierConfig(2 * (1 << 14) + 64 * 128)], backend="cpu", max_util_for_resume=limit,
            initial_pool_ratio=[1.0, 4.0],
        ))
        assert manager.get_storage_statistics(0)[manager.get_layer_group_id(1)].total == 2
        caches = [manager.create_kv_cache() for _ in range(2)]
        assert [cache.resume() for cache in caches] == [True, running == 2], limit
        for cache in caches:
            cache.close()
        manager.shutdown()


@sources_only
def test_batch_admission_says_a_refused_request_does_not_stop_the_later_ones() -> None:
    """adopt4's FCFS loop stopped at the first None and dropped the later, admitted (active) caches unclosed:
    help() said only that earlier requests stay admitted. test_refusals' per-request test pins the behaviour."""
    doc = " ".join((inspect.getdoc(KVCacheManager.create_kv_cache_batch) or "").split())
    assert "Later requests are still tried" in doc and "closes" in doc
