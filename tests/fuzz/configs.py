"""The manager setups the fuzzer runs on (``CONFIGS``): full attention, sliding windows with sinks, mixed head
sizes, tiers down to disk (with a layer of expansion 2), an SSM hybrid over a disk tier, SWA scratch reuse over a
disk tier, a host tier too small for one pool group, a remote tier over a flaky store (below the GPU tier, and
below the hybrid's host and disk tiers), and cold tiers behind a
cold-page codec that merges and splits pool groups. Beside
them, two worlds of the misuse twin only: a text-only manager (``TEXT_ONLY``) and a remote tier on a real Mooncake
store the test starts (``mooncake_config``)."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Final, Mapping

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    MooncakeStoreConfig,
    PageIndexMode,
    RemoteCacheTierConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from tests.fuzz.flaky_store import FlakyStoreConfig

KIB: Final = 1024


def _kv(size: int, value_size: int | None = None, tokens_per_block_override: int | None = None) -> list[BufferConfig]:
    return [
        BufferConfig("key", size, tokens_per_block_override),
        BufferConfig("value", size if value_size is None else value_size, tokens_per_block_override),
    ]


@dataclass(frozen=True)
class FuzzConfig:
    """One manager setup the fuzzer runs on. ``build`` gets a fresh scratch directory (for disk tiers)."""

    name: str
    build: Callable[[str], KVCacheManagerConfig]
    max_capacity: int
    needs_directory: bool = False
    # Every layer group is full attention: a live cache's committed blocks are always reusable (lower bound).
    full_attention_only: bool = False
    # SSM layers: history only moves by computing and committing (the FakeEngine checks the live state against
    # it), so raw resizes, partial commits and stop_committing are off; serve sometimes commits a chunk in two.
    ssm: bool = False
    # Whether a prefix computed in one chunk is reusable afterwards (not with SSM snapshots off the interval,
    # nor with scratch reuse, which never stores a chunk's out-of-window blocks).
    prefixes_reusable: bool = True
    # Encoded page bytes per layer group of a padding cold-page codec (None: no codec).
    cold_page_bytes: Mapping[int, int] | None = None
    # How the FakeEngine addresses pages (``get_page_view`` / the converter): SHARED in some setups, so the mode an
    # engine gets by default (the converter's ``index_mode=None``) is read after quota changes and tier moves too.
    index_mode: PageIndexMode = PageIndexMode.PER_LAYER


def _full(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [AttentionLayerConfig(0, _kv(512)), AttentionLayerConfig(1, _kv(512))]
    return KVCacheManagerConfig(16, cache_tiers=[GpuCacheTierConfig(28 * 4 * 512)], layers=layers, backend="cpu")


def _swa_sinks(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24),
        AttentionLayerConfig(3, _kv(512), sliding_window_size=64, num_sink_tokens=20),
    ]
    # ssm_reuse_interval 0 (no periodic SSM snapshots) is accepted without SSM layers and must change nothing; a
    # tenth of the GPU is kept for running caches to grow into (refusals by the watermark)
    return KVCacheManagerConfig(
        16,
        cache_tiers=[GpuCacheTierConfig(20 * 8 * 512)],
        layers=layers,
        backend="cpu",
        ssm_reuse_interval=0,
        admission_watermark=0.1,
    )


def _mixed_heads(_: str) -> KVCacheManagerConfig:
    """Two SWA layers (one with K and V of different sizes: two pools) and two full layers of another head size
    (one with expansion 2): two pool groups with different slot sizes."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=32),
        AttentionLayerConfig(1, _kv(512, 1024), sliding_window_size=32),
        AttentionLayerConfig(2, _kv(1024)),
        AttentionLayerConfig(3, _kv(512, tokens_per_block_override=8)),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(
        16, cache_tiers=[GpuCacheTierConfig(160 * KIB)], layers=layers, backend="cpu", typical_step=typical
    )


