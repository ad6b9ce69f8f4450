"""The manager config: every choice a ``KVCacheManager`` is built from, and its whole-config checks.

Each layer, tier and batch config checks its own fields; the checks here are the ones that need the whole config
(tier order, layer ids, buffer paging against ``tokens_per_block``, SSM reuse rules, the pool-ratio weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final, Sequence, final

from mypy_extensions import mypyc_attr

from .._base.types import MAX_BLOCKS_PER_CACHE
from .._base.validation import (
    as_bounded_float,
    as_float,
    as_non_negative_int,
    check_iterable,
    coerce_fields,
    refuse_subclass,
)
from .batches import BatchDesc, revalidated_batch
from .layers import AttentionLayerConfig, LayerConfig, SsmLayerConfig, revalidated_layer
from .tiers import (
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    LocalCacheTierConfig,
    RemoteCacheTierConfig,
    revalidated_tier,
)

BACKENDS: Final = ("auto", "cuda", "cpu")


def _non_negative(value: float) -> bool:
    return value >= 0.0


def _above_one(value: float) -> bool:
    return value > 1.0


def _in_unit_range(value: float) -> bool:
    return 0.0 < value <= 1.0


def _in_watermark_range(value: float) -> bool:
    return 0.0 <= value < 1.0


@final
@mypyc_attr(native_class=False)
@dataclass
class SwaScratchReuseConfig:
    """Sliding-window prefill scratch reuse: during a prefill chunk, blocks already out of the window when the
    chunk ends share a few scratch slots instead of taking a page each. The next chunk may start up to
    ``max_rewind_len`` tokens before this one's end, so blocks that close to the end keep real pages.

    Those blocks are not cached, so a later request can reuse a prefix only where a chunk ended: declare a shared
    prefix's end (``create_kv_cache(snapshot_at=...)``) and end a chunk at ``KVCache.snapshot_points``."""

    max_rewind_len: int = 0

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "SwaScratchReuseConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("max_rewind_len",))
        if self.max_rewind_len < 0:
            raise ValueError(f"SwaScratchReuseConfig.max_rewind_len must be >= 0, got {self.max_rewind_len}")


