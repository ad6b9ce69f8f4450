"""kv_cache_manager_v2: a paged KV cache manager for LLM serving engines.

Typed face: ``__init__.pyi`` (checked by stubtest). ``COMPILED`` tells whether the mypyc-compiled modules are
the ones imported ("production" mode) or the plain Python sources ("fast" mode).
"""

from . import _manager
from ._addressing import PageIndexConverter, ScratchDesc
from ._aggregated_pages import AggregatedPageDesc, ExpandedBuffer
from ._batch import KVCacheRequest
from ._cache_handle import KVCache, _KVCache
from ._event_manager import FULL_ATTENTION as LAYER_GROUP_FULL_ATTENTION
from ._event_manager import SLIDING_WINDOW as LAYER_GROUP_SLIDING_WINDOW
from ._event_manager import SSM as LAYER_GROUP_SSM
from ._event_manager import (
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
from ._events import REMOVED as KV_EVENT_REMOVED
from ._events import STORED as KV_EVENT_STORED
from ._events import UPDATED as KV_EVENT_UPDATED
from ._events import IterationStats, KVEvent, KVEventKind
from ._hashing import (
    MultimodalDigest,
    ReuseScope,
    Token,
    TokenSequence,
    gen_multimodal_cache_key_tokens,
    sequence_to_blockchain_keys,
)
from ._invariants import InvariantError
from ._kv_cache import KVCacheStatus
from ._life_cycle import LifeCycle
from ._manager import KVCacheManager
from ._mooncake_store import MooncakeStoreConfig
from ._page_store import MovementCounters
from ._page_view import PageView
from ._planned_drop import PlannedDropHandle
from ._priority import PriorityCallback
from ._remote_store import RemoteStore, RemoteStoreConfig, RemoteStoreError
from ._remote_tier import RemoteTierStatistics
from ._ssm_snapshot_stats import SsmSnapshotIterationStatsDelta
from ._stats_delta import KVCacheIterationStatsDelta, KVCacheStatsDelta
from ._refusal import Refusal
from ._usage import PoolGroupUsage
from ._storage import StorageStatistics
from ._types import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    DEFAULT_PRIORITY,
    GPU_LEVEL,
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
    PageIndexMode,
    Priority,
    TokenId,
)
from .config import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)

COMPILED: bool = not (_manager.__file__ or "").endswith(".py")
