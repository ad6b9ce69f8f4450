"""Page index conversion: base slot ids -> per-(layer, role) kernel page indices (SHARED, PER_LAYER, scratch)."""

from __future__ import annotations

from array import array
from typing import Final, Iterable, SupportsIndex, final

from .._base.types import BAD_PAGE_INDEX, HalfOpenRange, PageIndexMode, Sealed
from .._base.validation import as_int, as_non_negative_int
from .._base.wording import counted


@final
class ScratchDesc(Sealed):
    """Scratch blocks ``range`` of one life cycle and the coalesced slots that hold them; truthy iff non-empty.
    Immutable; ``slot_ids`` (any sequence of slot ids >= 0, NumPy integers too) is kept as a tuple of plain ints,
    so a converter or kernel given it never turns a bad slot id into a page index."""

    def __init__(self, range: HalfOpenRange, slot_ids: Iterable[SupportsIndex]) -> None:
        if not isinstance(range, HalfOpenRange):
            raise TypeError(f"ScratchDesc.range must be a HalfOpenRange, got {type(range).__name__} {range!r}")
        if range.beg < 0 or range.end < range.beg:
            # A reversed range is a mistake, not an empty scratch (that is [b, b)); a negative start would shift
            # every scratch page of the converter onto another slot.
            raise ValueError(f"ScratchDesc.range must be [beg, end) with 0 <= beg <= end, got {range!r}")
        self._range = range
        self._slot_ids = as_slot_ids(slot_ids, "ScratchDesc.slot_ids")

    @property
    def range(self) -> HalfOpenRange:
        """The scratch block ordinals."""
        return self._range

    @property
    def slot_ids(self) -> tuple[int, ...]:
        """The coalesced slots holding the scratch blocks' pages, in order."""
        return self._slot_ids

    def __bool__(self) -> bool:
        return bool(self._range)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScratchDesc) and other.range == self._range and other.slot_ids == self._slot_ids

    def __hash__(self) -> int:
        return hash((self._range, self._slot_ids))

    def __repr__(self) -> str:
        return f"ScratchDesc(range={self._range!r}, slot_ids={self._slot_ids!r})"

    def __reduce__(self) -> tuple[type[ScratchDesc], tuple[HalfOpenRange, tuple[int, ...]]]:
        return (ScratchDesc, (self._range, self._slot_ids))


