"""User-facing configuration: layers, buffers, cache tiers and the manager config.

Config classes are plain (non-native) dataclasses even in compiled mode: they run once at start-up, and being
non-native lets ``__post_init__`` accept NumPy integers and normalise them to ``int``. Every
violated rule raises ``ValueError`` (or ``TypeError`` for a wrong type) naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final, Sequence

from mypy_extensions import mypyc_attr

from ._base.remote_store import RemoteStoreConfig
from ._base.types import CacheTier
from ._base.validation import as_float, coerce_fields

BACKENDS: Final = ("auto", "cuda", "cpu")


@mypyc_attr(native_class=False)
@dataclass
class BufferConfig:
    """One buffer of a layer: ``size`` bytes per block (``tokens_per_block`` tokens), or per state for SSM.

    With ``tokens_per_block_override`` the buffer is paged in pages of that many tokens and ``size`` is the bytes
    of one such page (as in TensorRT-LLM): a block then holds ``tokens_per_block / override`` of them."""

    role: str
    size: int
    tokens_per_block_override: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("size",), optional_ints=("tokens_per_block_override",), strs=("role",))
        if not self.role:
            raise ValueError("BufferConfig.role must be a non-empty string")
        if self.size <= 0:
            raise ValueError(f"BufferConfig.size must be > 0, got {self.size} for role {self.role!r}")
        override = self.tokens_per_block_override
        if override is not None and override <= 0:
            raise ValueError(f"BufferConfig.tokens_per_block_override must be > 0, got {override}")


def _check_buffers(layer_id: int, buffers: Sequence[BufferConfig], kind: str) -> tuple[BufferConfig, ...]:
    result = tuple(buffers)
    if not result:
        raise ValueError(f"{kind}.buffers of layer {layer_id} must not be empty")
    roles: set[str] = set()
    for buffer in result:
        if not isinstance(buffer, BufferConfig):
            raise TypeError(f"{kind}.buffers of layer {layer_id} must hold BufferConfig, got {buffer!r}")
        if buffer.role in roles:
            raise ValueError(f"{kind}.buffers of layer {layer_id}: duplicate role {buffer.role!r}")
        roles.add(buffer.role)
    return result


@mypyc_attr(native_class=False)
@dataclass
class AttentionLayerConfig:
    """An attention layer; ``sliding_window_size=None`` means full attention. Sink tokens need a window."""

    layer_id: int
    buffers: Sequence[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    @property
    def window_size(self) -> int | None:
        """``sliding_window_size`` (TensorRT-LLM's name for it)."""
        return self.sliding_window_size

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("layer_id",), optional_ints=("sliding_window_size", "num_sink_tokens"))
        self.buffers = _check_buffers(self.layer_id, self.buffers, "AttentionLayerConfig")
        window = self.sliding_window_size
        if window is not None and window <= 0:
            raise ValueError(f"AttentionLayerConfig.sliding_window_size must be > 0, got {window}")
        sinks = self.num_sink_tokens
        if sinks is not None:
            if sinks < 0:
                raise ValueError(f"AttentionLayerConfig.num_sink_tokens must be >= 0, got {sinks}")
            if sinks > 0 and window is None:
                raise ValueError(
                    f"AttentionLayerConfig.num_sink_tokens={sinks} of layer {self.layer_id} requires a "
                    "sliding_window_size"
                )


@mypyc_attr(native_class=False)
@dataclass
class SsmLayerConfig:
    """A Mamba/SSM layer; each buffer's ``size`` is the bytes of one state (e.g. roles ssm_state, conv_state)."""

    layer_id: int
    buffers: Sequence[BufferConfig]

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("layer_id",))
        self.buffers = _check_buffers(self.layer_id, self.buffers, "SsmLayerConfig")
        for buffer in self.buffers:
            if buffer.tokens_per_block_override is not None:
                raise ValueError(
                    f"SsmLayerConfig layer {self.layer_id} buffer {buffer.role!r}: tokens_per_block_override "
                    "is not allowed on SSM buffers"
                )


LayerConfig = AttentionLayerConfig | SsmLayerConfig


def _check_quota(kind: str, quota: int, max_quota: int | None) -> None:
    if quota < 0:
        raise ValueError(f"{kind}.quota must be >= 0, got {quota}")
    if max_quota is not None and max_quota < quota:
        raise ValueError(f"{kind}.max_quota must be >= quota {quota}, got {max_quota}")


