# Public typed surface of kv_cache_manager_v2, checked against the runtime by stubtest.
from typing import Final

from ._model.addressing import PageIndexConverter as PageIndexConverter, ScratchDesc as ScratchDesc
from ._model.aggregated_pages import AggregatedPageDesc as AggregatedPageDesc, ExpandedBuffer as ExpandedBuffer
from ._cache.batch import KVCacheRequest as KVCacheRequest
from ._manager.manager import KVCache as KVCache, _KVCache as _KVCache
from ._observe.event_manager import (
    KVCacheCreatedData as KVCacheCreatedData,
    KVCacheEvent as KVCacheEvent,
    KVCacheEventDiff as KVCacheEventDiff,
    KVCacheEventManager as KVCacheEventManager,
    KVCacheRemovedData as KVCacheRemovedData,
    KVCacheStoredBlockData as KVCacheStoredBlockData,
    KVCacheStoredData as KVCacheStoredData,
    KVCacheUpdatedData as KVCacheUpdatedData,
    LayerGroupKind as LayerGroupKind,
    UniqueToken as UniqueToken,
)
from ._observe.events import IterationStats as IterationStats, KVEvent as KVEvent, KVEventKind as KVEventKind
from ._base.hashing import (
    MultimodalDigest as MultimodalDigest,
    ReuseScope as ReuseScope,
    Token as Token,
    TokenIdExt as TokenIdExt,
    TokenSequence as TokenSequence,
    gen_multimodal_cache_key_tokens as gen_multimodal_cache_key_tokens,
    sequence_to_blockchain_keys as sequence_to_blockchain_keys,
)
from ._cache.invariants import InvariantError as InvariantError
from ._cache.cache_view import KVCacheCommitState as KVCacheCommitState
from ._cache.handle import CacheHold as CacheHold
from ._cache.kv_cache import KVCacheStatus as KVCacheStatus
from ._model.life_cycle import LifeCycle as LifeCycle
from ._manager.manager import KVCacheManager as KVCacheManager
from ._remote.mooncake import MooncakeStoreConfig as MooncakeStoreConfig
from ._pages.movement_counters import MovementCounters as MovementCounters
from ._base.page_view import PageView as PageView
from ._manager.planned_drop import PlannedDropHandle as PlannedDropHandle
from ._pages.priority import PriorityCallback as PriorityCallback
from ._base.remote_store import (
    RemoteStore as RemoteStore,
    RemoteStoreConfig as RemoteStoreConfig,
    RemoteStoreError as RemoteStoreError,
)
from ._remote.statistics import RemoteTierStatistics as RemoteTierStatistics
from ._storage.page_codec import ColdPageCodec as ColdPageCodec
from ._observe.ssm_snapshot_stats import SsmSnapshotIterationStatsDelta as SsmSnapshotIterationStatsDelta
from ._observe.stats_delta import (
    KVCacheIterationStatsDelta as KVCacheIterationStatsDelta,
    KVCacheStatsDelta as KVCacheStatsDelta,
)
from ._cache.refusal import Refusal as Refusal
from ._pages.usage import PoolGroupUsage as PoolGroupUsage
from ._pages.reuse_split import ReuseByTier as ReuseByTier
from ._storage.slots import StorageStatistics as StorageStatistics
from ._base.types import (
    BAD_PAGE_INDEX as BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX as DEFAULT_BEAM_INDEX,
    DEFAULT_PRIORITY as DEFAULT_PRIORITY,
    GPU_LEVEL as GPU_LEVEL,
    NDEBUG as NDEBUG,
    BeamIndex as BeamIndex,
    BufferId as BufferId,
    CacheLevel as CacheLevel,
    CacheTier as CacheTier,
    CudaStream as CudaStream,
    DataRole as DataRole,
    HalfOpenRange as HalfOpenRange,
    LayerGroupId as LayerGroupId,
    LayerId as LayerId,
    MemAddress as MemAddress,
    OutOfMemoryError as OutOfMemoryError,
    OutOfPagesError as OutOfPagesError,
    PageContentLostError as PageContentLostError,
    PageIndexMode as PageIndexMode,
    Priority as Priority,
    SlidingWindowSize as SlidingWindowSize,
    TokenId as TokenId,
)
from .config import (
    AttentionLayerConfig as AttentionLayerConfig,
    BatchDesc as BatchDesc,
    BufferConfig as BufferConfig,
    CacheTierConfig as CacheTierConfig,
    DiskCacheTierConfig as DiskCacheTierConfig,
    GpuCacheTierConfig as GpuCacheTierConfig,
    HostCacheTierConfig as HostCacheTierConfig,
    KVCacheDesc as KVCacheDesc,
    KVCacheManagerConfig as KVCacheManagerConfig,
    LayerConfig as LayerConfig,
    RemoteCacheTierConfig as RemoteCacheTierConfig,
    SsmLayerConfig as SsmLayerConfig,
    SwaScratchReuseConfig as SwaScratchReuseConfig,
)

COMPILED: bool
# KVEvent.kind's values (``_observe.events.STORED`` / ``REMOVED`` / ``UPDATED`` at run time).
KV_EVENT_STORED: Final = "stored"
KV_EVENT_REMOVED: Final = "removed"
KV_EVENT_UPDATED: Final = "updated"
# KVCacheEvent.layer_group_kind's values (``_observe.event_manager.FULL_ATTENTION`` / ... at run time).
LAYER_GROUP_FULL_ATTENTION: Final = "full_attention"
LAYER_GROUP_SLIDING_WINDOW: Final = "sliding_window"
LAYER_GROUP_SSM: Final = "ssm"
