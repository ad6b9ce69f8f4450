"""kv_cache_manager_v2: a paged KV cache manager for LLM serving engines.

Typed face: ``__init__.pyi`` (checked by stubtest). ``COMPILED`` tells whether the mypyc-compiled modules are
the ones imported ("production" mode) or the plain Python sources ("fast" mode).
"""

from ._base.startup import interrupted_while_starting as _interrupted_while_starting
from ._base.startup import started_as_command as _started_as_command
from ._base.startup import terminate_as_interrupt as _terminate_as_interrupt

# Ctrl-C (or SIGTERM) while the command line imports the package: one line and status 130 (``_base/startup.py``).
if _started_as_command():
    _terminate_as_interrupt()
try:
    from ._manager import manager as _manager_module
    from ._model.addressing import PageIndexConverter, ScratchDesc
    from ._model.aggregated_pages import AggregatedPageDesc, ExpandedBuffer
    from ._cache.batch import KVCacheRequest
    from ._manager.manager import KVCache, _KVCache
    from ._observe.event_manager import FULL_ATTENTION as LAYER_GROUP_FULL_ATTENTION
    from ._observe.event_manager import SLIDING_WINDOW as LAYER_GROUP_SLIDING_WINDOW
    from ._observe.event_manager import SSM as LAYER_GROUP_SSM
    from ._observe.event_manager import (
        KVCacheCreatedData,
        KVCacheEvent,
        KVCacheEventDiff,
        KVCacheEventManager,
        KVCacheRemovedData,
        KVCacheStoredBlockData,
        KVCacheStoredData,
        KVCacheUpdatedData,
        LayerGroupKind,
        UniqueToken,
    )
    from ._observe.events import REMOVED as KV_EVENT_REMOVED
    from ._observe.events import STORED as KV_EVENT_STORED
    from ._observe.events import UPDATED as KV_EVENT_UPDATED
    from ._observe.events import IterationStats, KVEvent, KVEventKind
    from ._base.hashing import (
        MultimodalDigest,
        ReuseScope,
        Token,
        TokenIdExt,
        TokenSequence,
        gen_multimodal_cache_key_tokens,
        sequence_to_blockchain_keys,
    )
    from ._cache.invariants import InvariantError
    from ._cache.cache_view import KVCacheCommitState
    from ._cache.handle import CacheHold
    from ._cache.kv_cache import KVCacheStatus
    from ._model.life_cycle import LifeCycle
    from ._manager.manager import KVCacheManager
    from ._remote.mooncake import MooncakeStoreConfig
    from ._pages.movement_counters import MovementCounters
    from ._base.page_view import PageView
    from ._manager.planned_drop import PlannedDropHandle
    from ._pages.priority import PriorityCallback
    from ._base.remote_store import RemoteStore, RemoteStoreConfig, RemoteStoreError
    from ._remote.statistics import RemoteTierStatistics
    from ._observe.ssm_snapshot_stats import SsmSnapshotIterationStatsDelta
    from ._observe.stats_delta import KVCacheIterationStatsDelta, KVCacheStatsDelta
    from ._cache.refusal import Refusal
    from ._pages.usage import PoolGroupUsage
    from ._pages.reuse_split import ReuseByTier
    from ._storage.slots import StorageStatistics
    from ._storage.page_codec import ColdPageCodec
    from ._base.types import (
        BAD_PAGE_INDEX,
        DEFAULT_BEAM_INDEX,
        DEFAULT_PRIORITY,
        GPU_LEVEL,
        NDEBUG,
        BeamIndex,
        BufferId,
        CacheLevel,
        CacheTier,
        CudaStream,
        DataRole,
        HalfOpenRange,
        LayerGroupId,
        LayerId,
        MemAddress,
        OutOfMemoryError,
        OutOfPagesError,
        PageContentLostError,
        PageIndexMode,
        Priority,
        SlidingWindowSize,
        TokenId,
    )
    from .config import (
        AttentionLayerConfig,
        BatchDesc,
        BufferConfig,
        CacheTierConfig,
        DiskCacheTierConfig,
        GpuCacheTierConfig,
        HostCacheTierConfig,
        KVCacheDesc,
        KVCacheManagerConfig,
        LayerConfig,
        RemoteCacheTierConfig,
        SsmLayerConfig,
        SwaScratchReuseConfig,
    )
except KeyboardInterrupt:
    if _started_as_command():
        _interrupted_while_starting()
    raise

COMPILED: bool = not (_manager_module.__file__ or "").endswith(".py")
