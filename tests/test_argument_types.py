"""Integer parameters of the public surface are ``SupportsIndex``, never ``int``, wherever mypyc checks them (and
float ones ``SupportsFloat``, never ``float``).

Compiled, a parameter annotated ``int`` is checked and unboxed by mypyc on entry: a NumPy integer is refused with
mypyc's own ``TypeError`` ("int object expected; got numpy.int64") and ``True`` arrives as a plain 1, before any
check inside could refuse it; interpreted, both get in. The first CI rehearsal's compiled run failed on two
(``EventSubscriber(last_seq=)``, ``listen(count=)``). ``SupportsIndex`` lets both through to the function's own
check (``_base/validation.as_int`` and its kin: NumPy integers become ints, bools are refused naming the
argument), the same in both modes. A ``float`` parameter is the same trap: compiled, ``numpy.float32`` (not a
``float`` subclass) was refused ("float or None object expected; got numpy.float32") where the interpreted mode's
``as_float`` took it; ``SupportsFloat`` and ``as_float`` / ``as_bounded_float`` take any real number and refuse
bools in both. ``bool`` parameters stay ``bool``: mypyc refuses a non-bool with its own
``TypeError``, which README accepts as the one difference, and ``tests/test_bool_args.py`` checks that the
interpreted mode refuses the same values (``1``, ``numpy.True_``).

The rule holds where mypyc checks the call: a function or method of a compiled module, or the constructor of a
native (compiled) dataclass. A non-native dataclass's fields (the configs, ``KVCacheRequest``) reach its
generated ``__init__`` unchecked and are converted by ``coerce_fields``; the modules left interpreted
(``batching``) behave the same in both modes. ``EXEMPT`` lists what is not an argument-checked entry point.
"""

from __future__ import annotations

import ast

import pytest

from tests.public_parameters import Parameter, definition, public_parameters

pytestmark = pytest.mark.mode_independent  # reads the sources

RECORD = "a record the library fills in and hands out (built by its constructor when unpickled)"
EXEMPT: dict[str, str] = {
    **{name: RECORD for name in (
        "AggregatedPageDesc", "ExpandedBuffer", "BlockRemoved", "BlockStored", "EventBatch", "Gap", "GroupTransfer",
        "IterationStats", "KVCacheEvent", "KVCacheEventDiff", "KVCacheIterationStatsDelta", "KVCacheStatsDelta",
        "KVCacheStoredBlockData", "KVEvent", "LayerGroupSpec", "PoolGroupUsage", "ReceivedBatch", "Refusal",
        "Restart", "ReuseByTier", "SourceBlock", "SourcePlan", "SsmSnapshotIterationStatsDelta", "StorageStatistics",
        "TransferDescriptor", "TransferPlan", "UniqueToken",
    )},
    "LifeCycle": "the manager's rules for a layer group, handed to priority callbacks to read",
    "ColdPageCodec": "a Protocol the manager calls with its own layer group ids",
    "RemoteStoreConfig.open": "a Protocol the manager calls with the tier's checked quota",
    "MooncakeStoreConfig.open": "the manager calls it with the tier's checked quota",
    "MemoryStoreConfig.open": "the manager calls it with the tier's checked quota",
    "KVCacheEventManager": "hooks the manager calls with its own layer group ids",
    "NixlEndpoint.keep_peer": "KVSender and KVReceiver call it with the peer's hello",
    "NixlEndpoint.read": "KVReceiver calls it with its own deadline",
    "ReceivedKV": RECORD,
}
# What a kind of parameter must be annotated instead, where mypyc checks the call.
REPLACEMENTS = {"int": "SupportsIndex", "float": "SupportsFloat"}


def exempt(parameter: Parameter) -> bool:
    return parameter.owner in EXEMPT or parameter.owner.partition(".")[0] in EXEMPT


def unchecked_numbers(parameters: tuple[Parameter, ...]) -> list[str]:
    """Parameters annotated ``int`` or ``float`` (``| None`` too) where mypyc checks the call, not exempt."""
    return sorted(
        f"{parameter.module}: {parameter.label}"
        for parameter in parameters
        if parameter.kinds & REPLACEMENTS.keys() and parameter.compiled_boundary and not exempt(parameter)
    )


def test_number_parameters_are_supports_index_or_float_where_mypyc_checks_them() -> None:
    violations = unchecked_numbers(public_parameters())
    assert violations == [], (
        "annotate these SupportsIndex (SupportsFloat) and convert them with _base/validation's as_int (as_float) "
        f"or its kin before use: {violations}"
    )


def test_the_walk_sees_the_surface_an_engine_imports() -> None:
    """The walk reaches the subpackages (the rehearsal's two were in ``kv_events``), setters, classmethods and
    non-native dataclass fields, and tells where mypyc checks the call (a broken walk finding nothing would pass)."""
    found = {(parameter.owner, parameter.name): parameter for parameter in public_parameters()}
    assert found[("EventSubscriber", "last_seq")].kinds == {"SupportsIndex"}
    assert found[("EventSubscriber", "last_seq")].compiled_boundary
    assert found[("listen", "count")].kinds == {"SupportsIndex"}
    assert found[("listen", "timeout_s")].kinds == {"SupportsFloat"}
    assert found[("KVCache.capacity", "capacity")].compiled_boundary
    assert found[("KVCacheManager.create_kv_cache", "preempted")].kinds == {"bool"}
    assert found[("KVCacheManagerConfig", "tokens_per_block")].kinds == {"int"}
    assert not found[("KVCacheManagerConfig", "tokens_per_block")].compiled_boundary  # coerce_fields converts it
    assert not found[("BatchedRequest", "request_id")].compiled_boundary  # batching is not compiled
    assert found[("KVSlice", "prompt_len")].compiled_boundary
    assert len(found) > 250 and sum("int" in p.kinds and p.compiled_boundary for p in found.values()) > 100
    stale = [name for name in EXEMPT if not any(exempt(p) and p.owner.partition(".")[0] == name.partition(".")[0]
                                               for p in found.values())]
    assert stale == []


def test_the_rule_catches_the_rehearsal_defect() -> None:
    """``EventSubscriber(last_seq: int = -1)``, last session's defect, read from an edited copy of its source."""
    from kv_cache_manager_v2.kv_events.subscriber import EventSubscriber

    node = definition(EventSubscriber)
    assert isinstance(node, ast.ClassDef)
    init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
    argument = next(argument for argument in init.args.args if argument.arg == "last_seq")
    original = argument.annotation
    before = unchecked_numbers(public_parameters())
    try:
        argument.annotation = ast.Name("int")
        public_parameters.cache_clear()
        after = unchecked_numbers(public_parameters())
    finally:
        argument.annotation = original
        public_parameters.cache_clear()
    assert sorted(set(after) - set(before)) == ["kv_cache_manager_v2.kv_events.subscriber: EventSubscriber(last_seq: int)"]