def _tiered(directory: str) -> KVCacheManagerConfig:
    """A full layer and a windowed one with expansion 2 (a block's page holds two 8-token pages, 512 bytes per
    block as in the full layer) over GPU, host and disk tiers."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512)),
        AttentionLayerConfig(1, _kv(256, tokens_per_block_override=8), sliding_window_size=48, num_sink_tokens=3),
    ]
    slot = 2 * 512
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(24 * slot, max_quota=48 * slot),
        HostCacheTierConfig(24 * slot),
        DiskCacheTierConfig(48 * slot, directory),
    ]
    # A resume locks at most 16 of the 24 GPU slots (33 once the quota grows to 48): a cache grown by resize to the
    # whole 192 tokens (12 blocks of the full layer and the window's) outgrows it, so suspended it is stranded
    # (every resume refused, fits_empty_manager=False, resumable_alone False) until the quota grows. Matches stop
    # 3 tokens short of what the tree holds, so partial matches end at other places than the prompts' cuts.
    return KVCacheManagerConfig(
        16, cache_tiers=tiers, layers=layers, backend="cpu", max_util_for_resume=0.7, reuse_match_backoff=3
    )


def _ssm_state() -> list[BufferConfig]:
    return [BufferConfig("ssm_state", 2048), BufferConfig("conv_state", 512)]


def _hybrid_ssm(directory: str) -> KVCacheManagerConfig:
    """Two SSM layers (snapshots every second block, and where a prefill chunk ends on a block boundary), a full
    and an SWA layer, a host tier for snapshots and a small disk tier below it, so snapshots and KV pages also go to
    disk and come back from it."""
    return _hybrid_ssm_config(directory, ssm_reuse_interval=32)


def _hybrid_ssm_partial(directory: str) -> KVCacheManagerConfig:
    """The hybrid model with partial reuse: snapshots at every commit's end (inside a block too, at the end of a
    prefill chunk or at close), so a reuse may end inside a block where a snapshot ends; over the disk tier too, so
    snapshots of partial blocks also go to disk and come back."""
    return _hybrid_ssm_config(directory, ssm_reuse_interval=32, enable_partial_reuse=True, commit_min_snapshot=True)


def _hybrid_ssm_config(directory: str | None, **snapshots: Any) -> KVCacheManagerConfig:
    """The hybrids' layers: the full one with values twice the size of its keys (two pools), the SWA one with a
    sink block."""
    layers: list[LayerConfig] = [
        SsmLayerConfig(0, _ssm_state()),
        AttentionLayerConfig(1, _kv(512, 1024)),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24, num_sink_tokens=3),
        SsmLayerConfig(3, _ssm_state()),
    ]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(128 * KIB), HostCacheTierConfig(48 * KIB)]
    if directory is not None:  # a smaller host, so that short runs fill it and reach the disk
        tiers[1:] = [HostCacheTierConfig(16 * KIB), DiskCacheTierConfig(48 * KIB, directory)]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(
        16, cache_tiers=tiers, layers=layers, backend="cpu", max_util_for_resume=1.0, typical_step=typical, **snapshots
    )


def _swa_scratch(directory: str) -> KVCacheManagerConfig:
    """SWA scratch reuse with windows of 20 and 37 (+3 sinks) tokens, not multiples of the 16-token block, over
    host and disk tiers; the last 8 tokens of a chunk keep real pages (the engine may rewind that far)."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=20),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=37, num_sink_tokens=3),
        AttentionLayerConfig(2, _kv(512)),
    ]
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(40 * KIB),
        HostCacheTierConfig(16 * KIB),
        DiskCacheTierConfig(32 * KIB, directory),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    scratch = SwaScratchReuseConfig(max_rewind_len=8)
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu", swa_scratch_reuse=scratch, typical_step=typical)


def _tiny_host(directory: str) -> KVCacheManagerConfig:
    """Two pool groups (1 and 2 KiB slots) over a host tier whose quota gives the first group no slot at all:
    pages of that group can only pass to the disk if the room estimate follows the tiers one at a time."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=40),
        AttentionLayerConfig(1, _kv(1024)),
    ]
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(48 * KIB, max_quota=96 * KIB),
        HostCacheTierConfig(3 * KIB),
        DiskCacheTierConfig(64 * KIB, directory),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu", typical_step=typical)


def _remote_fills() -> KVCacheManagerConfig:
    """A full and a windowed layer over 24 GPU slots and a written-through remote tier (no back-off, so a fault
    lasts one call) signing its objects with a secret (``twin_serves``' other deployment has none)."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512)),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=3),
    ]
    remote = RemoteCacheTierConfig(
        0, FlakyStoreConfig(), namespace="fuzz", retry_after_s=0.0, secret_key=bytes(range(32))
    )
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(24 * 2 * 512), remote]
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu")


