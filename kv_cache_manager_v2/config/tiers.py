"""Cache tier configs: the GPU tier, host memory, disk and a remote store shared with other instances.

Local tiers are given a byte quota (and optionally a larger ``max_quota`` to grow into); the remote tier is given
the store to connect to, how its objects are keyed and, optionally, the deployment's secret that signs them. Each
class checks its own fields at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Final, final

from mypy_extensions import mypyc_attr

from .._base.remote_store import RemoteStoreConfig
from .._base.types import CacheTier
from .._base.validation import as_float, coerce_fields, refuse_subclass


# Fewer than 16 bytes: one object read from the store lets its reader guess them. More than 64 (a block of SHA-256,
# and BLAKE2b's limit) add nothing: a longer value is most likely not a key but a file or token passed by mistake.
SECRET_KEY_MIN_BYTES: Final = 16
SECRET_KEY_MAX_BYTES: Final = 64


def _check_quota(kind: str, quota: int, max_quota: int | None) -> None:
    if quota < 0:
        raise ValueError(f"{kind}.quota must be >= 0, got {quota}")
    if max_quota is not None and max_quota < quota:
        raise ValueError(f"{kind}.max_quota must be >= quota {quota}, got {max_quota}")


@final
@mypyc_attr(native_class=False)
@dataclass
class GpuCacheTierConfig:
    """GPU memory tier (the "GPU" lives in host memory on the cpu backend). Quotas are bytes."""

    quota: int
    max_quota: int | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "GpuCacheTierConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",))
        _check_quota("GpuCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.GPU_MEM``."""
        return CacheTier.GPU_MEM


@final
@mypyc_attr(native_class=False)
@dataclass
class HostCacheTierConfig:
    """Host memory tier (pinned on the cuda backend)."""

    quota: int
    max_quota: int | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "HostCacheTierConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",))
        _check_quota("HostCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.HOST_MEM``."""
        return CacheTier.HOST_MEM


@final
@mypyc_attr(native_class=False)
@dataclass
class DiskCacheTierConfig:
    """Disk tier: one file per pool inside the existing directory ``path``."""

    quota: int
    path: str
    max_quota: int | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "DiskCacheTierConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota",), optional_ints=("max_quota",), strs=("path",))
        _check_quota("DiskCacheTierConfig", self.quota, self.max_quota)

    @property
    def tier(self) -> CacheTier:
        """The kind of memory of this tier: ``CacheTier.DISK``."""
        return CacheTier.DISK


@final
@mypyc_attr(native_class=False)
@dataclass
class RemoteCacheTierConfig:
    """A store shared by many instances (Mooncake Store, see ``MooncakeStoreConfig``), colder than every local tier.

    Only the last entry of ``cache_tiers`` may be remote. ``quota``: bytes of this process's memory lent to the
    store (0: none, the store lives on other clients). ``backend``: connects at construction (``open(quota)``).
    ``namespace`` (required, not empty): what the layout cannot tell apart, at least the model's weights (name and
    revision) and its KV dtype, e.g. ``"llama-3.1-8b-instruct@main/bf16"``: objects are keyed by content plus a
    digest of the model's layout and this namespace, and two models with the same layer shapes (a fine-tune, a
    quantization) would otherwise serve each other's pages. ``write_through``: store each block
    when it is committed, so other instances can reuse it at once; False stores pages only as the coldest local
    tier drops them. ``retry_after_s``: after a failure the tier answers every lookup with a miss for this long.
    ``tensor_parallel_rank``: this instance's rank in its tensor-parallel group; ranks hold different heads in pages
    of the same shape, so the rank is part of every key (put the group's size in ``namespace``). Every field of
    every layer config is part of every key too, ``layer_id`` included: pipeline-parallel stages hold other layers
    in layers of the same shape, so each stage gives its layers their model-wide ids (or names itself in
    ``namespace``): a stage numbering its layers from 0 has the layout of the first stage and reads its pages.
    ``secret_key``: the deployment's secret (16 to 64 bytes, e.g. ``secrets.token_bytes(32)``), shared by the
    instances that may read each other's pages. Objects are then signed with it (HMAC-SHA256), so whoever can
    write to the store but lacks it cannot make an object this tier accepts, and it selects a key space of its own:
    deployments with other secrets (or none) never see each other's objects. It is never shown (``repr`` hides
    it) nor put in a key, log, event or statistic. None (the default): unsigned digests, which catch corruption,
    not forgery: everyone who can write to the store is trusted.
    """

    quota: int
    backend: RemoteStoreConfig
    namespace: str
    write_through: bool = True
    retry_after_s: float = 5.0
    tensor_parallel_rank: int = 0
    secret_key: bytes | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "RemoteCacheTierConfig")

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "secret_key"]
        hidden = "None" if self.__dict__["secret_key"] is None else "<hidden>"
        return f"RemoteCacheTierConfig({', '.join(shown)}, secret_key={hidden})"

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("quota", "tensor_parallel_rank"), strs=("namespace",), bools=("write_through",))
        if self.quota < 0:
            raise ValueError(f"RemoteCacheTierConfig.quota must be >= 0, got {self.quota}")
        if self.tensor_parallel_rank < 0:
            raise ValueError(f"RemoteCacheTierConfig.tensor_parallel_rank must be >= 0, got {self.tensor_parallel_rank}")
        if not self.namespace.strip():
            raise ValueError(
                f"RemoteCacheTierConfig.namespace must name the model (weights and revision) and its KV dtype, e.g. "
                f"'llama-3.1-8b-instruct@main/bf16', got {self.namespace!r}: models with the same layer shapes would "
                f"otherwise serve each other's pages"
            )
        if not callable(getattr(self.backend, "open", None)):
            raise TypeError(f"RemoteCacheTierConfig.backend must have an open(quota) method, got {self.backend!r}")
        retry = as_float(self.__dict__["retry_after_s"], "RemoteCacheTierConfig.retry_after_s")
        if retry < 0.0:
            raise ValueError(f"RemoteCacheTierConfig.retry_after_s must be a finite float >= 0, got {retry!r}")
        self.retry_after_s = retry
        _check_secret_key(self.__dict__["secret_key"])


def _check_secret_key(secret: object) -> None:
    """Refuse a secret of another type, too short to stay secret or too long to be a key, never showing it."""
    if secret is None:
        return
    if not isinstance(secret, bytes):
        raise TypeError(
            f"RemoteCacheTierConfig.secret_key must be bytes or None, got {type(secret).__name__} (its value is "
            f"not shown; a hex or base64 text decodes with bytes.fromhex or base64.b64decode)"
        )
    if not SECRET_KEY_MIN_BYTES <= len(secret) <= SECRET_KEY_MAX_BYTES:
        raise ValueError(
            f"RemoteCacheTierConfig.secret_key must be {SECRET_KEY_MIN_BYTES} to {SECRET_KEY_MAX_BYTES} bytes long "
            f"(a shorter one could be guessed from any object in the store), got {len(secret)} bytes"
        )


LocalCacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig
CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig | RemoteCacheTierConfig


def revalidated_tier(tier: object) -> object:
    """A copy of a local tier config built through its checks again (a remote tier config is passed on as it is);
    anything else is left for the whole-config check to name."""
    if isinstance(tier, (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig)):
        return replace(tier)
    return tier