def as_slot_ids(values: object, name: str) -> tuple[int, ...]:
    """Slot ids as plain ints, each >= 0 (``name[i]`` in the error)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__} {values!r}")
    return tuple(as_non_negative_int(value, f"{name}[{i}]") for i, value in enumerate(values))


# Page tables are int32 (``get_base_page_indices``' ``array('i')``, the kernels' tables): a converted page index
# must fit one.
_INT32_LIMIT: Final = 2**31
# The modes as module constants: a member lookup on the enum class costs more than the comparison itself.
_SHARED: Final = PageIndexMode.SHARED
_PER_LAYER: Final = PageIndexMode.PER_LAYER
_FIELDS: Final = ("scale", "expansion", "layer_offset", "scratch_pages_per_block", "scratch_page_in_block")


@final
class PageIndexConverter(Sealed):
    """Maps base page indices (slot ids, one per block ordinal from 0) to one buffer's page indices.

    SHARED: ``s * scale``; PER_LAYER: ``s * scale + layer_offset``; then each index ``i`` expands to
    ``i * expansion + j`` for ``j < expansion``; ``-1`` stays ``-1``. In PER_LAYER mode scratch block ``o`` maps
    to ``t = (o - range.beg) * ppb + k``, index ``slot_ids[t // scale] * scale + t % scale``.
    Example: scale 4, offset 1, expansion 2, PER_LAYER: [3, -1] -> [26, 27, -1, -1].

    Immutable, with TensorRT-LLM's fields. Its fields are checked as every integer the package takes (NumPy
    integers accepted, bools and floats refused, in both modes: compiled, a dataclass's ``int`` field turned
    ``True`` into 1 and refused NumPy integers), and must keep every page inside its own slot: a layer offset or
    scratch page past the slot would give valid slot ids another buffer's pages, or pages past the pool's end.
    """

    def __init__(
        self,
        scale: SupportsIndex,
        expansion: SupportsIndex,
        layer_offset: SupportsIndex,
        scratch_pages_per_block: SupportsIndex,
        scratch_page_in_block: SupportsIndex,
    ) -> None:
        values = (scale, expansion, layer_offset, scratch_pages_per_block, scratch_page_in_block)
        checked = [as_int(value, f"PageIndexConverter.{name}") for name, value in zip(_FIELDS, values)]
        self._scale: int = checked[0]
        self._expansion: int = checked[1]
        self._layer_offset: int = checked[2]
        self._pages_per_block: int = checked[3]
        self._page_in_block: int = checked[4]
        for name, value, low, high in (
            ("scale", self._scale, 1, _INT32_LIMIT),
            ("expansion", self._expansion, 1, _INT32_LIMIT),
            ("layer_offset", self._layer_offset, 0, self._scale),
            ("scratch_pages_per_block", self._pages_per_block, 1, self._scale + 1),
            ("scratch_page_in_block", self._page_in_block, 0, self._pages_per_block),
        ):
            if not low <= value < high:
                raise ValueError(f"PageIndexConverter.{name} must be in [{low}, {high}), got {value}")

    @property
    def scale(self) -> int:
        """Buffers in the pool's coalesced buffer: page indices per slot."""
        return self._scale

    @property
    def expansion(self) -> int:
        """Pages per block of this buffer (``tokens_per_block / tokens_per_block_override``)."""
        return self._expansion

    @property
    def layer_offset(self) -> int:
        """This (layer, role) buffer's position inside the coalesced slot."""
        return self._layer_offset

    @property
    def scratch_pages_per_block(self) -> int:
        """How many of this layer's buffers the pool holds (``ppb``)."""
        return self._pages_per_block

    @property
    def scratch_page_in_block(self) -> int:
        """This buffer's position among them (``k``)."""
        return self._page_in_block

    def _fields(self) -> tuple[int, int, int, int, int]:
        return (self._scale, self._expansion, self._layer_offset, self._pages_per_block, self._page_in_block)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PageIndexConverter) and (
            other.scale,
            other.expansion,
            other.layer_offset,
            other.scratch_pages_per_block,
            other.scratch_page_in_block,
        ) == self._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in zip(_FIELDS, self._fields()))
        return f"PageIndexConverter({fields})"

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
            index_mode = _SHARED
        elif not isinstance(index_mode, PageIndexMode):
            raise TypeError(f"index_mode must be a PageIndexMode, got {index_mode!r}")
        if has_scratch and index_mode != _PER_LAYER:
            raise ValueError(f"scratch requires index_mode=PageIndexMode.PER_LAYER, got {index_mode}")
        scale = self._scale
        expansion = self._expansion
        offset = self._layer_offset if index_mode == _PER_LAYER else 0
        if not has_scratch and expansion == 1 and type(base_indices) is array and base_indices.typecode == "i":
            # What ``get_base_page_indices`` returns (int32 by construction; another typecode, floats, takes the
            # checked loop): an engine converts one per layer at every step, so no per-index type checks. The
            # result is checked instead of the input (one pass fewer): as ``offset < scale``, an index below
            # BAD_PAGE_INDEX gives a result below it, an index past int32 a result past it; either takes the
            # checked loop, which names it.
            # A list of ints (C-fast ``tolist``): compiled, the loop below then runs on native ints, not boxed ones.
            slots: list[int] = base_indices.tolist()
            converted = [BAD_PAGE_INDEX if slot == BAD_PAGE_INDEX else slot * scale + offset for slot in slots]
            if not converted or (min(converted) >= BAD_PAGE_INDEX and max(converted) < _INT32_LIMIT):
                return converted
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
        index_limit = _INT32_LIMIT // expansion  # index * expansion + expansion - 1 must fit int32
        result: list[int] = []
        for ordinal, raw in enumerate(base_indices):
            if scratch_beg <= ordinal < scratch_end:
                t = (ordinal - scratch_beg) * self._pages_per_block + self._page_in_block
                slot_position = t // scale
                if slot_position >= len(slot_ids):
                    raise ValueError(
                        f"scratch descriptor has {counted(len(slot_ids), 'slot')}, too few for block {ordinal} of "
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
                    raise ValueError(
                        f"base_indices[{ordinal}]: base page index must be >= 0 or {BAD_PAGE_INDEX}, got {slot}"
                    )
                index = slot * scale + offset
            if index >= index_limit:
                raise ValueError(
                    f"page index of base_indices[{ordinal}] overflows int32 (the page tables' type): "
                    f"{index} x expansion {expansion} >= 2**31"
                )
            if expansion == 1:
                result.append(index)
            else:
                first = index * expansion
                for j in range(expansion):
                    result.append(first + j)
        return result

    def __reduce__(self) -> tuple[type[PageIndexConverter], tuple[int, int, int, int, int]]:
        return (PageIndexConverter, self._fields())
