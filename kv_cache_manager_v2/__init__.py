"""kv_cache_manager_v2: a paged KV cache manager for LLM serving engines.

Typed face: ``__init__.pyi`` (checked by stubtest). ``COMPILED`` tells whether the mypyc-compiled modules are
the ones imported ("production" mode) or the plain Python sources ("fast" mode).
"""

from . import _manager
from ._addressing import PageIndexConverter, ScratchDesc
from ._batch import KVCacheRequest
from ._events import IterationStats, KVEvent
from ._hashing import ReuseScope, Token, TokenSequence, gen_multimodal_cache_key_tokens
from ._invariants import InvariantError
from ._kv_cache import KVCache, KVCacheStatus, _KVCache
from ._manager import KVCacheManager
from ._mooncake_store import MooncakeStoreConfig
from ._page_store import MovementCounters
from ._remote_store import RemoteStore, RemoteStoreConfig, RemoteStoreError
from ._remote_tier import RemoteTierStatistics
from ._storage import StorageStatistics
from ._types import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    DEFAULT_PRIORITY,
    GPU_LEVEL,
    BeamIndex,
    CacheLevel,
    CacheTier,
    CudaStream,
    HalfOpenRange,
    LayerGroupId,
    LayerId,
    MemAddress,
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