@mypyc_attr(native_class=False)
@dataclass
class GpuCacheTierConfig:
    """GPU memory tier (the "GPU" lives in host memory on the cpu backend). Quotas are bytes."""

    quota: int
    max_quota: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",))
        _check_quota("GpuCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.GPU_MEM``."""
        return CacheTier.GPU_MEM


@mypyc_attr(native_class=False)
@dataclass
class HostCacheTierConfig:
    """Host memory tier (pinned on the cuda backend)."""

    quota: int
    max_quota: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",))
        _check_quota("HostCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.HOST_MEM``."""
        return CacheTier.HOST_MEM


@mypyc_attr(native_class=False)
@dataclass
class DiskCacheTierConfig:
    """Disk tier: one file per pool inside the existing directory ``path``."""

    quota: int
    path: str
    max_quota: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",), strs=("path",))
        _check_quota("DiskCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.DISK``."""
        return CacheTier.DISK


@mypyc_attr(native_class=False)
@dataclass
class RemoteCacheTierConfig:
    """A store shared by many instances (Mooncake Store, see ``MooncakeStoreConfig``), colder than every local tier.

    Only the last entry of ``cache_tiers`` may be remote. ``quota``: bytes of this process's memory lent to the
    store (0: none, the store lives on other clients). ``backend``: connects at construction (``open(quota)``).
    ``namespace``: what the layout cannot tell apart, at least the model and its KV dtype (objects are keyed by
    content plus a digest of tokens per block, buffer sizes and this namespace). ``write_through``: store each block
    when it is committed, so other instances can reuse it at once; False stores pages only as the coldest local
    tier drops them. ``retry_after_s``: after a failure the tier answers every lookup with a miss for this long.
    ``tensor_parallel_rank``: this instance's rank in its tensor-parallel group; ranks hold different heads in pages
    of the same shape, so the rank is part of every key (put the group's size in ``namespace``).
    """

    quota: int
    backend: RemoteStoreConfig
    namespace: str = ""
    write_through: bool = True
    retry_after_s: float = 5.0
    tensor_parallel_rank: int = 0

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota", "tensor_parallel_rank"), strs=("namespace",), bools=("write_through",))
        if self.quota < 0:
            raise ValueError(f"RemoteCacheTierConfig.quota must be >= 0, got {self.quota}")
        if self.tensor_parallel_rank < 0:
            raise ValueError(f"RemoteCacheTierConfig.tensor_parallel_rank must be >= 0, got {self.tensor_parallel_rank}")
        if not callable(getattr(self.backend, "open", None)):
            raise TypeError(f"RemoteCacheTierConfig.backend must have an open(quota) method, got {self.backend!r}")
        retry = as_float(self.__dict__["retry_after_s"], "RemoteCacheTierConfig.retry_after_s")
        if retry < 0.0:
            raise ValueError(f"RemoteCacheTierConfig.retry_after_s must be a finite float >= 0, got {retry!r}")
        self.retry_after_s = retry


LocalCacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig
CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig | RemoteCacheTierConfig


@mypyc_attr(native_class=False)
@dataclass
class KVCacheDesc:
    """Shape of one cache for planning: ``capacity`` tokens of which ``history_length`` are history."""

    capacity: int
    history_length: int

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("capacity", "history_length"))
        if self.capacity < 0:
            raise ValueError(f"KVCacheDesc.capacity must be >= 0, got {self.capacity}")
        if not 0 <= self.history_length <= self.capacity:
            raise ValueError(
                f"KVCacheDesc.history_length {self.history_length} must be in [0, capacity {self.capacity}]"
            )


@mypyc_attr(native_class=False)
@dataclass
class BatchDesc:
    """A step's worth of caches; the first ``system_prompt_length`` tokens are shared by all of them."""

    kv_caches: Sequence[KVCacheDesc]
    system_prompt_length: int = 0

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("system_prompt_length",))
        self.kv_caches = tuple(self.kv_caches)
        if self.system_prompt_length < 0:
            raise ValueError(f"BatchDesc.system_prompt_length must be >= 0, got {self.system_prompt_length}")
        for desc in self.kv_caches:
            if not isinstance(desc, KVCacheDesc):
                raise TypeError(f"BatchDesc.kv_caches must hold KVCacheDesc, got {desc!r}")


@mypyc_attr(native_class=False)
@dataclass
class SwaScratchReuseConfig:
    """Sliding-window prefill scratch reuse: during a prefill chunk, blocks already out of the window when the
    chunk ends share a few scratch slots instead of taking a page each. The next chunk may start up to
    ``max_rewind_len`` tokens before this one's end, so blocks that close to the end keep real pages."""

    max_rewind_len: int = 0

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("max_rewind_len",))
        if self.max_rewind_len < 0:
            raise ValueError(f"SwaScratchReuseConfig.max_rewind_len must be >= 0, got {self.max_rewind_len}")


