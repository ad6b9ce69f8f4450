"""Cache tier configs: the GPU tier, host memory, disk and a remote store shared with other instances.

Local tiers are given a byte quota (and optionally a larger ``max_quota`` to grow into); the remote tier is given
the store to connect to, how its objects are keyed and, optionally, the deployment's secret that signs them. Each
class checks its own fields at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Final, Sequence, final

from mypy_extensions import mypyc_attr

from .._base.remote_store import RemoteStoreConfig
from .._base.types import CacheTier
from .._base.validation import as_float, check_tensor_parallel_group, coerce_fields, refuse_subclass
from .._base.wording import counted


# Fewer than 16 bytes: one object read from the store lets its reader guess them. More than 64 (a block of SHA-256,
# and BLAKE2b's limit) add nothing: a longer value is most likely not a key but a file or token passed by mistake.
SECRET_KEY_MIN_BYTES: Final = 16
SECRET_KEY_MAX_BYTES: Final = 64
# Secrets read after the current one: a rotation under way and the one before it. Each costs every page a probe
# looks up one more key (in the same batch) while it is listed; more would mostly look for objects long evicted.
MAX_PREVIOUS_SECRET_KEYS: Final = 2


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
    ``bulk_write_back_deadline_s``: how long ``KVCacheManager.shutdown`` and ``clear_reusable_blocks``, which drop
    every cached page, keep handing those pages to the store (all of them without ``write_through``): no put starts
    after it, nor after a put failed during the call; the pages left are not stored
    (``RemoteTierStatistics.dropped_by_bulk_write_back``). A put under way when it passes ends by its backend's own
    bound (``MooncakeStoreConfig.put_deadline_s``); 0 stores nothing then. Puts after the call are not bounded by it.
    ``tensor_parallel_rank`` and ``tensor_parallel_size``: this instance's rank in its tensor-parallel group and
    the group's size (the rank below it); ranks hold different heads in pages of the same shape, and with more
    ranks than KV heads rank r of a group of 16 holds another head than rank r of a group of 8, so both are part of
    every key. Every field of
    every layer config is part of every key too, ``layer_id`` included: pipeline-parallel stages hold other layers
    in layers of the same shape, so each stage gives its layers their model-wide ids (or names itself in
    ``namespace``): a stage numbering its layers from 0 has the layout of the first stage and reads its pages.
    ``secret_key``: the deployment's secret (16 to 64 bytes, e.g. ``secrets.token_bytes(32)``), shared by the
    instances that may read each other's pages. Objects are then signed with it (HMAC-SHA256), so whoever can
    write to the store but lacks it cannot make an object this tier accepts, and it selects a key space of its own:
    deployments with other secrets (or none) never see each other's objects. It is never shown (``repr`` hides
    it) nor put in a key, log, event or statistic; the blocks' names in the keys are HMACs under it, so a listing
    of the store cannot be searched for a guessed prompt. None (the default): unsigned digests, which catch
    corruption, not forgery (everyone who can write to the store is trusted), and keys naming blocks by their plain
    chained hash (those of earlier versions: a guessed prompt's keys can be computed and looked for).
    ``previous_secret_keys``: up to ``MAX_PREVIOUS_SECRET_KEYS`` (2) other secrets, read only, to rotate
    ``secret_key`` without a cold cache: a page missing under ``secret_key`` is looked up under each of them (in
    the same probe batch: one more key per page and secret, no more round trips), an object found there is
    checked with that secret (a miss unless it verifies) and, with ``write_through``, stored again under
    ``secret_key``. Needs a ``secret_key``; neither repeated nor equal to it. A secret that leaked does not go here
    (its holder could make objects this tier accepts).
    """

    quota: int
    backend: RemoteStoreConfig
    namespace: str
    write_through: bool = True
    retry_after_s: float = 5.0
    tensor_parallel_rank: int = 0
    secret_key: bytes | None = None
    previous_secret_keys: Sequence[bytes] = ()
    bulk_write_back_deadline_s: float = 10.0
    tensor_parallel_size: int = 1

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "RemoteCacheTierConfig")

    def __repr__(self) -> str:
        secrets = ("secret_key", "previous_secret_keys")
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name not in secrets]
        hidden = "None" if self.__dict__["secret_key"] is None else "<hidden>"
        previous = ", ".join("<hidden>" for _ in self.__dict__["previous_secret_keys"])
        comma = "," if len(self.__dict__["previous_secret_keys"]) == 1 else ""
        return (
            f"RemoteCacheTierConfig({', '.join(shown)}, secret_key={hidden}, "
            f"previous_secret_keys=({previous}{comma}))"
        )

    def __post_init__(self) -> None:
        ints = ("quota", "tensor_parallel_rank", "tensor_parallel_size")
        coerce_fields(self, ints=ints, strs=("namespace",), bools=("write_through",))
        if self.quota < 0:
            raise ValueError(f"RemoteCacheTierConfig.quota must be >= 0, got {self.quota}")
        check_tensor_parallel_group(self.tensor_parallel_rank, self.tensor_parallel_size, "RemoteCacheTierConfig")
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
        name = "RemoteCacheTierConfig.bulk_write_back_deadline_s"
        bound = as_float(self.__dict__["bulk_write_back_deadline_s"], name)
        if bound < 0.0:
            raise ValueError(f"{name} must be a finite float >= 0, got {bound!r}")
        self.bulk_write_back_deadline_s = bound
        secret = self.__dict__["secret_key"]
        if secret is not None:
            _check_secret_key(secret, "secret_key")
        self.previous_secret_keys = _checked_previous_secret_keys(secret, self.__dict__["previous_secret_keys"])