def _remote_hybrid(directory: str) -> KVCacheManagerConfig:
    """The hybrid model (``_hybrid_ssm``'s layers and snapshots) over a small GPU tier, a host tier and a disk tier,
    below them a written-through remote tier over a flaky store, signed with a secret: its SSM snapshots, sink
    blocks and windows go through the store, and what it fetches lands in the disk tier (the coldest local one)."""
    remote = RemoteCacheTierConfig(
        0, FlakyStoreConfig(), namespace="fuzz-hybrid", retry_after_s=0.0, secret_key=bytes(range(32))
    )
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(128 * KIB), HostCacheTierConfig(16 * KIB), DiskCacheTierConfig(48 * KIB, directory), remote
    ]
    return dataclasses.replace(_hybrid_ssm_config(directory, ssm_reuse_interval=32), cache_tiers=tiers)


def _cold_codec(directory: str) -> KVCacheManagerConfig:
    """A full layer (2 KiB slots) and two SWA layers (1 KiB slots, one pool group on the GPU) over a second GPU
    tier and a disk tier that store pages padded (``COLD_PAGE_BYTES``): the full and the first SWA layer group
    share a cold pool group, the second SWA one has its own."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(1024)),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=3),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24),
    ]
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(40 * KIB, max_quota=80 * KIB),
        GpuCacheTierConfig(24 * KIB),
        DiskCacheTierConfig(64 * KIB, directory),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu", typical_step=typical)


# The configs whose remote tier is a ``FlakyStoreConfig`` (one in-process store: twins built from one would share it).
FLAKY_REMOTE: Final = ("remote_fills", "remote_hybrid")

COLD_PAGE_BYTES: Final = {0: 2 * KIB, 1: 2 * KIB, 2: 1536}


def _text_only(_: str) -> KVCacheManagerConfig:
    """A full and a windowed layer with ``text_only``: every cache refuses multimodal tokens by default."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512)),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=3),
    ]
    return KVCacheManagerConfig(
        16, cache_tiers=[GpuCacheTierConfig(32 * 2 * 512)], layers=layers, backend="cpu", text_only=True
    )


# Not in CONFIGS (the stateful fuzzer's worlds): the misuse twin's (tests/test_misuse_twin.py).
TEXT_ONLY: Final = FuzzConfig("text_only", _text_only, max_capacity=192)


def mooncake_config(master_address: str, metadata_url: str) -> FuzzConfig:
    """``remote_fills``' layers over a written-through remote tier on a real Mooncake store (started by the test).
    Each world built gets a namespace of its own, so two worlds (the twins) share the store but no object."""
    worlds = itertools.count()

    def build(_: str) -> KVCacheManagerConfig:
        backend = MooncakeStoreConfig(master_address, metadata_url)
        remote = RemoteCacheTierConfig(0, backend, namespace=f"twin-{next(worlds)}-{uuid.uuid4().hex}")
        return dataclasses.replace(_remote_fills(), cache_tiers=[GpuCacheTierConfig(24 * 2 * 512), remote])

    return FuzzConfig("mooncake", build, max_capacity=192)


CONFIGS: Final[list[FuzzConfig]] = [
    FuzzConfig("full", _full, max_capacity=256, full_attention_only=True),
    FuzzConfig("swa_sinks", _swa_sinks, max_capacity=256),
    FuzzConfig("mixed_heads", _mixed_heads, max_capacity=192, index_mode=PageIndexMode.SHARED),
    FuzzConfig("tiered", _tiered, max_capacity=192, needs_directory=True, index_mode=PageIndexMode.SHARED),
    FuzzConfig("hybrid_ssm", _hybrid_ssm, max_capacity=192, needs_directory=True, ssm=True, prefixes_reusable=False),
    FuzzConfig(
        "hybrid_ssm_partial", _hybrid_ssm_partial, max_capacity=192, needs_directory=True, ssm=True, prefixes_reusable=False
    ),
    FuzzConfig("swa_scratch", _swa_scratch, max_capacity=256, needs_directory=True, prefixes_reusable=False),
    FuzzConfig("tiny_host", _tiny_host, max_capacity=192, needs_directory=True),
    FuzzConfig("remote_fills", lambda _: _remote_fills(), max_capacity=192, index_mode=PageIndexMode.SHARED),
    FuzzConfig(
        "remote_hybrid", _remote_hybrid, max_capacity=192, needs_directory=True, ssm=True, prefixes_reusable=False
    ),
    FuzzConfig(
        "cold_codec",
        _cold_codec,
        max_capacity=192,
        needs_directory=True,
        cold_page_bytes=COLD_PAGE_BYTES,
        index_mode=PageIndexMode.SHARED,
    ),
]
