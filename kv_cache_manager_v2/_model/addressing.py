"""Page index conversion: base slot ids -> per-(layer, role) kernel page indices (SHARED, PER_LAYER, scratch)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterable, SupportsIndex, final

from .._base.types import BAD_PAGE_INDEX, HalfOpenRange, PageIndexMode, Sealed
from .._base.validation import as_int


@final
@dataclass(frozen=True)
class ScratchDesc(Sealed):
    """Scratch blocks ``range`` of one life cycle and the coalesced slots that hold them; truthy iff non-empty."""

    range: HalfOpenRange
    slot_ids: tuple[int, ...]

    def __bool__(self) -> bool:
        return bool(self.range)

    def __reduce__(self) -> tuple[type[ScratchDesc], tuple[HalfOpenRange, tuple[int, ...]]]:
        return (ScratchDesc, (self.range, self.slot_ids))


@final
@dataclass(frozen=True)
class PageIndexConverter(Sealed):
    """Maps base page indices (slot ids, one per block ordinal from 0) to one buffer's page indices.

    SHARED: ``s * scale``; PER_LAYER: ``s * scale + layer_offset``; then each index ``i`` expands to
    ``i * expansion + j`` for ``j < expansion``; ``-1`` stays ``-1``. In PER_LAYER mode scratch block ``o`` maps
    to ``t = (o - range.beg) * ppb + k``, index ``slot_ids[t // scale] * scale + t % scale``.
    Example: scale 4, offset 1, expansion 2, PER_LAYER: [3, -1] -> [26, 27, -1, -1].
    """

    scale: int
    expansion: int
    layer_offset: int
    scratch_pages_per_block: int
    scratch_page_in_block: int

    def __call__(
        self,
        base_indices: Iterable[SupportsIndex],
        index_mode: PageIndexMode | None = None,
        scratch: ScratchDesc | None = None,
    ) -> list[int]:
        if scratch is not None and not isinstance(scratch, ScratchDesc):
            raise TypeError(f"scratch must be a ScratchDesc or None, got {scratch!r}")
        has_scratch = scratch is not None and bool(scratch)
        if index_mode is None:
            if has_scratch:
                raise ValueError("scratch requires index_mode=PageIndexMode.PER_LAYER, got index_mode=None")
            index_mode = PageIndexMode.SHARED
        elif not isinstance(index_mode, PageIndexMode):
            raise TypeError(f"index_mode must be a PageIndexMode, got {index_mode!r}")
        if has_scratch and index_mode != PageIndexMode.PER_LAYER:
            raise ValueError(f"scratch requires index_mode=PageIndexMode.PER_LAYER, got {index_mode}")
        scale = self.scale
        expansion = self.expansion
        offset = self.layer_offset if index_mode == PageIndexMode.PER_LAYER else 0
        if not has_scratch and expansion == 1 and type(base_indices) is array:
            # What ``get_base_page_indices`` returns (plain ints by construction): an engine converts one per layer
            # at every step, so no per-index type checks; an index below BAD_PAGE_INDEX takes the checked loop.
            if not base_indices or min(base_indices) >= BAD_PAGE_INDEX:
                return [BAD_PAGE_INDEX if slot == BAD_PAGE_INDEX else slot * scale + offset for slot in base_indices]
        scratch_beg = 0
        scratch_end = 0
        slot_ids: tuple[int, ...] = ()
        if scratch is not None and has_scratch:
            scratch_beg = scratch.range.beg
            scratch_end = scratch.range.end
            slot_ids = scratch.slot_ids
        if isinstance(base_indices, (str, bytes)) or not hasattr(base_indices, "__iter__"):
            raise TypeError(
                f"base_indices must be a sequence of ints (list, array or 1-D NumPy array), got {base_indices!r}"
            )
        result: list[int] = []
        for ordinal, raw in enumerate(base_indices):
            if scratch_beg <= ordinal < scratch_end:
                t = (ordinal - scratch_beg) * self.scratch_pages_per_block + self.scratch_page_in_block
                slot_position = t // scale
                if slot_position >= len(slot_ids):
                    raise ValueError(
                        f"scratch descriptor has {len(slot_ids)} slot(s), too few for block {ordinal} of "
                        f"range [{scratch_beg}, {scratch_end})"
                    )
                index = slot_ids[slot_position] * scale + t % scale
            else:
                slot = raw if type(raw) is int else as_int(raw, f"base_indices[{ordinal}]")  # fast path: a plain int
                if slot == BAD_PAGE_INDEX:
                    for _ in range(expansion):
                        result.append(BAD_PAGE_INDEX)
                    continue
                if slot < 0:
                    raise ValueError(f"base page index must be >= 0 or {BAD_PAGE_INDEX}, got {slot}")
                index = slot * scale + offset
            if expansion == 1:
                result.append(index)
            else:
                first = index * expansion
                for j in range(expansion):
                    result.append(first + j)
        return result

    def __reduce__(self) -> tuple[type[PageIndexConverter], tuple[int, int, int, int, int]]:
        return (
            PageIndexConverter,
            (self.scale, self.expansion, self.layer_offset, self.scratch_pages_per_block, self.scratch_page_in_block),
        )
