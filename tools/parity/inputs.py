"""The ``inputs`` and ``subclasses`` scenarios of ``tools/mode_parity.py``: arguments of the kinds a user hands in
besides the plain ones, where compiled code could check types differently (mypyc checks a class with no subclass
in the package by exact type): subclasses of ``int``/``str``/``bytes``/``list``, NumPy arrays and ranges as
tokens, IntEnum members as ints; and user subclasses of every exported class (refused in both modes, or taken)."""

from __future__ import annotations

import enum

import numpy as np

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    BufferId,
    DataRole,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    LayerId,
    ReuseScope,
    SwaScratchReuseConfig,
)
from tools.parity.scenarios import Recorder, Transcript


class Index(int):
    """A user's int subclass."""


class Role(str):
    """A user's str subclass."""


class Digest(bytes):
    """A user's bytes subclass."""


class Tokens(list[int]):
    """A user's list subclass."""


class Level(enum.IntEnum):
    GPU = 0
    HOST = 1


class MyEvents(KVCacheEventManager):
    """The documented subclass hook (``allow_interpreted_subclasses``)."""


# Public classes a user constructs: each must refuse a subclass where it is defined, in both modes
# (``tests/test_final_classes.py``); a ReuseScope subclass is the documented difference, not tried here.
FINAL_CLASSES: tuple[type, ...] = (
    BufferConfig, AttentionLayerConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManagerConfig, KVCacheDesc,
    BatchDesc, SwaScratchReuseConfig, KVCacheRequest,
)


def config() -> KVCacheManagerConfig:
    kv = [BufferConfig("key", 512), BufferConfig("value", 512)]
    return KVCacheManagerConfig(
        16,
        layers=[AttentionLayerConfig(0, kv, sliding_window_size=48), AttentionLayerConfig(1, kv)],
        cache_tiers=[GpuCacheTierConfig(1 << 20), HostCacheTierConfig(1 << 20)],
        backend="cpu",
        typical_step=BatchDesc([KVCacheDesc(128, 96)] * 2),
        swa_scratch_reuse=SwaScratchReuseConfig(8),
        enable_kv_events=True,
    )


def serve(record: Recorder, manager: KVCacheManager, label: str, tokens: object) -> None:
    """Create a cache from ``tokens`` (of a kind of sequence), compute it with odd ints, commit, close."""
    cache = record(f"create tokens {label}", lambda: manager.create_kv_cache(None, tokens))  # type: ignore[arg-type]
    if not isinstance(cache, KVCache):
        return
    prompt = [int(token) for token in tokens]  # type: ignore[attr-defined]
    record("resume", cache.resume)
    record("resize with an int subclass", lambda: cache.resize(Index(len(prompt))))
    record("history with an IntEnum", lambda: setattr(cache, "history_length", max(Level.HOST, cache.history_length)))
    record("commit", lambda: cache.commit(prompt[cache.num_committed_tokens :]))
    record("close", cache.close)


def inputs() -> Transcript:
    transcript: Transcript = []
    record = Recorder(transcript)
    for final in FINAL_CLASSES:
        record(f"subclass {final.__name__}", lambda: type("Mine", (final,), {}))
    manager = KVCacheManager(config(), event_manager=MyEvents(100))
    prompt = list(range(1000, 1100))
    token_kinds: list[tuple[str, object]] = [
        ("list", prompt), ("list subclass", Tokens(prompt)), ("tuple", tuple(prompt)), ("range", range(1000, 1100)),
        ("int64 array", np.array(prompt, np.int64)), ("int32 array", np.array(prompt, np.int32)),
        ("int subclass items", [Index(t) for t in prompt]), ("uint64 items", [np.uint64(t) for t in prompt]),
    ]
    for label, tokens in token_kinds:
        serve(record, manager, label, tokens)
    record("probe a list subclass", lambda: manager.probe_reuse(None, Tokens(prompt)))
    batch = record("batch", lambda: manager.create_kv_cache_batch([KVCacheRequest(prompt)]))
    for cache in batch if isinstance(batch, list) else []:
        record("close", cache.close)
    record("str subclass role", lambda: manager.get_page_stride(Index(0), Role("key")))
    record("IntEnum level", lambda: manager.get_storage_statistics(Level.HOST))
    record("IntEnum quota level", lambda: manager.get_quota(Level.HOST))
    record("bytes subclass digest", lambda: manager.gen_multimodal_cache_key_tokens(Digest(b"x" * 32), Index(2), Index(1 << 20)))
    record("str subclass buffer id", lambda: manager.get_aggregated_pages([BufferId(LayerId(Index(0)), DataRole(Role("key")))]))
    record("IntEnum can_fit", lambda: manager.can_fit(Level.HOST, Index(16)))
    record("events", manager.get_latest_events)
    record("shutdown", manager.shutdown)
    return transcript


def subclasses() -> Transcript:
    """Each exported class of the package, ``disagg``, ``kv_events`` and ``testing`` subclassed by a user class:
    whether the definition is taken, and what making one without arguments answers (a missing-argument error in
    both modes, or one refusal in both; not mypyc's "interpreted classes cannot inherit from compiled" in one)."""
    import inspect

    import kv_cache_manager_v2
    from kv_cache_manager_v2 import disagg, kv_events, testing

    transcript: Transcript = []
    record = Recorder(transcript)
    seen: set[type] = set()
    for module in (kv_cache_manager_v2, disagg, kv_events, testing):
        for name in sorted(dir(module)):
            cls = getattr(module, name)
            if not inspect.isclass(cls) or cls in seen or not str(cls.__module__).startswith("kv_cache_manager_v2"):
                continue
            seen.add(cls)
            if issubclass(cls, enum.Enum) or cls is ReuseScope:  # enums with members are final; ReuseScope: documented
                continue
            # Compared: whether the definition is taken, not the class's metaclass (a Protocol's differs: left in
            # the report of this check's first run).
            made: list[type] = []
            record(f"subclass {name}", lambda: made.append(type("Mine", (cls,), {"__module__": "user"})))
            if made:
                record(f"make a {name} subclass", made[0])
    return transcript