@mypyc_attr(native_class=False)
@dataclass
class KVCacheManagerConfig:
    """Everything a ``KVCacheManager`` is built from; validated as a whole at construction.

    - ``tokens_per_block``: tokens per block, the unit of paging and of prefix reuse.
    - ``layers``: one ``AttentionLayerConfig`` or ``SsmLayerConfig`` per layer (distinct ``layer_id``).
    - ``cache_tiers``: the GPU tier first, then optionally host memory and disk, each with its byte quota, and last
      maybe a ``RemoteCacheTierConfig`` (a store shared with other instances).
    - ``vocab_size``: the model's vocabulary size, if known; multimodal stand-in token ids start there
      (``KVCacheManager.gen_multimodal_cache_key_tokens``) so they never collide with text tokens.
    - ``backend``: ``"cuda"``, ``"cpu"`` (NumPy memory, no GPU needed) or ``"auto"`` (cuda when CuPy sees a device).
    - ``enable_partial_reuse``: reuse a matching prefix of a block (copying it); None means on unless the model has
      SSM layers.
    - ``enable_swa_scratch_reuse`` / ``swa_scratch_reuse``: see ``SwaScratchReuseConfig``.
    - ``ssm_reuse_interval``: SSM states are snapshotted where a commit ends a computed chunk on a multiple of this
      many tokens; with SSM layers, prefix reuse can resume only from such a snapshot.
    - ``constraints``: batches that must always fit in the GPU tier at once; each pool group gets at least the
      slots the largest of them needs (construction fails if the quota cannot hold them).
    - ``typical_step``: the batch the GPU and other tiers are first split for across pool groups (default: 8
      caches of 4,096 tokens); ``need_adjustment``/``adjust`` later re-split for the requests really seen.
    - ``max_util_for_resume``: ``resume`` refuses (returns False) when a GPU pool group is fuller than this.
    - ``enable_kv_events`` / ``max_kv_events``: record block stored/removed events for KV-aware routers, keeping
      the newest ``max_kv_events`` until ``get_latest_events`` takes them.
    - ``commit_min_snapshot`` / ``mamba_save_last_snapshot`` (the two TensorRT-LLM names of one behaviour): SSM
      states are also snapshotted where each commit ends on a block boundary; with either set,
      ``ssm_reuse_interval=0`` turns the periodic snapshots off.
    - ``reuse_match_backoff``: tokens trimmed off the end of every prefix match (for state that reads that many
      tokens ahead of a position).
    - ``initial_pool_ratio``: one positive weight per layer group; each tier is first split across pool groups in
      these byte proportions instead of by ``typical_step``.
    - ``enable_stats``: collect iteration statistics (``get_and_reset_iteration_stats``); off, they stay empty.
    - ``text_only``: the default of ``create_kv_cache(text_only=...)``: a hint that requests carry no multimodal
      tokens (accepted for TensorRT-LLM compatibility; it changes no behaviour here).

    Positional order follows TensorRT-LLM's seed-era config: ``(tokens_per_block, vocab_size, cache_tiers, layers,
    ...)``; ``cache_tiers`` and ``layers`` are required (an empty one is a ``ValueError``).
    """

    tokens_per_block: int
    vocab_size: int | None = None
    cache_tiers: Sequence[CacheTierConfig] = ()
    layers: Sequence[LayerConfig] = ()
    max_util_for_resume: float = 0.97
    enable_partial_reuse: bool | None = None
    constraints: Sequence[BatchDesc] = field(default_factory=tuple)
    typical_step: BatchDesc | None = None
    ssm_reuse_interval: int = 512
    mamba_save_last_snapshot: bool = False
    swa_scratch_reuse: SwaScratchReuseConfig | None = None
    enable_stats: bool = True
    reuse_match_backoff: int = 0
    initial_pool_ratio: Sequence[float] | None = None
    commit_min_snapshot: bool = False
    text_only: bool = False
    enable_swa_scratch_reuse: bool = False
    backend: str = "auto"
    enable_kv_events: bool = False
    max_kv_events: int = 10_000

    def __post_init__(self) -> None:
        coerce_fields(
            self,
            ints=("tokens_per_block", "ssm_reuse_interval", "max_kv_events", "reuse_match_backoff"),
            optional_ints=("vocab_size",),
            strs=("backend",),
            bools=(
                "enable_swa_scratch_reuse",
                "enable_kv_events",
                "mamba_save_last_snapshot",
                "commit_min_snapshot",
                "enable_stats",
                "text_only",
            ),
        )
        if self.max_kv_events <= 0:
            raise ValueError(f"KVCacheManagerConfig.max_kv_events must be > 0, got {self.max_kv_events}")
        if self.reuse_match_backoff < 0:
            raise ValueError(f"KVCacheManagerConfig.reuse_match_backoff must be >= 0, got {self.reuse_match_backoff}")
        if self.__dict__["enable_partial_reuse"] is not None:
            coerce_fields(self, bools=("enable_partial_reuse",))
        self.layers = tuple(self.layers)
        self.cache_tiers = tuple(self.cache_tiers)
        self.constraints = tuple(self.constraints)
        self._check_basics()
        self._check_layers()
        self._check_tiers()
        self._check_reuse_options()
        self._check_pool_ratio()

    def validated(self) -> KVCacheManagerConfig:
        """A checked copy of this config and of every config it holds, so that fields changed after
        construction are checked too (the manager builds from this copy: later changes cannot reach it)."""
        scratch: object = self.swa_scratch_reuse
        changes: dict[str, Any] = {  # re-checked by __post_init__, whatever a caller stored there
            "layers": [_revalidated_layer(layer) for layer in self.layers],
            "cache_tiers": [_revalidated_tier(tier) for tier in self.cache_tiers],
            "constraints": [_revalidated_batch(batch) for batch in self.constraints],
            "typical_step": None if self.typical_step is None else _revalidated_batch(self.typical_step),
            "swa_scratch_reuse": replace(scratch) if isinstance(scratch, SwaScratchReuseConfig) else scratch,
            "initial_pool_ratio": None if self.initial_pool_ratio is None else list(self.initial_pool_ratio),
        }
        return replace(self, **changes)

    @property
    def last_snapshot(self) -> bool:
        """``commit_min_snapshot`` or ``mamba_save_last_snapshot``: SSM states are also snapshotted where each
        commit ends (on a block boundary), so the end of a prompt is reusable whatever its length."""
        return self.commit_min_snapshot or self.mamba_save_last_snapshot

    @property
    def has_ssm_layers(self) -> bool:
        """Whether any layer is an SSM layer."""
        return any(isinstance(layer, SsmLayerConfig) for layer in self.layers)

    @property
    def local_tiers(self) -> list[LocalCacheTierConfig]:
        """``cache_tiers`` held in this process's memory or disk: all but a remote last tier."""
        return [tier for tier in self.cache_tiers if not isinstance(tier, RemoteCacheTierConfig)]

    @property
    def remote_tier(self) -> RemoteCacheTierConfig | None:
        """The shared remote tier, if ``cache_tiers`` ends with one."""
        last = self.cache_tiers[-1]
        return last if isinstance(last, RemoteCacheTierConfig) else None

    @property
    def partial_reuse_enabled(self) -> bool:
        """``enable_partial_reuse`` resolved: None means on without SSM layers and off with them."""
        if self.enable_partial_reuse is None:
            return not self.has_ssm_layers
        return self.enable_partial_reuse

    @property
    def max_rewind_len(self) -> int:
        """``swa_scratch_reuse.max_rewind_len``, 0 without it."""
        return 0 if self.swa_scratch_reuse is None else self.swa_scratch_reuse.max_rewind_len

    def _check_basics(self) -> None:
        tpb = self.tokens_per_block
        if tpb <= 0:
            raise ValueError(f"KVCacheManagerConfig.tokens_per_block must be > 0, got {tpb}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"KVCacheManagerConfig.vocab_size must be > 0, got {self.vocab_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"KVCacheManagerConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        util = as_float(self.__dict__["max_util_for_resume"], "KVCacheManagerConfig.max_util_for_resume")
        if not 0.0 < util <= 1.0:
            raise ValueError(f"KVCacheManagerConfig.max_util_for_resume must be in (0, 1], got {util}")
        self.max_util_for_resume = util
        for desc in self.constraints:
            if not isinstance(desc, BatchDesc):
                raise TypeError(f"KVCacheManagerConfig.constraints must hold BatchDesc, got {desc!r}")
        if self.typical_step is not None and not isinstance(self.typical_step, BatchDesc):
            raise TypeError(f"KVCacheManagerConfig.typical_step must be a BatchDesc, got {self.typical_step!r}")

    def _check_layers(self) -> None:
        if not self.layers:
            raise ValueError("KVCacheManagerConfig.layers must not be empty")
        tpb = self.tokens_per_block
        seen: set[int] = set()
        for layer in self.layers:
            if not isinstance(layer, (AttentionLayerConfig, SsmLayerConfig)):
                raise TypeError(f"KVCacheManagerConfig.layers must hold layer configs, got {layer!r}")
            if layer.layer_id in seen:
                raise ValueError(f"KVCacheManagerConfig.layers: duplicate layer_id {layer.layer_id}")
            seen.add(layer.layer_id)
            for buffer in layer.buffers:
                override = buffer.tokens_per_block_override
                if override is None:
                    continue
                if override > tpb or tpb % override != 0:
                    raise ValueError(
                        f"tokens_per_block_override {override} of layer {layer.layer_id} role {buffer.role!r} "
                        f"must divide tokens_per_block {tpb}"
                    )

    def _check_tiers(self) -> None:
        tiers = self.cache_tiers
        if not tiers:
            raise ValueError("KVCacheManagerConfig.cache_tiers must not be empty")
        for level, tier in enumerate(tiers):
            if not isinstance(
                tier, (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig, RemoteCacheTierConfig)
            ):
                raise TypeError(f"KVCacheManagerConfig.cache_tiers[{level}] must be a tier config, got {tier!r}")
            if isinstance(tier, RemoteCacheTierConfig) and level != len(tiers) - 1:
                raise ValueError(f"KVCacheManagerConfig.cache_tiers[{level}]: only the last tier may be remote")
            is_gpu = isinstance(tier, GpuCacheTierConfig)
            if level == 0 and not is_gpu:
                raise ValueError(f"KVCacheManagerConfig.cache_tiers[0] must be a GpuCacheTierConfig, got {tier!r}")
            if level > 0 and is_gpu:
                raise ValueError(f"KVCacheManagerConfig.cache_tiers[{level}]: only the first tier may be GPU")

    def _check_pool_ratio(self) -> None:
        """Any iterable of numbers (a list, a tuple, a 1-D NumPy array) becomes a tuple of floats. Its items are
        read as ``object``: compiled, a ``float`` loop variable would convert them (a bool too) unchecked."""
        name = "KVCacheManagerConfig.initial_pool_ratio"
        ratio: object = self.__dict__["initial_pool_ratio"]
        if ratio is None:
            return
        if isinstance(ratio, (str, bytes)) or getattr(ratio, "ndim", 1) != 1:
            raise TypeError(f"{name} must be a sequence of floats, got {ratio!r}")
        try:
            weights: list[object] = list(ratio)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of floats, got {ratio!r}") from None
        values = tuple(as_float(weight, f"{name}[{index}]") for index, weight in enumerate(weights))
        for weight in values:
            if weight <= 0:
                raise ValueError(f"{name} values must be positive (finite and > 0), got {weight}")
        self.initial_pool_ratio = values

    def _check_reuse_options(self) -> None:
        if self.swa_scratch_reuse is not None:
            if not isinstance(self.swa_scratch_reuse, SwaScratchReuseConfig):
                raise TypeError(
                    f"KVCacheManagerConfig.swa_scratch_reuse must be a SwaScratchReuseConfig, got "
                    f"{self.swa_scratch_reuse!r}"
                )
            self.enable_swa_scratch_reuse = True
        elif self.enable_swa_scratch_reuse:
            self.swa_scratch_reuse = SwaScratchReuseConfig()
        if not self.has_ssm_layers:
            return
        interval = self.ssm_reuse_interval
        if interval == 0 and not self.last_snapshot:
            raise ValueError(
                "KVCacheManagerConfig.ssm_reuse_interval=0 (no periodic snapshots) needs commit_min_snapshot or "
                "mamba_save_last_snapshot, else nothing of an SSM model could be reused"
            )
        if interval < 0 or interval % self.tokens_per_block != 0:
            raise ValueError(
                f"KVCacheManagerConfig.ssm_reuse_interval must be 0 or a positive multiple of tokens_per_block "
                f"{self.tokens_per_block}, got {interval}"
            )
        if self.enable_partial_reuse is True:
            raise ValueError("KVCacheManagerConfig.enable_partial_reuse=True is not supported with SSM layers")


def _revalidated_layer(layer: object) -> object:
    """A copy of a layer config (and its buffers) built through their checks again; anything else is left for the
    whole-config check to name."""
    if isinstance(layer, (AttentionLayerConfig, SsmLayerConfig)):
        buffers = [replace(buffer) if isinstance(buffer, BufferConfig) else buffer for buffer in layer.buffers]
        return replace(layer, buffers=buffers)
    return layer


def _revalidated_tier(tier: object) -> object:
    if isinstance(tier, (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig)):
        return replace(tier)
    return tier


def _revalidated_batch(batch: object) -> object:
    if isinstance(batch, BatchDesc):
        descs = [replace(desc) if isinstance(desc, KVCacheDesc) else desc for desc in batch.kv_caches]
        return replace(batch, kv_caches=descs)
    return batch