def _check_secret_key(secret: object, name: str) -> bytes:
    """``secret`` as bytes; a secret of another type, too short to stay secret or too long to be a key is refused,
    never shown."""
    if not isinstance(secret, bytes):
        allowed = "bytes or None" if name == "secret_key" else "bytes"
        raise TypeError(
            f"RemoteCacheTierConfig.{name} must be {allowed}, got {type(secret).__name__} (its value is not shown; a "
            f"hex or base64 text decodes with bytes.fromhex or base64.b64decode)"
        )
    if not SECRET_KEY_MIN_BYTES <= len(secret) <= SECRET_KEY_MAX_BYTES:
        raise ValueError(
            f"RemoteCacheTierConfig.{name} must be {SECRET_KEY_MIN_BYTES} to {SECRET_KEY_MAX_BYTES} bytes long "
            f"(a shorter one could be guessed from any object in the store), got {counted(len(secret), 'byte')}"
        )
    return secret


def _checked_previous_secret_keys(secret: bytes | None, previous: object) -> tuple[bytes, ...]:
    """``previous_secret_keys`` as a tuple, each one checked like ``secret_key``, none repeated nor the current
    one; never showing any of them."""
    name = "RemoteCacheTierConfig.previous_secret_keys"
    if isinstance(previous, (bytes, bytearray, str)) or not isinstance(previous, (tuple, list)):
        raise TypeError(
            f"{name} must be a tuple or list of bytes values, got {type(previous).__name__} (its value is not "
            f"shown; a single previous secret goes in a tuple: (old_secret,))"
        )
    if len(previous) > MAX_PREVIOUS_SECRET_KEYS:
        raise ValueError(
            f"{name} holds at most {MAX_PREVIOUS_SECRET_KEYS} secrets (each one costs every page a probe misses "
            f"another lookup), got {len(previous)}"
        )
    if previous and secret is None:
        raise ValueError(
            f"{name} needs a secret_key: pages are read under the previous secrets and written under the current "
            f"one, never unsigned"
        )
    keys: list[bytes] = []  # checked one by one: compiled, a tuple[bytes, ...] of them would refuse a str unnamed
    for index, entry in enumerate(previous):
        key = _check_secret_key(entry, f"previous_secret_keys[{index}]")
        if key == secret:
            raise ValueError(f"{name}[{index}] is secret_key itself: list only the secrets it replaced")
        if key in keys:
            raise ValueError(f"{name}[{index}] repeats previous_secret_keys[{keys.index(key)}]")
        keys.append(key)
    return tuple(keys)


LocalCacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig
CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig | RemoteCacheTierConfig


def revalidated_tier(tier: object) -> object:
    """A copy of a local tier config built through its checks again (a remote tier config is passed on as it is);
    anything else is left for the whole-config check to name."""
    if isinstance(tier, (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig)):
        return replace(tier)
    return tier
