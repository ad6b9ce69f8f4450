"""Batch shapes the manager plans its pool split for: a batch of caches, each with a capacity and a history.

``KVCacheManagerConfig.constraints`` must always fit at once; ``typical_step`` decides the first split of every
tier across pool groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, final

from mypy_extensions import mypyc_attr

from .._base.validation import check_iterable, coerce_fields, refuse_subclass


@final
@mypyc_attr(native_class=False)
@dataclass
class KVCacheDesc:
    """Shape of one cache for planning: ``capacity`` tokens of which ``history_length`` are history."""

    capacity: int
    history_length: int

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "KVCacheDesc")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("capacity", "history_length"))
        if self.capacity < 0:
            raise ValueError(f"KVCacheDesc.capacity must be >= 0, got {self.capacity}")
        if not 0 <= self.history_length <= self.capacity:
            raise ValueError(
                f"KVCacheDesc.history_length {self.history_length} must be in [0, capacity {self.capacity}]"
            )


@final
@mypyc_attr(native_class=False)
@dataclass
class BatchDesc:
    """A step's worth of caches; the first ``system_prompt_length`` tokens are shared by all of them."""

    kv_caches: Sequence[KVCacheDesc]
    system_prompt_length: int = 0

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "BatchDesc")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("system_prompt_length",))
        check_iterable(self.kv_caches, "BatchDesc.kv_caches")
        self.kv_caches = tuple(self.kv_caches)
        if self.system_prompt_length < 0:
            raise ValueError(f"BatchDesc.system_prompt_length must be >= 0, got {self.system_prompt_length}")
        for desc in self.kv_caches:
            if not isinstance(desc, KVCacheDesc):
                raise TypeError(f"BatchDesc.kv_caches must hold KVCacheDesc, got {desc!r}")


def revalidated_batch(batch: object) -> object:
    """A copy of a batch shape (and of its caches' shapes) built through their checks again; anything else is left
    for the whole-config check to name."""
    if isinstance(batch, BatchDesc):
        descs = [replace(desc) if isinstance(desc, KVCacheDesc) else desc for desc in batch.kv_caches]
        return replace(batch, kv_caches=descs)
    return batch
