"""User-facing configuration: layers, buffers, cache tiers, batch shapes and the manager config.

Config classes are plain (non-native) dataclasses even in compiled mode: they run once at start-up, and being
non-native lets ``__post_init__`` accept NumPy integers and normalise them to ``int``. Every violated rule raises
``ValueError`` (or ``TypeError`` for a wrong type) naming the field and the value.

This module is the import path users know; each name lives in the module of its concept: ``layers``, ``tiers``,
``batches`` and ``manager_config`` (the config as a whole and the checks that need all of it).
"""

from .batches import BatchDesc as BatchDesc
from .batches import KVCacheDesc as KVCacheDesc
from .layers import AttentionLayerConfig as AttentionLayerConfig
from .layers import BufferConfig as BufferConfig
from .layers import LayerConfig as LayerConfig
from .layers import SsmLayerConfig as SsmLayerConfig
from .manager_config import BACKENDS as BACKENDS
from .manager_config import KVCacheManagerConfig as KVCacheManagerConfig
from .manager_config import SwaScratchReuseConfig as SwaScratchReuseConfig
from .tiers import CacheTierConfig as CacheTierConfig
from .tiers import DiskCacheTierConfig as DiskCacheTierConfig
from .tiers import GpuCacheTierConfig as GpuCacheTierConfig
from .tiers import HostCacheTierConfig as HostCacheTierConfig
from .tiers import LocalCacheTierConfig as LocalCacheTierConfig
from .tiers import RemoteCacheTierConfig as RemoteCacheTierConfig