@final
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
      SSM layers. With SSM layers a reuse may end inside a block only where an SSM snapshot ends exactly there.
    - ``enable_swa_scratch_reuse`` / ``swa_scratch_reuse``: see ``SwaScratchReuseConfig``.
    - ``ssm_reuse_interval``: SSM states are snapshotted where a commit ends a computed chunk on a multiple of this
      many tokens; with SSM layers, prefix reuse can resume only from such a snapshot.
    - ``constraints``: batches that must always fit in the GPU tier at once; each pool group gets at least the
      slots the largest of them needs (construction fails if the quota cannot hold them).
    - ``typical_step``: the batch the GPU and other tiers are first split for across pool groups (default: 8
      caches of 4,096 tokens in a decode step, one new token each; where its split would leave a pool group
      without a slot or admit no new cache, as a hybrid's SSM group on a tier much smaller than that step, the
      default is that step with fewer, then shorter caches, the largest that serves the tier); ``need_adjustment``/``adjust`` later re-split
      for the requests really seen. Declare it when the tiers are smaller than that step or the engine runs
      prefill chunks: the default split can leave a sliding-window group too few slots for one chunk
      (``KVCacheManager.max_admissible(chunk)`` shows it) and an SSM group room for a snapshot or two, which
      later requests then rarely find.
    - ``max_util_for_resume``: ``resume`` refuses (returns False) when a GPU pool group is fuller than this: it may
      lock at most ``int(max_util_for_resume * slots)`` of each, so the default 0.97 keeps at least one slot of
      every pool group back (an SSM group of 2 slots, as a small tier has, runs one cache at a time); 1.0 keeps none.
    - ``admission_watermark``: the fraction of each GPU pool group kept free for running caches to grow into: a
      ``resume`` (a new cache's included) or batch admission that would leave less of it unlocked is refused (its
      ``Refusal.by_watermark`` says so), while ``resize`` of a running cache may use it. 0 (default) keeps none.
    - ``enable_kv_events`` / ``max_kv_events``: record block stored/removed events for KV-aware routers, keeping
      the newest ``max_kv_events`` until ``get_latest_events`` takes them.
    - ``commit_min_snapshot`` / ``mamba_save_last_snapshot`` (the two TensorRT-LLM names of one behaviour): SSM
      states are also snapshotted where each commit ends on a block boundary, and the prompt's last full block is
      one of each cache's ``KVCache.snapshot_points`` (a prefill chunk ending there takes it: the next turn of a
      conversation resumes from there); with either set, ``ssm_reuse_interval=0`` turns the periodic snapshots off.
      Neither is required with SSM layers (the interval and ``snapshot_prefill_chunks`` serve reuse without them).
    - ``snapshot_prefill_chunks`` (default on): SSM states are also snapshotted where a commit ends a computed
      chunk on a block boundary inside the prompt (the ``input_tokens`` a cache was created with), so a chunked
      prefill leaves a reusable point at each chunk end; decode steps take none (only the interval's). Declared
      boundaries come from ``create_kv_cache(snapshot_at=...)`` / ``KVCacheRequest.snapshot_at``.
    - ``reuse_match_backoff``: tokens trimmed off the end of every prefix match (for state that reads that many
      tokens ahead of a position).
    - ``initial_pool_ratio``: one positive weight per layer group; each tier is first split across pool groups in
      these byte proportions instead of by ``typical_step`` (normalized: the weights need not sum to 1).
    - ``enable_stats``: collect iteration statistics (``get_and_reset_iteration_stats``); off, they stay empty.
    - ``text_only``: the default of ``create_kv_cache(text_only=...)`` and the setting of every batch-admitted
      cache: a text-only cache refuses multimodal (``bytes``) tokens with ``ValueError`` (at creation, in a batch
      request, in ``commit``).

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
    snapshot_prefill_chunks: bool = True
    admission_watermark: float = 0.0
    rebalance_min_sampled_kv_caches: int = 16
    rebalance_cooldown_secs: float = 0.0
    rebalance_ratio_threshold: float = 1.1

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "KVCacheManagerConfig")

    def __post_init__(self) -> None:
        coerce_fields(
            self,
            ints=(
                "tokens_per_block", "ssm_reuse_interval", "max_kv_events", "reuse_match_backoff",
                "rebalance_min_sampled_kv_caches",
            ),
            optional_ints=("vocab_size",),
            strs=("backend",),
            bools=(
                "enable_swa_scratch_reuse",
                "enable_kv_events",
                "mamba_save_last_snapshot",
                "commit_min_snapshot",
                "enable_stats",
                "text_only",
                "snapshot_prefill_chunks",
            ),
        )
        if self.max_kv_events <= 0:
            raise ValueError(f"KVCacheManagerConfig.max_kv_events must be > 0, got {self.max_kv_events}")
        self._check_rebalance_gates()
        if self.reuse_match_backoff < 0:
            raise ValueError(f"KVCacheManagerConfig.reuse_match_backoff must be >= 0, got {self.reuse_match_backoff}")
        if self.__dict__["enable_partial_reuse"] is not None:
            coerce_fields(self, bools=("enable_partial_reuse",))
        for name in ("layers", "cache_tiers", "constraints"):
            check_iterable(getattr(self, name), f"KVCacheManagerConfig.{name}")
        self.layers = tuple(self.layers)
        self.cache_tiers = tuple(self.cache_tiers)
        self.constraints = tuple(self.constraints)
        self._check_basics()
        self._check_layers()
        self._check_tiers()
        self._check_reuse_options()
        self._check_token_spans()
        self._check_pool_ratio()

    def validated(self) -> KVCacheManagerConfig:
        """A checked copy of this config and of every config it holds, so that fields changed after
        construction are checked too (the manager builds from this copy: later changes cannot reach it)."""
        scratch: object = self.swa_scratch_reuse
        changes: dict[str, Any] = {  # re-checked by __post_init__, whatever a caller stored there
            "layers": [revalidated_layer(layer) for layer in self.layers],
            "cache_tiers": [revalidated_tier(tier) for tier in self.cache_tiers],
            "constraints": [revalidated_batch(batch) for batch in self.constraints],
            "typical_step": None if self.typical_step is None else revalidated_batch(self.typical_step),
            "swa_scratch_reuse": replace(scratch) if isinstance(scratch, SwaScratchReuseConfig) else scratch,
            "initial_pool_ratio": None if self.initial_pool_ratio is None else list(self.initial_pool_ratio),
        }
        return replace(self, **changes)

    @property
    def last_snapshot(self) -> bool:
        """``commit_min_snapshot`` or ``mamba_save_last_snapshot``: SSM states are also snapshotted where each
        commit ends (on a block boundary), and a prefill chunk stops at the prompt's last full block
        (``KVCache.snapshot_points``), so the end of a prompt is reusable whatever its length."""
        return self.commit_min_snapshot or self.mamba_save_last_snapshot

    @property
    def admission_util(self) -> float:
        """The GPU utilisation an admission may reach: ``max_util_for_resume`` less the watermark's share."""
        return min(self.max_util_for_resume, 1.0 - self.admission_watermark)

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

    def _check_rebalance_gates(self) -> None:
        """The rebalancing gates (``need_adjustment``): a sample count, a cooldown and a ratio above one."""
        self.rebalance_min_sampled_kv_caches = as_non_negative_int(
            self.__dict__["rebalance_min_sampled_kv_caches"], "KVCacheManagerConfig.rebalance_min_sampled_kv_caches"
        )
        self.rebalance_cooldown_secs = as_bounded_float(
            self.__dict__["rebalance_cooldown_secs"], "KVCacheManagerConfig.rebalance_cooldown_secs", "[0, inf)",
            _non_negative,
        )
        self.rebalance_ratio_threshold = as_bounded_float(
            self.__dict__["rebalance_ratio_threshold"], "KVCacheManagerConfig.rebalance_ratio_threshold", "(1, inf)",
            _above_one,
        )

    def _check_basics(self) -> None:
        tpb = self.tokens_per_block
        if tpb <= 0:
            raise ValueError(f"KVCacheManagerConfig.tokens_per_block must be > 0, got {tpb}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"KVCacheManagerConfig.vocab_size must be > 0, got {self.vocab_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"KVCacheManagerConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        self.max_util_for_resume = as_bounded_float(
            self.__dict__["max_util_for_resume"], "KVCacheManagerConfig.max_util_for_resume", "(0, 1]", _in_unit_range
        )
        self.admission_watermark = as_bounded_float(
            self.__dict__["admission_watermark"], "KVCacheManagerConfig.admission_watermark", "[0, 1)", _in_watermark_range
        )
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
            if level > 0 and is_gpu and not isinstance(tiers[level - 1], GpuCacheTierConfig):
                # A later GPU tier holds cold (codec-encoded) pages: the manager needs ``cold_page_codec`` for it.
                raise ValueError(
                    f"KVCacheManagerConfig.cache_tiers[{level}]: a GPU tier may only follow GPU tiers"
                )

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

    def _check_token_spans(self) -> None:
        """A window, a sink count or a rewind no cache can span (``MAX_BLOCKS_PER_CACHE`` blocks) changes nothing a
        cache does, yet the admission answers (``max_admissible``) step through that many tokens: refused here."""
        longest = MAX_BLOCKS_PER_CACHE * self.tokens_per_block
        spans = [("SwaScratchReuseConfig.max_rewind_len", self.max_rewind_len)]
        for layer in self.layers:
            if isinstance(layer, AttentionLayerConfig):
                spans.append((f"AttentionLayerConfig.sliding_window_size (layer {layer.layer_id})",
                              layer.sliding_window_size or 0))
                spans.append(
                    (f"AttentionLayerConfig.num_sink_tokens (layer {layer.layer_id})", layer.num_sink_tokens or 0)
                )
        for name, tokens in spans:
            if tokens > longest:
                raise ValueError(
                    f"{name} must be at most the longest cache, {MAX_BLOCKS_PER_CACHE} blocks of tokens_per_block "
                    f"{self.tokens_per_block} = {longest} tokens, got {tokens}"
                )

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
        if interval == 0 and not self.last_snapshot and not self.snapshot_prefill_chunks:
            raise ValueError(
                "KVCacheManagerConfig.ssm_reuse_interval=0 (no periodic snapshots) needs snapshot_prefill_chunks, "
                "commit_min_snapshot or mamba_save_last_snapshot, else nothing of an SSM model could be reused"
            )
        if interval < 0 or interval % self.tokens_per_block != 0:
            raise ValueError(
                f"KVCacheManagerConfig.ssm_reuse_interval must be 0 or a positive multiple of tokens_per_block "
                f"{self.tokens_per_block}, got {interval}"
            )
